"""A batch of n-step transitions as tensors: what the losses take.

Replay and actors hold transitions as frames plus index arrays (each frame once); a batch
rebuilds the observation stacks with one gather *on the target device*, so uint8 frames
cross to the GPU once and are cast to float inside the model. A learner's sampled batches
come with their stacks built (``sampled_to_tensors``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Batch:
    """n-step transitions; B rows.

    ``rewards`` are n-step sums sum_{k<n} gamma^k r_{t+k}; ``discounts`` are gamma^k for the
    bootstrap term (k = steps taken), 0 when the episode terminated inside them.
    """

    obs: torch.Tensor
    """[B, *obs_shape], the frames' dtype (uint8 stays uint8)."""
    actions: torch.Tensor
    """[B] int64 (discrete) or [B, action_dim] float32."""
    rewards: torch.Tensor
    """[B] float32."""
    discounts: torch.Tensor
    """[B] float32."""
    next_obs: torch.Tensor
    """[B, *obs_shape]: the observation the bootstrap term is computed on."""
    weights: torch.Tensor | None = None
    """[B] float32 importance-sampling weights; None means all ones."""

    def __len__(self) -> int:
        return int(self.rewards.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        def mv(t):
            return None if t is None else t.to(device, non_blocking=non_blocking)
        return Batch(mv(self.obs), mv(self.actions), mv(self.rewards), mv(self.discounts),
                     mv(self.next_obs), mv(self.weights))

    @classmethod
    def from_frames(cls, frames, obs_idx, next_obs_idx, actions, rewards, discounts,
                    weights=None, *, frame_stack: int,
                    device: torch.device | str | None = None) -> "Batch":
        """Builds a batch from frames ``[F, *frame_shape]`` and index arrays ``[B, stack]``.

        Accepts NumPy arrays or tensors. Frames move to ``device`` first and the stacks are
        gathered there. With ``frame_stack == 1`` the stack axis is dropped (the
        observation is the frame).
        """
        dev = torch.device(device) if device is not None else None

        def t(x, dtype=None):
            if x is None:
                return None
            x = torch.as_tensor(np.ascontiguousarray(x) if isinstance(x, np.ndarray) else x)
            if dtype is not None and x.dtype != dtype:
                x = x.to(dtype)
            return x.to(dev) if dev is not None else x

        f = t(frames)
        oi = t(obs_idx, torch.int64)
        ni = t(next_obs_idx, torch.int64)
        if frame_stack == 1:
            obs, next_obs = f[oi[:, 0]], f[ni[:, 0]]
        else:
            obs, next_obs = f[oi], f[ni]
        acts = t(actions)
        acts = acts.to(torch.int64) if not acts.is_floating_point() else acts.to(torch.float32)
        return cls(obs, acts, t(rewards, torch.float32), t(discounts, torch.float32), next_obs,
                   t(weights, torch.float32))

    @classmethod
    def from_chunk(cls, chunk, *, frame_stack: int, weights=None,
                   device: torch.device | str | None = None) -> "Batch":
        """A batch of all transitions of a ``Chunk`` (what an actor scores for priorities)."""
        return cls.from_frames(chunk.frames, chunk.obs_idx, chunk.next_obs_idx, chunk.actions,
                               chunk.rewards, chunk.discounts, weights,
                               frame_stack=frame_stack, device=device)


def weights_or_ones(batch: Batch, like: torch.Tensor) -> torch.Tensor:
    if batch.weights is None:
        return torch.ones_like(like)
    return batch.weights.to(like.dtype)


def _tensor(x: np.ndarray, device: torch.device, pin: bool) -> torch.Tensor:
    # sampled arrays may be read-only views of the gRPC message; torch needs its own memory
    x = np.ascontiguousarray(x) if x.flags.writeable else np.array(x)
    t = torch.from_numpy(x)
    if pin:
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def sampled_to_tensors(s, device: torch.device, pin: bool = False) -> tuple[Batch, np.ndarray]:
    """A sampled replay batch (``SampledBatch``) as device tensors, plus its keys (kept on
    the host): ``Algorithm.to_tensors`` of the algorithms that need nothing else."""
    d = device
    return Batch(obs=_tensor(s.obs, d, pin), actions=_tensor(s.actions, d, pin),
                 rewards=_tensor(s.rewards, d, pin), discounts=_tensor(s.discounts, d, pin),
                 next_obs=_tensor(s.next_obs, d, pin), weights=_tensor(s.weights, d, pin)), s.keys
