"""n-step returns over a ring of rewards, checked against the plain sums."""

from __future__ import annotations

import numpy as np
import pytest

from amprl.rl.returns import discount_powers, full_window_weights, short_window_weights, suffix_returns


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_ring_weights_sum_the_windows_ending_at_the_newest_step(n):
    gamma = 0.9
    rewards = np.random.default_rng(n).standard_normal(4 * n)
    full, short = full_window_weights(gamma, n), short_window_weights(gamma, n)
    ring = np.zeros(n)
    for t, r in enumerate(rewards):
        ring[t % n] = r
        if t >= n - 1:
            want = sum(gamma ** k * rewards[t - n + 1 + k] for k in range(n))
            assert ring @ full[t % n] == pytest.approx(want)
        for k in range(min(n, t + 1)):  # the k + 1 steps t-k .. t
            want = sum(gamma ** m * rewards[t - k + m] for m in range(k + 1))
            assert (ring @ short[t % n])[k] == pytest.approx(want)


def test_suffix_returns_discount_each_window_to_the_last_step():
    np.testing.assert_allclose(suffix_returns(np.array([1.0, 2.0, 4.0]), 0.5), [3.0, 4.0, 4.0])
    np.testing.assert_allclose(discount_powers(0.5, 3), [1.0, 0.5, 0.25, 0.125])
