import asyncio
import time

import pytest

from amprl.errors import DeadlineExceeded
from amprl.replay.ratelimiter import RateLimiter


def limiter(spi=0.0, min_size=10, buffer=0.0, size=None):
    """A limiter over a table whose size is ``size[0]``."""
    size = size if size is not None else [0]
    return RateLimiter(samples_per_insert=spi, min_size_to_sample=min_size, error_buffer=buffer,
                       size=lambda: size[0])


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_sampling_waits_for_the_minimum_size():
    rl = limiter(min_size=10)
    assert not rl.can_sample(9)
    assert rl.can_sample(10)


def test_ratio_zero_never_blocks_inserts():
    rl = limiter(spi=0.0)
    rl.inserted = 10**9
    assert rl.can_insert(10**6)


def test_ratio_window_blocks_inserts_above_and_samples_below():
    # r = 2, m = 10, b = 5: min_diff = 15, max_diff = 25
    rl = limiter(spi=2.0, min_size=10, buffer=5.0)
    rl.inserted, rl.sampled = 20, 10  # diff = 30
    assert not rl.can_insert(20) and rl.can_sample(20)
    rl.sampled = 20  # diff = 20
    assert rl.can_insert(20) and rl.can_sample(20)
    rl.sampled = 30  # diff = 10
    assert rl.can_insert(20) and not rl.can_sample(20)


def test_inserts_below_min_size_ignore_the_ratio():
    rl = limiter(spi=1.0, min_size=100, buffer=1.0)
    rl.inserted = 50
    assert rl.can_insert(50)


def test_default_error_buffer_is_min_size_times_ratio():
    assert limiter(spi=0.5, min_size=100, buffer=0.0).error_buffer == 50.0
    assert limiter(spi=0.0, min_size=100, buffer=0.0).error_buffer == 1.0


def test_one_insert_is_at_most_the_window_the_limiter_keeps():
    # r * m + b = 1 * 256 + 256: an insert admitted whole overshoots by at most 512
    assert limiter(spi=1.0, min_size=256, buffer=256.0).max_insert == 512
    assert limiter(spi=32.0, min_size=1000, buffer=32000.0).max_insert == 2000
    assert limiter(spi=0.0).max_insert is None  # not limited


def test_wait_past_deadline_raises_deadline_exceeded():
    rl = limiter(min_size=10, size=[3])

    async def main():
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded, match="min_size_to_sample 10"):
            async with rl.sample(4, timeout=0.2):
                pass
        return time.monotonic() - start

    assert 0.15 < run(main()) < 2.0
    assert rl.waiting_samples == 0 and rl.sample_wait_seconds > 0.1 and rl.sampled == 0


def test_a_waiting_sample_wakes_when_an_insert_makes_room():
    size = [0]
    rl = limiter(min_size=10, size=size)

    async def main():
        sampler = asyncio.create_task(_sample(rl, 4))
        await asyncio.sleep(0.05)
        assert not sampler.done() and rl.waiting_samples == 1
        async with rl.insert(10, timeout=1):
            size[0] = 10  # the table stored them
        await asyncio.wait_for(sampler, 1)

    run(main())
    assert (rl.inserted, rl.sampled, rl.waiting_samples) == (10, 4, 0)


async def _sample(rl, n, timeout=5.0):
    async with rl.sample(n, timeout):
        await asyncio.sleep(0)


def test_waiting_inserts_are_admitted_oldest_first_and_only_as_the_window_allows():
    # r = 1, m = 1, b = 10: an insert may start while diff + pending inserts <= 11.
    size = [100]
    rl = limiter(spi=1.0, min_size=1, buffer=10.0, size=size)
    rl.inserted, rl.sampled = 100, 89  # diff 11: one more insert may start
    order = []

    async def main():
        gate = asyncio.Event()

        async def actor(k):
            async with rl.insert(5, timeout=5):
                order.append(k)
                await gate.wait()

        tasks = [asyncio.create_task(actor(k)) for k in range(6)]
        await asyncio.sleep(0.05)
        assert order == [0] and rl.waiting_inserts == 5  # the rest wait: no thundering herd
        gate.set()
        await asyncio.sleep(0.05)
        # actor 0 stored 5 (diff 16): nobody may go until samples bring diff back down
        assert order == [0] and rl.waiting_inserts == 5
        await _sample(rl, 5)  # diff 11: actor 1 may start, and no one beside it
        await asyncio.sleep(0.05)
        assert order == [0, 1]
        for _ in range(8):
            await _sample(rl, 5)
            await asyncio.sleep(0.01)
        await asyncio.wait_for(asyncio.gather(*tasks), 2)

    run(main())
    assert order == [0, 1, 2, 3, 4, 5]


def test_a_cancelled_waiter_leaves_the_queue_and_lets_the_next_through():
    size = [100]
    rl = limiter(spi=1.0, min_size=1, buffer=1.0, size=size)
    rl.inserted, rl.sampled = 100, 98  # diff 2 = max_diff: one insert may start

    async def main():
        first_in = asyncio.Event()
        hold = asyncio.Event()

        async def holder():
            async with rl.insert(1, timeout=5):
                first_in.set()
                await hold.wait()

        h = asyncio.create_task(holder())
        await first_in.wait()
        waiter = asyncio.create_task(_insert(rl, 1))
        await asyncio.sleep(0.02)
        assert rl.waiting_inserts == 1
        waiter.cancel()  # the caller went away
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert rl.waiting_inserts == 0
        hold.set()
        await h

    run(main())
    assert rl.inserted == 101


async def _insert(rl, n, timeout=5.0):
    async with rl.insert(n, timeout):
        pass


def test_a_failed_body_counts_nothing():
    rl = limiter(spi=0.0, min_size=1, size=[10])

    async def main():
        with pytest.raises(RuntimeError):
            async with rl.insert(5, timeout=1):
                raise RuntimeError("redis down")

    run(main())
    assert rl.inserted == 0


@pytest.mark.parametrize("kwargs", [dict(spi=-1), dict(min_size=0), dict(buffer=-1)])
def test_bad_settings_are_rejected(kwargs):
    with pytest.raises(ValueError):
        limiter(**kwargs)


def test_the_rest_of_a_call_that_had_its_turn_waits_at_the_head_of_the_queue():
    # r = 1, m = 1, b = 10: one insert of 5 may start at diff <= 11.
    rl = limiter(spi=1.0, min_size=1, buffer=10.0, size=[100])
    rl.inserted, rl.sampled = 100, 84  # diff 16: nobody may start
    order = []

    async def insert(name, continuing=False):
        async with rl.insert(5, timeout=5, continuing=continuing):
            order.append(name)

    async def main():
        waiting = [asyncio.create_task(insert(f"new-{k}")) for k in range(3)]
        await asyncio.sleep(0.02)
        rest = asyncio.create_task(insert("rest-of-a-call", continuing=True))
        await asyncio.sleep(0.02)
        assert rl.waiting_inserts == 4
        for _ in range(4):
            await _sample(rl, 5)
            await asyncio.sleep(0.01)
        await asyncio.wait_for(asyncio.gather(*waiting, rest), 2)

    run(main())
    assert order == ["rest-of-a-call", "new-0", "new-1", "new-2"]
