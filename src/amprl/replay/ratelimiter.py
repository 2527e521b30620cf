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
(diff > max_diff >= min_diff) samples may run, and vice versa.

Waiting is an event, not a thread. The limiter lives on the replay server's event loop:
``insert(n)`` and ``sample(n)`` are async context managers that wait in a FIFO queue until
the call may proceed (or its deadline passes: DeadlineExceeded), and count the call as
*pending* while its body runs on a worker thread. Pending work is counted against the window
(an admitted insert of T as if already inserted, an admitted sample of B as if already
drawn), so a queue of hundreds of waiting actors is let through a few at a time, as the
window allows, never all at once. A body that fails (Redis down) counts nothing.

Every method runs on the event loop's thread; nothing here takes a lock.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from typing import AsyncContextManager, AsyncIterator, Callable

from amprl.errors import DeadlineExceeded


class _Queue:
    """The waiters of one kind (inserts or samples), oldest first."""

    def __init__(self) -> None:
        self.waiters: collections.deque[tuple[int, asyncio.Future]] = collections.deque()
        self.pending = 0
        """Transitions admitted whose call has not finished."""
        self.wait_seconds = 0.0


class RateLimiter:
    def __init__(self, *, samples_per_insert: float, min_size_to_sample: int, error_buffer: float,
                 size: Callable[[], int], inserted: int = 0, sampled: int = 0):
        """``size`` returns the table's current number of transitions; ``inserted`` and
        ``sampled`` are the table's totals when the limiter starts (a restarted service
        resumes the ratio where it was)."""
        if samples_per_insert < 0:
            raise ValueError(f"samples_per_insert ({samples_per_insert}) must be >= 0")
        if min_size_to_sample < 1:
            raise ValueError(f"min_size_to_sample ({min_size_to_sample}) must be >= 1")
        if error_buffer < 0:
            raise ValueError(f"error_buffer ({error_buffer}) must be >= 0")
        if error_buffer == 0:
            # The config's documented default: 0 means max(1, m * r).
            error_buffer = max(1.0, min_size_to_sample * samples_per_insert)
        self.samples_per_insert = float(samples_per_insert)
        self.min_size_to_sample = int(min_size_to_sample)
        self.error_buffer = float(error_buffer)
        self.size = size
        self.inserted = int(inserted)
        self.sampled = int(sampled)
        self._inserts = _Queue()
        self._samples = _Queue()

    # -- the rule -------------------------------------------------------------------------

    @property
    def diff(self) -> float:
        return self.samples_per_insert * self.inserted - self.sampled

    @property
    def min_diff(self) -> float:
        return self.samples_per_insert * self.min_size_to_sample - self.error_buffer

    @property
    def max_diff(self) -> float:
        return self.samples_per_insert * self.min_size_to_sample + self.error_buffer

    @property
    def max_insert(self) -> int | None:
        """The most transitions one insert should carry: the window the limiter keeps
        between inserts and samples (``max_diff / samples_per_insert``), since an admitted
        insert goes in whole and may overshoot the window by its own size; None when
        inserts are not limited."""
        if self.samples_per_insert == 0:
            return None
        return max(1, int(self.max_diff / self.samples_per_insert))

    def can_sample(self, size: int) -> bool:
        """Whether one more sample may start now (pending samples counted as drawn)."""
        if size < self.min_size_to_sample:
            return False
        return (self.samples_per_insert == 0
                or self.diff - self._samples.pending >= self.min_diff)

    def can_insert(self, size: int) -> bool:
        """Whether one more insert may start now (pending inserts counted as stored)."""
        if size < self.min_size_to_sample or self.samples_per_insert == 0:
            return True
        return self.diff + self.samples_per_insert * self._inserts.pending <= self.max_diff

    # -- waiting --------------------------------------------------------------------------

    @property
    def waiting_inserts(self) -> int:
        return len(self._inserts.waiters)

    @property
    def waiting_samples(self) -> int:
        return len(self._samples.waiters)

    @property
    def insert_wait_seconds(self) -> float:
        return self._inserts.wait_seconds

    @property
    def sample_wait_seconds(self) -> float:
        return self._samples.wait_seconds

    def insert(self, n: int, timeout: float | None, *,
               continuing: bool = False) -> AsyncContextManager[None]:
        """Waits (up to ``timeout`` seconds; None = no limit) until an insert of ``n``
        transitions may proceed, then runs the body; counts the insert when the body
        succeeds. ``continuing``: the rest of a call that has already had its turn (its
        first group was stored) waits at the head of the queue, not at the tail, so one
        call's chunks never queue twice behind the whole fleet."""
        return self._admitted(self._inserts, n, timeout, self.can_insert, lambda waited: (
            f"insert: waited {waited:.2f}s for samples; samples_per_insert diff "
            f"{self.diff:.1f} > max {self.max_diff:.1f}"), front=continuing)

    def sample(self, n: int, timeout: float | None) -> AsyncContextManager[None]:
        """Waits (up to ``timeout``) until a sample of ``n`` may proceed, then runs the
        body; counts the sample when the body succeeds."""
        return self._admitted(self._samples, n, timeout, self.can_sample, lambda waited: (
            f"sample: waited {waited:.2f}s; table holds {self.size()} of min_size_to_sample "
            f"{self.min_size_to_sample}, samples_per_insert diff {self.diff:.1f} < min "
            f"{self.min_diff:.1f}"))

    @contextlib.asynccontextmanager
    async def _admitted(self, queue: _Queue, n: int, timeout: float | None,
                        ready: Callable[[int], bool], message: Callable[[float], str],
                        front: bool = False) -> AsyncIterator[None]:
        await self._admit(queue, n, timeout, ready, message, front)
        done = False
        try:
            yield
            done = True
        finally:
            queue.pending -= n
            if done:
                if queue is self._inserts:
                    self.inserted += n
                else:
                    self.sampled += n
            self._pump()

    def notify(self) -> None:
        """Re-checks the waiters; call after the table's size changed by other means."""
        self._pump()

    async def _admit(self, queue: _Queue, n: int, timeout: float | None,
                     ready: Callable[[int], bool], message: Callable[[float], str],
                     front: bool = False) -> None:
        # FIFO: a call that finds others waiting queues behind them even if it could go
        # (one at the ``front`` goes ahead of them).
        if (front or not queue.waiters) and ready(self.size()):
            queue.pending += n
            return
        future = asyncio.get_running_loop().create_future()
        entry = (n, future)
        if front:
            queue.waiters.appendleft(entry)
        else:
            queue.waiters.append(entry)
        start = time.monotonic()
        try:
            async with asyncio.timeout(timeout):
                await future
        except TimeoutError:
            if future.done() and not future.cancelled():
                return  # admitted in the same instant the deadline passed: go ahead
            raise DeadlineExceeded(message(time.monotonic() - start)) from None
        except BaseException:
            if future.done() and not future.cancelled():
                queue.pending -= n  # admitted, but the caller went away
                self._pump()
            raise
        finally:
            queue.wait_seconds += time.monotonic() - start
            # Not admitted (deadline, or the caller went away): leave the queue. An admitted
            # entry was already taken off it by _pump.
            with contextlib.suppress(ValueError):
                queue.waiters.remove(entry)

    def _pump(self) -> None:
        """Admits waiters, oldest first, while the window allows (samples first: they are
        what releases waiting inserts)."""
        size = self.size()
        for queue, ready in ((self._samples, self.can_sample), (self._inserts, self.can_insert)):
            while queue.waiters and ready(size):
                n, future = queue.waiters.popleft()
                if not future.done():
                    queue.pending += n
                    future.set_result(None)
