"""Exponential backoff with jitter, for clients that retry: a fleet that failed together
(a server restarted, a cap was reached) must not come back together.

The n-th wait (n = 0, 1, ...) is d/2 + uniform(0, d/2) with d = min(cap_s, base_s * 2^n):
"equal jitter" (Brooker, "Exponential Backoff And Jitter", AWS Architecture Blog, 2015),
which spreads a fleet's retries over half of each window and never retries at once.
"""

from __future__ import annotations

import random


class Backoff:
    """The defaults (first pause 0.05-0.1 s, doubling to 2.5-5 s) are what actors use for
    inserts and weight pulls."""

    def __init__(self, base_s: float = 0.1, cap_s: float = 5.0, rng: random.Random | None = None):
        if not 0 < base_s <= cap_s:
            raise ValueError(f"backoff: need 0 < base_s ({base_s}) <= cap_s ({cap_s})")
        self.base_s = float(base_s)
        self.cap_s = float(cap_s)
        self.attempt = 0
        self._rng = rng or random.Random()

    def next(self) -> float:
        """Seconds to wait before the next try."""
        window = min(self.cap_s, self.base_s * 2.0 ** min(self.attempt, 62))
        self.attempt += 1
        return window / 2 + self._rng.uniform(0.0, window / 2)

    def reset(self) -> None:
        """After a success: the next failure waits the shortest window again."""
        self.attempt = 0
