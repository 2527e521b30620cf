"""n-step returns and discounts (Sutton & Barto ch. 7; Ape-X), as weights over a ring of
the last n rewards.

For the transition that starts at step t of an episode, with K = min(n, steps left in the
episode):

    reward   = sum_{k<K} gamma^k r_{t+k}
    discount = 0 if the episode TERMINATED within the K steps, else gamma^K

so a time-limit truncation bootstraps from its final observation with gamma^K, and an
episode end closes its pending windows with K < n. The actor's chunker
(``actor/nstep.py``) keeps each env's last n rewards in a ring, step t in slot t % n, and
sums a window for every env at once as one product with the weights below: they depend
on gamma and n alone, so they are built once.
"""

from __future__ import annotations

import numpy as np


def discount_powers(gamma: float, n: int) -> np.ndarray:
    """float64 [n + 1]: gamma^0 .. gamma^n (gamma^K discounts the bootstrap of a K-step
    return)."""
    return gamma ** np.arange(n + 1, dtype=np.float64)


def full_window_weights(gamma: float, n: int) -> np.ndarray:
    """float64 [n, n]: row s weighs the ring, once step t is written into slot s = t % n,
    to sum the n-step return of steps t-n+1 .. t: the oldest slot (s + 1) % n gets
    gamma^0, slot s gets gamma^(n-1)."""
    powers = discount_powers(gamma, n)
    weights = np.zeros((n, n), dtype=np.float64)
    for s in range(n):
        for k in range(n):
            weights[s, (s + 1 + k) % n] = powers[k]
    return weights


def short_window_weights(gamma: float, n: int) -> np.ndarray:
    """float64 [n, n, n]: column k of ``[s]`` weighs the ring, once step t is written into
    slot s = t % n, to sum the return of the k + 1 steps t-k .. t (the windows an episode
    end closes early)."""
    powers = discount_powers(gamma, n)
    weights = np.zeros((n, n, n), dtype=np.float64)
    for s in range(n):
        for k in range(n):
            for m in range(k + 1):
                weights[s, (s - k + m) % n, k] = powers[m]
    return weights


def suffix_returns(rewards: np.ndarray, gamma: float) -> np.ndarray:
    """float64 [K]: for rewards r_0 .. r_{K-1} of consecutive steps, the return of each
    window from step k to the last, G_k = r_k + gamma * G_{k+1}."""
    returns = np.empty(len(rewards), dtype=np.float64)
    g = 0.0
    for k in range(len(rewards) - 1, -1, -1):
        g = rewards[k] + gamma * g
        returns[k] = g
    return returns
