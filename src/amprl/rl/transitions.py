"""The units of experience: the chunk of transitions an actor sends and replay stores,
and the prioritized batch replay hands a learner.

A chunk holds consecutive transitions of one actor and the distinct frames they are built
from: observation t is ``frames[obs_idx[t]]`` (``stack`` frames, oldest first), its n-step
next observation ``frames[next_obs_idx[t]]``. Each frame travels and is stored once, however
many stacks use it. Its wire format is ``amprl.wire.transitions``; a sampled batch arrives
as ``amprl.v1.SampleResponse`` and ``amprl.replay.client`` rebuilds it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

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


@dataclass
class SampledBatch:
    """A prioritized batch with observations rebuilt (NumPy)."""

    obs: np.ndarray
    """[B, *obs_shape]: [B, *frame_shape] when frame_stack == 1, else [B, stack, *frame_shape]."""
    next_obs: np.ndarray
    """Same layout as obs: the n-step next observations."""
    actions: np.ndarray
    """int64 [B] or float32 [B, action_dim]."""
    rewards: np.ndarray
    """float32 [B]: n-step returns."""
    discounts: np.ndarray
    """float32 [B]: gamma^n, or 0 at termination."""
    keys: np.ndarray
    """int64 [B]: pass back to update_priorities."""
    weights: np.ndarray
    """float32 [B]: importance weights (N P(i))^-beta / max_j w_j."""
    probabilities: np.ndarray
    """float32 [B]: P(i)."""
    size: int
    """Transitions in the table when the batch was drawn."""

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    def split(self, batch_size: int) -> list["SampledBatch"]:
        """Consecutive sub-batches of ``batch_size`` (views; the last may be shorter)."""
        return [replace(self, **{f.name: getattr(self, f.name)[i:i + batch_size]
                                 for f in fields(self) if f.name != "size"})
                for i in range(0, len(self), batch_size)]


def stacked(frames: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Observations from a chunk's frames and an index array ``[T, stack]``: ``[T, *obs_shape]``
    (the stack axis dropped when stack == 1, as EnvSpec.obs_shape has it)."""
    return frames[idx[:, 0]] if idx.shape[1] == 1 else frames[idx]
