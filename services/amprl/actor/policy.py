"""Batched greedy actions from a model replica (actors and the evaluator)."""

from __future__ import annotations

import numpy as np
import torch

from amprl.config import ExperimentConfig
from amprl.envs.spec import EnvSpec


@torch.inference_mode()
def q_values(model: torch.nn.Module, obs: np.ndarray) -> torch.Tensor:
    return model(torch.from_numpy(np.ascontiguousarray(obs)))


@torch.inference_mode()
def act_greedy(model: torch.nn.Module, cfg: ExperimentConfig, spec: EnvSpec, obs: np.ndarray) -> np.ndarray:
    """[B] int64 argmax-Q actions (DQN) or [B, action_dim] float32 deterministic actions (TD3)."""
    if cfg.algo == "dqn":
        return q_values(model, obs).argmax(dim=1).numpy()
    out = model.actor(torch.from_numpy(np.ascontiguousarray(obs)))
    return out.float().numpy()
