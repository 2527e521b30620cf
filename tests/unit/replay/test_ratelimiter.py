import threading
import time

import pytest

from amprl.errors import DeadlineExceeded
from amprl.replay.ratelimiter import RateLimiter


def limiter(spi=0.0, min_size=10, buffer=0.0):
    cond = threading.Condition()
    return cond, RateLimiter(cond, samples_per_insert=spi, min_size_to_sample=min_size,
                             error_buffer=buffer)


def test_sampling_waits_for_the_minimum_size():
    _, rl = limiter(min_size=10)
    assert not rl.can_sample(9)
    assert rl.can_sample(10)


def test_ratio_zero_never_blocks_inserts():
    _, rl = limiter(spi=0.0)
    rl.inserted = 10**9
    assert rl.can_insert(10**6)


def test_ratio_window_blocks_inserts_above_and_samples_below():
    # r = 2, m = 10, b = 5: min_diff = 15, max_diff = 25
    _, rl = limiter(spi=2.0, min_size=10, buffer=5.0)
    rl.inserted, rl.sampled = 20, 10  # diff = 30
    assert not rl.can_insert(20) and rl.can_sample(20)
    rl.sampled = 20  # diff = 20
    assert rl.can_insert(20) and rl.can_sample(20)
    rl.sampled = 30  # diff = 10
    assert rl.can_insert(20) and not rl.can_sample(20)


def test_inserts_below_min_size_ignore_the_ratio():
    _, rl = limiter(spi=1.0, min_size=100, buffer=1.0)
    rl.inserted = 50
    assert rl.can_insert(50)


def test_default_error_buffer_is_min_size_times_ratio():
    _, rl = limiter(spi=0.5, min_size=100, buffer=0.0)
    assert rl.error_buffer == 50.0
    _, rl = limiter(spi=0.0, min_size=100, buffer=0.0)
    assert rl.error_buffer == 1.0


def test_wait_past_deadline_raises_deadline_exceeded():
    cond, rl = limiter(min_size=10)
    with cond:
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded, match="min_size_to_sample 10"):
            rl.await_sample(lambda: 3, timeout=0.2)
    assert 0.15 < time.monotonic() - start < 2.0
    assert rl.waiting_samples == 0 and rl.sample_wait_seconds > 0.1


def test_a_waiting_sample_wakes_when_an_insert_makes_room():
    cond, rl = limiter(min_size=10)
    size = [0]
    done = threading.Event()

    def sampler():
        with cond:
            rl.await_sample(lambda: size[0], timeout=5.0)
        done.set()

    th = threading.Thread(target=sampler)
    th.start()
    time.sleep(0.1)
    assert not done.is_set()
    with cond:
        assert rl.waiting_samples == 1
        size[0] = 10
        rl.record_insert(10)
    assert done.wait(2.0)
    th.join()


def test_cancelled_wait_stops():
    cond, rl = limiter(min_size=10)
    with cond, pytest.raises(DeadlineExceeded, match="went away"):
        rl.await_sample(lambda: 0, timeout=None, cancelled=lambda: True)


@pytest.mark.parametrize("kwargs", [dict(spi=-1), dict(min_size=0), dict(buffer=-1)])
def test_bad_settings_are_rejected(kwargs):
    with pytest.raises(ValueError):
        limiter(**kwargs)
