"""ReplayStorage's priority writes against a real redis-server."""

from __future__ import annotations

import numpy as np

from amprl.replay.storage import ReplayStorage


def test_scattered_priority_writes_land_in_their_slots_and_nowhere_else(embedded_redis):
    storage = ReplayStorage.from_url(embedded_redis.user_url(), prefix="amprl:replay:t")
    try:
        capacity = 5000
        base = np.linspace(0.5, 2.0, capacity, dtype=np.float32)
        storage.write_chunk(b"m", 0, b"f", [(0, base)], {"next_key": capacity}, [])
        rng = np.random.default_rng(0)
        slots = rng.choice(capacity, 700, replace=False).astype(np.int64)
        slots[-1] = capacity - 1  # the last byte of the string
        values = rng.uniform(1e-6, 1e3, len(slots)).astype(np.float32)
        storage.write_priorities(slots, values, {"priority_updates_total": 1})
        expected = base.copy()
        expected[slots] = values
        np.testing.assert_array_equal(storage.load_priorities(capacity), expected)  # bit-exact
        assert storage.load_counters()["priority_updates_total"] == 1
        # a slot repeated in one batch ends with its last value, as a replay table applies it
        storage.write_priorities(np.array([7, 7]), np.array([3.0, 4.0], np.float32), {"priority_updates_total": 2})
        assert storage.load_priorities(capacity)[7] == 4.0
        storage.write_priorities(np.array([], np.int64), np.array([], np.float32), {"priority_updates_total": 3})
        assert storage.load_priorities(capacity)[7] == 4.0
    finally:
        storage.close()


def test_a_transaction_discarded_for_oom_is_redis_full_not_unavailable(embedded_redis):
    """Redis answers a MULTI whose queued command hit maxmemory with EXECABORT: that is a
    full Redis (RESOURCE_EXHAUSTED, not retried as if unreachable), as a plain OOM is."""
    import redis

    from amprl.errors import Unavailable
    from amprl.replay.storage import RedisFull

    storage = ReplayStorage.from_url(embedded_redis.user_url())
    oom = "Transaction discarded because of: OOM command not allowed when used memory > 'maxmemory'."
    assert isinstance(storage._write_error(redis.exceptions.ExecAbortError(oom)), RedisFull)
    assert isinstance(storage._write_error(redis.exceptions.OutOfMemoryError("OOM ...")), RedisFull)
    other = redis.exceptions.ExecAbortError("Transaction discarded because of previous errors.")
    assert isinstance(storage._write_error(other), Unavailable)
    assert isinstance(storage._write_error(redis.exceptions.ConnectionError("gone")), Unavailable)
