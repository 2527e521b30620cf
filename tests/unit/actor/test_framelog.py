"""FrameLog: frames by id, compaction from the oldest live id, growth, chunk packing."""

from __future__ import annotations

import numpy as np

from amprl.actor.framelog import FrameLog


def frames(first: int, m: int) -> np.ndarray:
    """m frames [2] whose values name their id."""
    return np.stack([np.full(2, i, dtype=np.int16) for i in range(first, first + m)])


def test_ids_count_up_in_order_of_arrival_and_fetch_their_frames():
    log = FrameLog((2,), np.int16, capacity=8, batch=3)
    assert log.append(frames(0, 3), lambda: 0).tolist() == [0, 1, 2]
    assert log.append(frames(3, 1), lambda: 0).tolist() == [3]
    assert log.end() == 4
    np.testing.assert_array_equal(log.get(np.array([[1, 3], [0, 0]]))[..., 0], [[1, 3], [0, 0]])


def test_a_full_log_drops_the_frames_before_the_oldest_live_id():
    log = FrameLog((2,), np.int16, capacity=8, batch=2)
    for first in range(0, 8, 2):
        log.append(frames(first, 2), lambda: 0)
    asked = []
    ids = log.append(frames(8, 2), lambda: asked.append(1) or 7)
    assert asked == [1] and ids.tolist() == [8, 9]
    assert log.capacity == 8  # one live frame and two new fit in half: compacted, not grown
    np.testing.assert_array_equal(log.get(np.arange(7, 10))[:, 0], [7, 8, 9])


def test_a_log_mostly_live_grows_and_keeps_every_live_frame():
    log = FrameLog((2,), np.int16, capacity=4, batch=2)
    log.append(frames(0, 4), lambda: 0)
    log.append(frames(4, 2), lambda: 1)
    assert log.capacity >= 10
    np.testing.assert_array_equal(log.get(np.arange(1, 6))[:, 0], [1, 2, 3, 4, 5])


def test_pack_takes_each_distinct_frame_once_and_indexes_it():
    log = FrameLog((2,), np.int16, capacity=16, batch=4)
    log.append(frames(0, 10), lambda: 0)
    ids = np.array([[[2, 3], [3, 5]], [[5, 9], [9, 9]]])
    used, idx = log.pack(ids)
    assert used[:, 0].tolist() == [2, 3, 5, 9]
    assert idx.dtype == np.int32 and idx.shape == ids.shape
    np.testing.assert_array_equal(used[idx][..., 0], ids)
