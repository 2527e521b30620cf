"""Chunks of transitions (``amprl.rl.transitions.Chunk``) <-> ``amprl.v1.TransitionBatch``.

``chunk_from_proto`` is the gate in front of the replay table: it checks every field against
the run's EnvSpec and raises InvalidArgument naming the field and what was expected, so
nothing malformed is ever stored.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import DTypeLike

from amprl.envs.spec import EnvSpec
from amprl.errors import InvalidArgument
from amprl.rl.transitions import Chunk
from amprl.v1 import replay_pb2, tensor_pb2
from amprl.wire.tensors import DTYPES, tensor_from_proto, tensor_to_proto


def chunk_to_proto(chunk: Chunk, msg: replay_pb2.TransitionBatch) -> replay_pb2.TransitionBatch:
    """Fills ``msg`` from ``chunk`` (casting indices to int32 and floats to float32)."""
    tensor_to_proto(chunk.frames, msg.frames)
    tensor_to_proto(np.asarray(chunk.obs_idx, dtype=np.int32), msg.obs_frame_indices)
    tensor_to_proto(np.asarray(chunk.next_obs_idx, dtype=np.int32), msg.next_obs_frame_indices)
    actions = np.asarray(chunk.actions)
    if actions.dtype.kind in "iu":
        actions = actions.astype(np.int64, copy=False)
    elif actions.dtype.kind == "f":
        actions = actions.astype(np.float32, copy=False)
    tensor_to_proto(actions, msg.actions)
    tensor_to_proto(np.asarray(chunk.rewards, dtype=np.float32), msg.rewards)
    tensor_to_proto(np.asarray(chunk.discounts, dtype=np.float32), msg.discounts)
    return msg


def _shape(a: np.ndarray) -> str:
    return "[" + ", ".join(str(s) for s in a.shape) + "]"


def _all_finite(a: np.ndarray) -> bool:
    # One reduction on the common path: a finite sum means no NaN or inf (overflow of the
    # sum falls back to the exact check).
    return bool(np.isfinite(a.sum())) or bool(np.isfinite(a).all())


_CODES = {np.dtype(v): k for k, v in DTYPES.items() if k != tensor_pb2.DTYPE_BOOL}


def _decode(t: tensor_pb2.Tensor, name: str, dtype_like: DTypeLike, ndim: int) -> np.ndarray:
    """tensor_from_proto's checks, inlined for the insert hot path (a few microseconds
    per tensor matter at 200k transitions/s)."""
    dtype = np.dtype(dtype_like)
    if t.dtype != _CODES.get(dtype):
        return tensor_from_proto(t, name, dtype=dtype, ndim=ndim)  # raises the exact error
    shape = tuple(t.shape)
    # (no data: an empty tensor, or a huge shape with a zero in it; checked in full there)
    if (len(shape) != ndim or min(shape, default=0) < 0 or not t.data
            or len(t.data) != math.prod(shape) * dtype.itemsize):
        return tensor_from_proto(t, name, dtype=dtype, ndim=ndim)
    return np.frombuffer(t.data, dtype=dtype).reshape(shape)


def chunk_from_proto(msg: replay_pb2.TransitionBatch, spec: EnvSpec, *,
                     check_values: bool = True) -> Chunk:
    """Decodes and validates a chunk against ``spec``; arrays are read-only views.

    Raises InvalidArgument naming the first bad field: wrong dtype or shape, T = 0, lengths
    that disagree and, unless ``check_values`` is False (the caller then runs
    ``check_chunks_values`` on a batch of chunks), non-finite frames, frame indices outside
    [0, F), actions out of range or non-finite, non-finite rewards, discounts outside [0, 1].
    """
    if len(msg.lz4_frames):
        raise InvalidArgument("chunk.lz4_frames: compressed frames are only sent by replay; "
                              "send raw frames in chunk.frames")
    stack = spec.frame_stack
    frame_shape = tuple(spec.frame_shape)
    frames = _decode(msg.frames, "chunk.frames", spec.frame_dtype, 1 + len(frame_shape))
    if tuple(frames.shape[1:]) != frame_shape:
        raise InvalidArgument(f"chunk.frames: shape {_shape(frames)}, expected "
                              f"[F, {', '.join(str(s) for s in frame_shape)}] (the run's frame shape)")
    obs_idx = _decode(msg.obs_frame_indices, "chunk.obs_frame_indices", np.int32, 2)
    t = obs_idx.shape[0]
    if t == 0:
        raise InvalidArgument("chunk.obs_frame_indices: a chunk needs at least one transition (T >= 1)")
    if obs_idx.shape[1] != stack:
        raise InvalidArgument(f"chunk.obs_frame_indices: shape {_shape(obs_idx)}, expected "
                              f"[T, {stack}] (frame_stack {stack})")
    next_idx = _decode(msg.next_obs_frame_indices, "chunk.next_obs_frame_indices", np.int32, 2)
    if next_idx.shape != (t, stack):
        raise InvalidArgument(f"chunk.next_obs_frame_indices: shape {_shape(next_idx)}, expected "
                              f"[{t}, {stack}] (T from obs_frame_indices, frame_stack {stack})")
    if frames.shape[0] == 0:
        raise InvalidArgument("chunk.frames: no frames (F = 0) for a non-empty chunk")
    if spec.discrete:
        actions = _decode(msg.actions, "chunk.actions", np.int64, 1)
        if actions.shape[0] != t:
            raise InvalidArgument(f"chunk.actions: shape {_shape(actions)}, expected [{t}] (T)")
    else:
        actions = _decode(msg.actions, "chunk.actions", np.float32, 2)
        if actions.shape != (t, spec.action_dim):
            raise InvalidArgument(f"chunk.actions: shape {_shape(actions)}, expected "
                                  f"[{t}, {spec.action_dim}] (T, action_dim)")
    rewards = _decode(msg.rewards, "chunk.rewards", np.float32, 1)
    if rewards.shape[0] != t:
        raise InvalidArgument(f"chunk.rewards: shape {_shape(rewards)}, expected [{t}] (T)")
    discounts = _decode(msg.discounts, "chunk.discounts", np.float32, 1)
    if discounts.shape[0] != t:
        raise InvalidArgument(f"chunk.discounts: shape {_shape(discounts)}, expected [{t}] (T)")
    chunk = Chunk(frames, obs_idx, next_idx, actions, rewards, discounts)
    if check_values:
        _check_values(chunk, spec)
    return chunk


def _check_values(chunk: Chunk, spec: EnvSpec) -> None:
    """The value checks of one structurally valid chunk (see chunk_from_proto)."""
    if chunk.frames.dtype.kind == "f" and not _all_finite(chunk.frames):
        raise InvalidArgument("chunk.frames: contains NaN or infinite values")
    num_frames = chunk.frames.shape[0]
    for name, idx in (("chunk.obs_frame_indices", chunk.obs_idx),
                      ("chunk.next_obs_frame_indices", chunk.next_obs_idx)):
        # As uint32 a negative index is huge: one reduction checks both ends.
        if int(idx.view(np.uint32).max()) >= num_frames:
            lo, hi = int(idx.min()), int(idx.max())
            bad = lo if lo < 0 else hi
            raise InvalidArgument(f"{name}: index {bad} outside [0, {num_frames}) (F = {num_frames} frames)")
    actions = chunk.actions
    if spec.discrete:
        if spec.num_actions > 0 and int(actions.view(np.uint64).max()) >= spec.num_actions:
            lo, hi = int(actions.min()), int(actions.max())
            raise InvalidArgument(f"chunk.actions: action {lo if lo < 0 else hi} outside "
                                  f"[0, {spec.num_actions})")
    elif not _all_finite(actions):
        raise InvalidArgument("chunk.actions: contains NaN or infinite values")
    if not _all_finite(chunk.rewards):
        raise InvalidArgument("chunk.rewards: contains NaN or infinite values")
    # NaN fails both comparisons, so it is caught here too.
    if not (chunk.discounts.min() >= 0 and chunk.discounts.max() <= 1):
        raise InvalidArgument("chunk.discounts: values must lie in [0, 1] (gamma^n or 0) and be finite")


class InvalidChunk(InvalidArgument):
    """A value check failed for ``chunks[index]`` of a batch."""

    def __init__(self, message: str, index: int):
        super().__init__(message)
        self.index = index


def check_chunks_values(chunks: list[Chunk], spec: EnvSpec) -> None:
    """The value checks of chunk_from_proto for many chunks at once: a few NumPy calls over
    the concatenated fields instead of a dozen per chunk. Raises InvalidChunk naming the
    first bad chunk."""
    if len(chunks) == 1:
        try:
            _check_values(chunks[0], spec)
        except InvalidArgument as exc:
            raise InvalidChunk(str(exc), 0) from None
        return
    ok = True
    f_rows = np.repeat(np.array([c.frames.shape[0] for c in chunks], np.uint32),
                       [len(c) for c in chunks])
    for name in ("obs_idx", "next_obs_idx"):
        idx = np.concatenate([getattr(c, name) for c in chunks]).view(np.uint32)
        ok = ok and bool((idx.max(axis=1) < f_rows).all())
    actions = np.concatenate([c.actions for c in chunks])
    if spec.discrete:
        ok = ok and not (spec.num_actions > 0 and int(actions.view(np.uint64).max()) >= spec.num_actions)
    else:
        ok = ok and _all_finite(actions)
    ok = ok and _all_finite(np.concatenate([c.rewards for c in chunks]))
    discounts = np.concatenate([c.discounts for c in chunks])
    ok = ok and bool(discounts.min() >= 0 and discounts.max() <= 1)
    if ok and chunks[0].frames.dtype.kind == "f":
        ok = _all_finite(np.concatenate([c.frames.ravel() for c in chunks]))
    if ok:
        return
    for i, chunk in enumerate(chunks):  # slow path: find the first bad one
        try:
            _check_values(chunk, spec)
        except InvalidArgument as exc:
            raise InvalidChunk(str(exc), i) from None
