"""Reverb-style rate limiter: a minimum size and a samples-per-insert ratio.

With r = samples_per_insert, m = min_size_to_sample and b = error_buffer, define

    diff = r * inserted - sampled
    min_diff = r * m - b        max_diff = r * m + b

(``inserted`` and ``sampled`` count transitions). Then

    a sample may proceed   iff  size >= m  and  (r == 0  or  diff >= min_diff)
    an insert may proceed  iff  size < m   or   r == 0  or  diff <= max_diff

Unlike Reverb, which checks one item at a time, the check is made *before* a batch and a
batch may overshoot the window by its own size (r * T for an insert of T, B for a sample of
B). That keeps batches of any size deadlock-free: whenever inserts are blocked
(diff > max_diff >= min_diff) samples may run, and vice versa. A call that cannot proceed
waits on the table's condition variable until another call changes the counters or its
deadline passes (DeadlineExceeded).

The limiter holds no lock of its own: every method runs under the table's lock, and the
waits release it through the shared ``threading.Condition``.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from amprl.errors import DeadlineExceeded

# A wait without a deadline wakes this often to check whether its caller went away.
_POLL_S = 1.0


class RateLimiter:
    def __init__(self, cond: threading.Condition, *, samples_per_insert: float,
                 min_size_to_sample: int, error_buffer: float):
        if samples_per_insert < 0:
            raise ValueError(f"samples_per_insert ({samples_per_insert}) must be >= 0")
        if min_size_to_sample < 1:
            raise ValueError(f"min_size_to_sample ({min_size_to_sample}) must be >= 1")
        if error_buffer < 0:
            raise ValueError(f"error_buffer ({error_buffer}) must be >= 0")
        if error_buffer == 0:
            # The config's documented default: 0 means max(1, m * r).
            error_buffer = max(1.0, min_size_to_sample * samples_per_insert)
        self.cond = cond
        self.samples_per_insert = float(samples_per_insert)
        self.min_size_to_sample = int(min_size_to_sample)
        self.error_buffer = float(error_buffer)
        self.inserted = 0
        self.sampled = 0
        self.waiting_inserts = 0
        self.waiting_samples = 0
        self.insert_wait_seconds = 0.0
        self.sample_wait_seconds = 0.0

    @property
    def diff(self) -> float:
        return self.samples_per_insert * self.inserted - self.sampled

    @property
    def min_diff(self) -> float:
        return self.samples_per_insert * self.min_size_to_sample - self.error_buffer

    @property
    def max_diff(self) -> float:
        return self.samples_per_insert * self.min_size_to_sample + self.error_buffer

    def can_sample(self, size: int) -> bool:
        if size < self.min_size_to_sample:
            return False
        return self.samples_per_insert == 0 or self.diff >= self.min_diff

    def can_insert(self, size: int) -> bool:
        if size < self.min_size_to_sample or self.samples_per_insert == 0:
            return True
        return self.diff <= self.max_diff

    def await_sample(self, size_fn: Callable[[], int], timeout: float | None,
                     cancelled: Callable[[], bool] = lambda: False) -> None:
        """Blocks (releasing the table lock) until a sample may proceed."""
        if self.can_sample(size_fn()):
            return
        self.waiting_samples += 1
        start = time.monotonic()
        try:
            self._wait(lambda: self.can_sample(size_fn()), timeout, cancelled,
                       lambda: (f"sample: waited {time.monotonic() - start:.2f}s; table holds "
                                f"{size_fn()} of min_size_to_sample {self.min_size_to_sample}, "
                                f"samples_per_insert diff {self.diff:.1f} < min {self.min_diff:.1f}"))
        finally:
            self.waiting_samples -= 1
            self.sample_wait_seconds += time.monotonic() - start

    def await_insert(self, size_fn: Callable[[], int], timeout: float | None,
                     cancelled: Callable[[], bool] = lambda: False) -> None:
        """Blocks (releasing the table lock) until an insert may proceed."""
        if self.can_insert(size_fn()):
            return
        self.waiting_inserts += 1
        start = time.monotonic()
        try:
            self._wait(lambda: self.can_insert(size_fn()), timeout, cancelled,
                       lambda: (f"insert: waited {time.monotonic() - start:.2f}s for samples; "
                                f"samples_per_insert diff {self.diff:.1f} > max {self.max_diff:.1f}"))
        finally:
            self.waiting_inserts -= 1
            self.insert_wait_seconds += time.monotonic() - start

    def _wait(self, ready: Callable[[], bool], timeout: float | None,
              cancelled: Callable[[], bool], message: Callable[[], str]) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not ready():
            if cancelled():
                raise DeadlineExceeded(message() + " (the caller went away)")
            remaining = _POLL_S if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceeded(message())
            self.cond.wait(min(remaining, _POLL_S))

    def record_insert(self, n: int) -> None:
        self.inserted += n
        self.cond.notify_all()

    def record_sample(self, n: int) -> None:
        self.sampled += n
        self.cond.notify_all()
