"""What every service must agree on about an environment: frame and action layout."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class EnvSpec:
    """Observation and action layout of a (preprocessed) environment.

    An observation is ``frame_stack`` frames of ``frame_shape``; with ``frame_stack == 1`` it
    is one frame (vector observations). Replay stores frames once and rebuilds stacks.
    """

    frame_shape: tuple[int, ...]
    frame_dtype: np.dtype
    frame_stack: int
    discrete: bool
    num_actions: int = 0
    """Discrete only: number of actions."""
    action_dim: int = 0
    """Continuous only: action vector length."""
    action_low: tuple[float, ...] = ()
    action_high: tuple[float, ...] = ()

    @property
    def obs_shape(self) -> tuple[int, ...]:
        return self.frame_shape if self.frame_stack == 1 else (self.frame_stack, *self.frame_shape)

    @property
    def action_shape(self) -> tuple[int, ...]:
        return () if self.discrete else (self.action_dim,)

    @property
    def action_dtype(self) -> np.dtype:
        return np.dtype(np.int64) if self.discrete else np.dtype(np.float32)


def spec_from_env(env, frame_stack: int = 1) -> EnvSpec:
    """Reads an EnvSpec off a gymnasium env whose observation is one frame (unstacked)."""
    import gymnasium as gym

    obs_space = env.observation_space
    act_space = env.action_space
    frame_dtype = np.dtype(np.uint8) if obs_space.dtype == np.uint8 else np.dtype(np.float32)
    if isinstance(act_space, gym.spaces.Discrete):
        return EnvSpec(tuple(obs_space.shape), frame_dtype, frame_stack, True,
                       num_actions=int(act_space.n))
    if isinstance(act_space, gym.spaces.Box):
        return EnvSpec(tuple(obs_space.shape), frame_dtype, frame_stack, False,
                       action_dim=int(np.prod(act_space.shape)),
                       action_low=tuple(float(x) for x in act_space.low.ravel()),
                       action_high=tuple(float(x) for x in act_space.high.ravel()))
    raise ValueError(f"unsupported action space {act_space}")
