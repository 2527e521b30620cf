"""Ape-X epsilon from actor identity, seeds stable across processes, exploration helpers."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from amprl.rl.exploration import (actor_u, apex_epsilon, apex_epsilon_indexed, derive_seed,
                                     epsilon_from_u, epsilon_greedy, gaussian_exploration,
                                     seed_everything)


def test_epsilon_known_values_at_the_ends():
    assert epsilon_from_u(0.0) == pytest.approx(0.4)
    assert epsilon_from_u(1.0) == pytest.approx(0.4 ** 8)
    assert epsilon_from_u(0.5, base=0.5, alpha=2.0) == pytest.approx(0.25)
    with pytest.raises(ValueError):
        epsilon_from_u(1.5)


def test_epsilon_spread_over_many_actor_ids():
    us = np.array([actor_u(f"amprl-actor-{i}") for i in range(2000)])
    assert us.min() >= 0 and us.max() <= 1
    # roughly uniform: each decile holds ~10%
    counts = np.histogram(us, bins=10, range=(0, 1))[0]
    assert counts.min() > 150 and counts.max() < 250
    eps = np.array([apex_epsilon(f"amprl-actor-{i}") for i in range(2000)])
    assert eps.min() >= 0.4 ** 8 - 1e-12 and eps.max() <= 0.4
    assert len(set(eps.tolist())) == 2000


def test_epsilon_indexed_matches_original_apex():
    assert apex_epsilon_indexed(0, 8) == pytest.approx(0.4)
    assert apex_epsilon_indexed(7, 8) == pytest.approx(0.4 ** 8)
    assert apex_epsilon_indexed(0, 1) == pytest.approx(0.4)


def test_pinned_values_do_not_drift():
    # Changing the hash recipe changes every run's exploration and seeds; do it on purpose.
    assert actor_u("actor-0") == pytest.approx(PINNED_U)
    assert derive_seed(0, "actor-0", 0) == PINNED_SEED


PINNED_U = 0.8232553994152365
PINNED_SEED = 358955610


def test_stable_across_processes_with_different_hash_seeds():
    code = ("from amprl.rl.exploration import apex_epsilon, derive_seed;"
            "print(repr(apex_epsilon('amprl-actor-3')), derive_seed(42, 'amprl-actor-3', 5))")
    # str hashes are salted per process; pin a salt unlike this process's
    env = dict(os.environ, PYTHONHASHSEED=str(hash("x") % 1000 + 1))
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                         capture_output=True, text=True).stdout.strip()
    assert out == f"{apex_epsilon('amprl-actor-3')!r} {derive_seed(42, 'amprl-actor-3', 5)}"


def test_derive_seed_distinct_and_in_32_bits():
    seeds = {derive_seed(r, f"a-{i}", k) for r in range(3) for i in range(50) for k in range(4)}
    assert len(seeds) == 600
    assert all(0 <= s < 2 ** 32 for s in seeds)
    assert derive_seed(1, "a", 0) == derive_seed(1, "a")


def test_seed_everything_repeats_python_numpy_torch():
    def draw():
        rng = seed_everything(derive_seed(7, "actor-1"))
        return random.random(), np.random.rand(), torch.rand(1).item(), rng.random()
    assert draw() == draw()


def test_epsilon_greedy_extremes():
    rng = np.random.default_rng(0)
    greedy = np.full(10_000, 2)
    np.testing.assert_array_equal(epsilon_greedy(greedy, 0.0, 4, rng), greedy)
    acts = epsilon_greedy(greedy, 1.0, 4, rng)
    assert np.bincount(acts, minlength=4).min() > 2300
    acts = epsilon_greedy(greedy, 0.2, 4, rng)
    assert 0.83 < (acts == 2).mean() < 0.87  # 0.8 + 0.2/4


def test_gaussian_exploration_in_half_range_units_and_clipped():
    rng = np.random.default_rng(0)
    low, high = np.array([-2.0, 0.0]), np.array([2.0, 1.0])
    a = gaussian_exploration(np.tile([0.0, 0.5], (20_000, 1)), 0.1, low, high, rng)
    assert a.dtype == np.float32
    np.testing.assert_allclose(a.std(0), [0.2, 0.05], rtol=0.05)
    a = gaussian_exploration(np.tile([2.0, 1.0], (1000, 1)), 0.5, low, high, rng)
    assert (a <= high).all() and (a >= low).all()
