"""Small builders for replay tests and benchmarks: specs and chunks with known contents."""

from __future__ import annotations

import numpy as np

from amprl.envs.spec import EnvSpec
from amprl.rl.transitions import Chunk


def vector_spec() -> EnvSpec:
    return EnvSpec((4,), np.dtype(np.float32), 1, True, num_actions=3)


def atari_spec(size: int = 84) -> EnvSpec:
    return EnvSpec((size, size), np.dtype(np.uint8), 4, True, num_actions=6)


def random_actions(spec: EnvSpec, rng: np.random.Generator, t: int) -> np.ndarray:
    """``t`` uniform random actions: int64 indices for a discrete spec, float32 rows within
    the spec's bounds ([-1, 1] where it has none) for a continuous one."""
    if spec.discrete:
        return rng.integers(max(spec.num_actions, 1), size=t).astype(np.int64)
    low = np.asarray(spec.action_low) if spec.action_low else -1.0
    high = np.asarray(spec.action_high) if spec.action_high else 1.0
    return rng.uniform(low, high, (t, spec.action_dim)).astype(np.float32)


def make_chunk(spec: EnvSpec, t: int, *, n_step: int = 3, seed: int = 0, reward_base: float = 0.0) -> Chunk:
    """T consecutive transitions: obs t = frames[t .. t+stack-1], next = obs + n_step;
    rewards are reward_base + 0..T-1 so each transition is identifiable."""
    return _random_chunk(spec, t, np.random.default_rng(seed), n_step,
                         lambda rng: (reward_base + np.arange(t)).astype(np.float32))


def _random_chunk(spec: EnvSpec, t: int, rng: np.random.Generator, n_step: int, rewards) -> Chunk:
    """``t`` consecutive transitions over random frames of the spec's shape and dtype (uint8
    images or float vectors), stacks of ``spec.frame_stack`` frames, next = obs + n_step,
    random actions, ``rewards(rng)``, discount 0.97."""
    stack = spec.frame_stack
    f = t + stack - 1 + n_step
    if spec.frame_dtype == np.uint8:
        frames = rng.integers(0, 256, (f, *spec.frame_shape), dtype=np.uint8)
    else:
        frames = rng.standard_normal((f, *spec.frame_shape)).astype(spec.frame_dtype)
    obs = (np.arange(t)[:, None] + np.arange(stack)[None, :]).astype(np.int32)
    return Chunk(frames, obs, obs + n_step, random_actions(spec, rng, t), rewards(rng),
                 np.full(t, 0.97, np.float32))


def fill_replay(client, spec: EnvSpec, n: int, rng: np.random.Generator, *, chunk: int = 500,
                actor_id: str = "bench-filler") -> None:
    """Inserts ``n`` random transitions (3-step, discount 0.97; vector observations or
    stacked uint8 frames, as the spec says) in chunks of ``chunk``: a table for learner
    benchmarks to sample from. Actions: indices for a discrete spec, uniform within the
    bounds for a continuous one."""
    items = []
    for _ in range(n // chunk):
        c = _random_chunk(spec, chunk, rng, 3, lambda r: r.standard_normal(chunk).astype(np.float32))
        items.append((c, rng.random(chunk).astype(np.float32) + 0.1, chunk))
    client.insert(actor_id, items, timeout=60)
