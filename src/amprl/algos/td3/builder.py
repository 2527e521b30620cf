"""TD3's parts for a run, as ``amprl.algos.builder("td3")`` hands them out (an
``amprl.algos.Builder``)."""

from __future__ import annotations

import numpy as np
import torch

from amprl.algos.td3.acting import ActingPolicy, TD3Behaviour
from amprl.algos.td3.learning import TD3Algo
from amprl.algos.td3.networks import build_network
from amprl.config import ExperimentConfig
from amprl.core import Algorithm, Behaviour, Policy
from amprl.envs.spec import EnvSpec


def build_model(cfg: ExperimentConfig, spec: EnvSpec) -> torch.nn.Module:
    """A TD3Model for ``spec``."""
    return build_network(cfg, spec)


def make_learner(cfg: ExperimentConfig, model: torch.nn.Module, device: torch.device) -> Algorithm:
    return TD3Algo(cfg, model, device)


def make_behaviour(cfg: ExperimentConfig, spec: EnvSpec, model: torch.nn.Module, actor_id: str,
                   rng: np.random.Generator) -> Behaviour:
    return TD3Behaviour(cfg, spec, model, actor_id, rng)


def make_greedy_policy(model: torch.nn.Module) -> Policy:
    """The evaluator's policy: its deterministic policy."""
    return ActingPolicy(model)
