"""The actor's log of recent frames, by id, and the packing of a chunk's distinct frames.

Frames get ids 0, 1, 2, ... in order of arrival, and an observation is a stack of ids
(oldest first), so consecutive observations share their frames instead of copying them. The
log holds the frames from the oldest id still in use in one array: when it is full, the
frames before that id (the caller knows it) are dropped, and the array doubles when over
half of it is still live, so each frame is moved a bounded number of times on average. A
chunk takes the distinct frames its stacks use, found by a mark-and-count over the log's
window: ids are dense there, so that beats a sort.
"""

from __future__ import annotations

from typing import Callable

import numpy as np


class FrameLog:
    """Frames ``[*frame_shape]`` by id, from the oldest still in use to the newest."""

    def __init__(self, frame_shape: tuple, dtype, capacity: int, batch: int):
        self.frame_shape = tuple(frame_shape)
        self.dtype = dtype
        self._frames = np.empty((capacity, *self.frame_shape), dtype=dtype)
        self._base = 0  # id of _frames[0]
        self._len = 0   # rows of _frames in use
        self._range = np.arange(batch, dtype=np.int64)  # the ids of a batch, less the first

    @property
    def capacity(self) -> int:
        """Frames the array holds before it is compacted or grown."""
        return self._frames.shape[0]

    def append(self, frames: np.ndarray, oldest_live: Callable[[], int]) -> np.ndarray:
        """Stores ``frames`` [m, *frame_shape]; returns their ids, int64 [m]. When the log is
        full, ``oldest_live()`` is asked for the oldest id still in use, and the frames
        before it are dropped."""
        m = frames.shape[0]
        if self._len + m > self.capacity:
            self._compact(oldest_live(), m)
        start = self._len
        self._frames[start:start + m] = frames
        self._len = start + m
        first = self._base + start
        if m == self._range.shape[0]:
            return self._range + first
        return np.arange(first, first + m, dtype=np.int64)

    def get(self, ids: np.ndarray) -> np.ndarray:
        """The frames ``[*ids.shape, *frame_shape]`` of ``ids``."""
        return self._frames[ids - self._base]

    def pack(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The distinct frames ``ids`` (any shape) use, in id order, and each id's index
        among them (int32, the shape of ``ids``)."""
        rel = ids.reshape(-1) - self._base
        mark = np.zeros(self._len, dtype=np.int32)
        mark[rel] = 1
        used = np.flatnonzero(mark)
        np.cumsum(mark, out=mark)
        return self._frames[used], (mark[rel] - 1).reshape(ids.shape)

    def end(self) -> int:
        """The id the next frame will get."""
        return self._base + self._len

    def _compact(self, oldest_live: int, incoming: int) -> None:
        """Drops the frames before id ``oldest_live``, making room for ``incoming`` more."""
        keep_from = oldest_live - self._base
        keep = self._len - keep_from
        cap = self.capacity
        if keep + incoming > cap // 2:  # grow, so compaction stays amortised O(1) per frame
            new = np.empty((max(2 * cap, 2 * (keep + incoming)), *self.frame_shape), dtype=self.dtype)
            new[:keep] = self._frames[keep_from:self._len]
            self._frames = new
        elif keep:
            self._frames[:keep] = self._frames[keep_from:self._len]
        self._base += keep_from
        self._len = keep
