"""DQN's parts for a run, as ``amprl.algos.builder("dqn")`` hands them out (an
``amprl.algos.Builder``)."""

from __future__ import annotations

import numpy as np
import torch

from amprl.algos.dqn.acting import DQNBehaviour, GreedyQPolicy
from amprl.algos.dqn.learning import DQNAlgo
from amprl.algos.dqn.networks import build_network
from amprl.config import ExperimentConfig
from amprl.core import Algorithm, Behaviour, Policy
from amprl.envs.spec import EnvSpec


def build_model(cfg: ExperimentConfig, spec: EnvSpec) -> torch.nn.Module:
    """A QNetwork for ``spec``."""
    return build_network(cfg, spec)


def make_learner(cfg: ExperimentConfig, model: torch.nn.Module, device: torch.device) -> Algorithm:
    return DQNAlgo(cfg, model, device)


def make_behaviour(cfg: ExperimentConfig, spec: EnvSpec, model: torch.nn.Module, actor_id: str,
                   rng: np.random.Generator) -> Behaviour:
    return DQNBehaviour(cfg, spec, model, actor_id, rng)


def make_greedy_policy(model: torch.nn.Module) -> Policy:
    """The evaluator's policy: argmax of its Q-values."""
    return GreedyQPolicy(model)
