"""Exploration and seeding for stateless actors.

An actor's exploration rate and seeds come from its identity (the pod name), so actors can
join or leave without coordination and a run is reproducible for a fixed set of actor ids.
Hashes use SHA-256, never Python's ``hash()``, which is salted per process.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np

_U64 = float(2**64 - 1)


def _digest64(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little")


def actor_u(actor_id: str) -> float:
    """u in [0, 1] from a stable hash of ``actor_id`` (uniform over ids)."""
    return _digest64("amprl-epsilon:" + actor_id) / _U64


def epsilon_from_u(u: float, base: float = 0.4, alpha: float = 7.0) -> float:
    """Ape-X (Horgan et al. 2018): eps = base^(1 + alpha * u); u=0 -> base, u=1 -> base^(1+alpha)."""
    if not 0.0 <= u <= 1.0:
        raise ValueError(f"u ({u}) must be in [0, 1]")
    return float(base ** (1.0 + alpha * u))


def apex_epsilon(actor_id: str, base: float = 0.4, alpha: float = 7.0) -> float:
    """The exploration rate of actor ``actor_id``: ``epsilon_from_u(actor_u(actor_id))``.

    With the defaults, eps ranges over [0.4^8, 0.4] = [0.00066, 0.4], log-uniformly.
    """
    return epsilon_from_u(actor_u(actor_id), base, alpha)


def apex_epsilon_indexed(index: int, num_actors: int, base: float = 0.4, alpha: float = 7.0) -> float:
    """The original Ape-X schedule for a known fleet: u_i = i / (N - 1) (u = 0 when N = 1).

    Spreads a small fleet evenly where the hash could land two actors close together.
    """
    if not 0 <= index < num_actors:
        raise ValueError(f"index ({index}) must be in [0, num_actors={num_actors})")
    u = index / (num_actors - 1) if num_actors > 1 else 0.0
    return epsilon_from_u(u, base, alpha)


def derive_seed(run_seed: int, actor_id: str, index: int = 0) -> int:
    """A seed in [0, 2^32) for (run, actor, index), equal in every process and on every host.

    ``index`` tells apart seeds of one actor (its envs, its exploration RNG). 32 bits fit
    every consumer (NumPy's legacy RandomState, ALE, torch).
    """
    return _digest64(f"amprl-seed:{int(run_seed)}:{actor_id}:{int(index)}") & 0xFFFF_FFFF


def seed_everything(seed: int) -> np.random.Generator:
    """Seeds Python's ``random``, NumPy's global RNG and torch; returns a fresh Generator."""
    import torch  # here, so the id -> epsilon/seed helpers stay importable without torch

    seed = int(seed) & 0xFFFF_FFFF
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return np.random.default_rng(seed)


def epsilon_greedy(greedy: np.ndarray, epsilon: float, num_actions: int,
                   rng: np.random.Generator) -> np.ndarray:
    """Replaces each greedy action by a uniform random one with probability ``epsilon``."""
    greedy = np.asarray(greedy, dtype=np.int64)
    explore = rng.random(len(greedy)) < epsilon
    if not explore.any():
        return greedy
    out = greedy.copy()
    out[explore] = rng.integers(0, num_actions, size=int(explore.sum()))
    return out


def gaussian_exploration(actions: np.ndarray, noise: float, low: np.ndarray, high: np.ndarray,
                         rng: np.random.Generator) -> np.ndarray:
    """TD3 actors: a + N(0, (noise * half_range)^2), clipped to [low, high]; float32.

    ``noise`` is in units of the action half-range (0.1 in Fujimoto et al. 2018 for
    MuJoCo's [-1, 1] actions).
    """
    low = np.asarray(low, dtype=np.float32)
    high = np.asarray(high, dtype=np.float32)
    actions = np.array(actions, dtype=np.float32)  # a copy: the noise is added in place
    if noise > 0.0:
        eps = rng.standard_normal(actions.shape, dtype=np.float32)
        eps *= np.float32(noise) * (high - low) / 2
        actions += eps
    return np.clip(actions, low, high, out=actions)
