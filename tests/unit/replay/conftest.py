"""Fixtures for the replay logic tests: an in-memory stand-in for ReplayStorage (the real
Redis layout is exercised in tests/integration/replay)."""

from __future__ import annotations

import numpy as np
import pytest

from amprl.errors import Unavailable
from amprl.replay.storage import COUNTERS, ChunkMeta


class MemoryStorage:
    """ReplayStorage's interface over dicts; ``fail_writes`` simulates a dead Redis."""

    def __init__(self):
        self.prefix = "memory"
        self.layout = None
        self.counters = {name: 0 for name in COUNTERS}
        self.chunks: dict[int, tuple[bytes, bytes]] = {}
        self.prio: dict[int, float] = {}
        self.fail_writes = False
        self.senders: dict[str, tuple[int, int]] = {}
        self.frame_loads = 0

    def _check(self):
        if self.fail_writes:
            raise Unavailable("redis: connection refused (simulated)")

    def write_layout(self, layout):
        self.layout = layout

    def load_layout(self):
        return self.layout

    def write_chunk(self, meta, chunk_id, frames, priority_ranges, counters, delete_chunks,
                    senders=None, forget_senders=()):
        self._check()
        self.chunks[chunk_id] = (meta, frames)
        for actor, value in (senders or {}).items():
            incarnation, _, sequence = value.partition(":")
            self.senders[actor] = (int(incarnation), int(sequence))
        for actor in forget_senders:
            self.senders.pop(actor, None)
        for slot, values in priority_ranges:
            for i, v in enumerate(np.asarray(values, np.float32).tolist()):
                self.prio[slot + i] = v
        self.counters = dict(counters)
        for c in delete_chunks:
            self.chunks.pop(c, None)

    def write_priorities(self, slots, priorities, counters):
        self._check()
        for s, p in zip(np.asarray(slots).tolist(), np.asarray(priorities, np.float32).tolist()):
            self.prio[s] = p
        self.counters = dict(counters)

    def load_counters(self):
        return dict(self.counters)

    def load_priorities(self, capacity):
        out = np.zeros(capacity, np.float32)
        for s, p in self.prio.items():
            out[s] = p
        return out

    def load_metas(self, chunk_ids):
        return [ChunkMeta.decode(self.chunks[c][0]) if c in self.chunks else None for c in chunk_ids]

    def load_frames(self, chunk_ids):
        self.frame_loads += len(chunk_ids)
        return [self.chunks[c][1] if c in self.chunks else None for c in chunk_ids]

    def load_senders(self):
        return dict(self.senders)

    def chunks_exist(self, chunk_ids):
        return [c in self.chunks for c in chunk_ids]

    def server_id(self):
        return "memory"

    def max_memory(self):
        return 0

    def used_memory(self):
        return sum(len(m) + len(f) for m, f in self.chunks.values())

    def close(self):
        pass


@pytest.fixture
def storage() -> MemoryStorage:
    return MemoryStorage()
