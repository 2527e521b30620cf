"""The replay table's state, declared once for the parts that share it.

``ReplayTable.__init__`` (``table.py``) sets every attribute declared here; ``FrameCache``,
``InsertPath`` and ``Recovery`` work on them. ``TableState`` sets nothing itself: it names
the state and its types so that each part reads (and is type-checked) against one
declaration, and it holds the two views of the counters that every part uses.
"""

from __future__ import annotations

import collections
import threading

import numpy as np

from amprl.envs.spec import EnvSpec
from amprl.replay.storage import ReplayStorage
from amprl.replay.sumtree import SumTree


class TableState:
    """The state of one ``ReplayTable`` (see ``table.py``'s docstring for what it means)."""

    # The configuration, fixed when the table opens.
    storage: ReplayStorage
    spec: EnvSpec
    capacity: int
    alpha: float
    max_priority: float
    max_abs_reward: float
    compression: str
    stack: int
    frame_shape: tuple[int, ...]
    frame_dtype: np.dtype
    frame_nbytes: int
    frame_capacity: int
    cache_max_bytes: int
    dense: bool

    lock: threading.Lock
    rng: np.random.Generator

    # The index, one entry per slot (key % capacity).
    tree: SumTree
    slot_key: np.ndarray
    obs_fid: np.ndarray
    next_fid: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    discounts: np.ndarray
    priorities: np.ndarray

    # The frame ring and its cache.
    frame_chunk: np.ndarray
    frame_pool: np.ndarray
    cache_bytes: int
    _cached: collections.OrderedDict[int, int]
    chunks: collections.deque[tuple[int, int, int, int, int]]
    _offsets: dict[int, np.ndarray]

    # Keys, chunks, senders and counters.
    next_key: int
    oldest_key: int
    missing: int
    _lost: set[int]
    _senders: collections.OrderedDict[str, tuple[int, int]]
    next_chunk: int
    oldest_chunk: int
    next_frame: int
    inserted_total: int
    env_steps_total: int
    sampled_total: int
    priority_updates_total: int

    @property
    def size(self) -> int:
        """Transitions stored (live keys, less the missing ones)."""
        return self.next_key - self.oldest_key - self.missing

    def _counters(self, **override: int) -> dict[str, int]:
        c = {"next_key": self.next_key, "oldest_key": self.oldest_key,
             "next_chunk": self.next_chunk, "oldest_chunk": self.oldest_chunk,
             "next_frame": self.next_frame, "inserted_total": self.inserted_total,
             "env_steps_total": self.env_steps_total, "sampled_total": self.sampled_total,
             "priority_updates_total": self.priority_updates_total}
        c.update(override)
        return c
