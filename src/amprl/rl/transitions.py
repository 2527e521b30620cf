"""The unit of experience an actor sends and replay stores: a chunk of transitions.

A chunk holds consecutive transitions of one actor and the distinct frames they are built
from: observation t is ``frames[obs_idx[t]]`` (``stack`` frames, oldest first), its n-step
next observation ``frames[next_obs_idx[t]]``. Each frame travels and is stored once, however
many stacks use it. Its wire format is ``amprl.wire.transitions``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Chunk:
    """T consecutive transitions over F distinct frames (NumPy, host memory)."""

    frames: np.ndarray
    """[F, *frame_shape], dtype spec.frame_dtype: the distinct frames."""
    obs_idx: np.ndarray
    """int32 [T, stack]: indices into frames forming each observation, oldest first."""
    next_obs_idx: np.ndarray
    """int32 [T, stack]: indices into frames forming each n-step next observation."""
    actions: np.ndarray
    """int64 [T] (discrete) or float32 [T, action_dim] (continuous)."""
    rewards: np.ndarray
    """float32 [T]: n-step discounted returns."""
    discounts: np.ndarray
    """float32 [T]: gamma^n, or 0 when the episode terminated within the n steps."""

    def __len__(self) -> int:
        return int(self.rewards.shape[0])
