"""TD3's networks (Fujimoto et al. 2018): a deterministic actor pi(s) and twin critics
Q1(s, a), Q2(s, a), MLPs over vector observations."""

from __future__ import annotations

import math

import torch
from torch import nn

from amprl.algos import check_action_space
from amprl.config import ExperimentConfig
from amprl.envs.spec import EnvSpec
from amprl.rl.networks import mlp, to_float


class DeterministicActor(nn.Module):
    """pi(s) = tanh(MLP(s)) scaled to [action_low, action_high]."""

    action_scale: torch.Tensor  # buffers (register_buffer), declared for type checkers
    action_bias: torch.Tensor

    def __init__(self, obs_dim: int, action_dim: int, hidden_sizes: list[int],
                 low: torch.Tensor, high: torch.Tensor):
        super().__init__()
        self.net = mlp([obs_dim, *hidden_sizes, action_dim], final_activation=False)
        # Not persistent: constants from the EnvSpec are not weights the server owns.
        self.register_buffer("action_scale", (high - low) / 2.0, persistent=False)
        self.register_buffer("action_bias", (high + low) / 2.0, persistent=False)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = to_float(obs).reshape(obs.shape[0], -1)
        return torch.tanh(self.net(x)) * self.action_scale + self.action_bias


class Critic(nn.Module):
    """Q(s, a): an MLP over the concatenated (flattened) observation and action."""

    def __init__(self, obs_dim: int, action_dim: int, hidden_sizes: list[int]):
        super().__init__()
        self.net = mlp([obs_dim + action_dim, *hidden_sizes, 1], final_activation=False)

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        x = to_float(obs).reshape(obs.shape[0], -1)
        return self.net(torch.cat([x, action.to(x.dtype)], dim=1)).squeeze(1)


class TD3Model(nn.Module):
    """TD3 (Fujimoto et al. 2018): ``actor`` pi(s), twin critics ``critic1``/``critic2``.

    ``model(obs)`` is the deterministic policy. ``action_low``/``action_high`` (and the
    actor's scale/bias) are non-persistent buffers: they follow ``.to(device)`` but are not
    in the state dict.
    """

    action_low: torch.Tensor  # buffers (register_buffer), declared for type checkers
    action_high: torch.Tensor

    def __init__(self, obs_dim: int, action_dim: int, hidden_sizes: list[int],
                 action_low: tuple[float, ...], action_high: tuple[float, ...]):
        super().__init__()
        low = torch.as_tensor(action_low, dtype=torch.float32)
        high = torch.as_tensor(action_high, dtype=torch.float32)
        if low.shape != (action_dim,) or high.shape != (action_dim,):
            raise ValueError(f"action bounds must have action_dim ({action_dim}) entries, got "
                             f"{tuple(low.shape)} and {tuple(high.shape)}")
        if not (torch.isfinite(low).all() and torch.isfinite(high).all() and (high > low).all()):
            raise ValueError(f"action bounds must be finite with high > low, got "
                             f"low={action_low} high={action_high}")
        self.actor = DeterministicActor(obs_dim, action_dim, hidden_sizes, low, high)
        self.critic1 = Critic(obs_dim, action_dim, hidden_sizes)
        self.critic2 = Critic(obs_dim, action_dim, hidden_sizes)
        self.register_buffer("action_low", low, persistent=False)
        self.register_buffer("action_high", high, persistent=False)

    @property
    def action_scale(self) -> torch.Tensor:
        """Half the action range per dimension: the unit of TD3's noise settings."""
        return self.actor.action_scale

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.actor(obs)

    def q(self, obs: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.critic1(obs, action), self.critic2(obs, action)


def build_network(cfg: ExperimentConfig, spec: EnvSpec) -> TD3Model:
    """A TD3Model for ``spec`` with ``td3.hidden_sizes`` layers."""
    frame_shape = tuple(spec.frame_shape)
    check_action_space("td3", spec)
    if len(frame_shape) != 1:
        raise ValueError(f"unsupported frame shape {frame_shape}: TD3 takes vector "
                         f"observations")
    obs_dim = spec.frame_stack * math.prod(frame_shape)
    return TD3Model(obs_dim, spec.action_dim, list(cfg.td3.hidden_sizes),
                    spec.action_low, spec.action_high)
