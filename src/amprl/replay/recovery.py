"""How the replay table recovers its index from Redis: opening on what Redis holds, and
reconciling with it after Redis restarted.

``Recovery`` is a part of ``ReplayTable`` (it is mixed into it, see ``table.py``) and works on
the table's state (``state.py``), which ``ReplayTable.__init__`` sets up. It is its own module because
rebuilding and repairing the index (layouts, lost chunks, missing keys) is a concern apart
from the table's daily inserts and samples; the *Lost chunks* part of ``table.py``'s
docstring says what it keeps and drops.
"""

from __future__ import annotations

import collections
import logging

import numpy as np

from amprl.envs.spec import EnvSpec
from amprl.errors import ConfigError, FailedPrecondition, Unavailable
from amprl.replay.frames import FrameCache
from amprl.replay.storage import ChunkMeta

# These are ReplayTable's lines: they keep the table's logger name.
log = logging.getLogger("amprl.replay.table")


def _layout(spec: EnvSpec, capacity: int, compression: str) -> dict:
    """What a table's stored data depends on; a table opens only on data of its layout."""
    return {"version": 1, "capacity": capacity, "compression": compression,
            "frame_shape": list(spec.frame_shape), "frame_dtype": np.dtype(spec.frame_dtype).str,
            "frame_stack": spec.frame_stack, "discrete": spec.discrete,
            "action_dim": 0 if spec.discrete else spec.action_dim}


class Recovery(FrameCache):
    """Opening the table on Redis's data and reconciling with it (a part of ``ReplayTable``)."""

    def _open(self) -> None:
        self._open_index()
        self._check_fits()

    def _check_fits(self) -> None:
        """Refuses a capacity that cannot fit Redis's maxmemory, before anything fills it:
        bytes per transition as measured (once the table holds 1% of its capacity), else a
        lower bound (the index fields, plus the frames when stored uncompressed)."""
        limit = self.storage.max_memory()
        if not limit:
            return
        if self.size >= max(1000, self.capacity // 100):
            per, how = self.storage.used_memory() / self.size, "as stored so far"
        else:
            width = 1 if self.spec.discrete else self.spec.action_dim
            per = 8 * self.stack + 8 * width + 4 * 3 + 8
            if self.compression == "none":
                per += self.frame_nbytes
            how = "at the least"
        if per * self.capacity > limit:
            raise ConfigError(
                f"replay.capacity: {self.capacity} transitions at {per:,.0f} bytes each ({how}) "
                f"need ~{per * self.capacity / 2**20:,.0f} MiB, more than Redis's maxmemory "
                f"({limit / 2**20:,.1f} MiB): lower replay.capacity or raise maxmemory")

    def _open_index(self) -> None:
        layout = _layout(self.spec, self.capacity, self.compression)
        stored = self.storage.load_layout()
        if stored is None:
            self.storage.write_layout(layout)
            return
        if stored != layout:
            diff = sorted(k for k in set(stored) | set(layout) if stored.get(k) != layout.get(k))
            raise FailedPrecondition(
                f"Redis prefix {self.storage.prefix!r} holds a replay table written with a "
                f"different layout ({', '.join(f'{k}: stored {stored.get(k)!r}, now {layout.get(k)!r}' for k in diff)}); "
                f"use another Redis database or prefix, or delete the old data")
        c = self.storage.load_counters()
        self._senders.update(self.storage.load_senders())
        self.next_key, self.oldest_key = c["next_key"], c["oldest_key"]
        self.next_chunk, self.oldest_chunk = c["next_chunk"], c["oldest_chunk"]
        self.next_frame = c["next_frame"]
        self.inserted_total, self.env_steps_total = c["inserted_total"], c["env_steps_total"]
        self.sampled_total = c["sampled_total"]
        self.priority_updates_total = c["priority_updates_total"]
        cids = list(range(self.oldest_chunk, self.next_chunk))
        metas = self.storage.load_metas(cids)
        # A run of chunks Redis lacks becomes one lost span: it starts where the chunk
        # before it ended and ends where the chunk after it starts (chunks are consecutive
        # in keys and frames).
        gap: list[int] = []
        key_end, frame_end = self.oldest_key, None
        for cid, meta in zip(cids, metas):
            if meta is None:
                gap.append(cid)
                continue
            if gap:
                self._index_lost(gap, key_end, meta.first_key, frame_end, meta.frame_base)
                gap = []
            self._index_chunk(meta)
            key_end = meta.first_key + meta.num_transitions
            frame_end = meta.frame_base + meta.num_frames
        if gap:
            self._index_lost(gap, key_end, self.next_key, frame_end, self.next_frame)
        present = [cid for cid in cids if cid not in self._lost]
        stored_p = self.storage.load_priorities(self.capacity)
        live = self.slot_key >= 0
        self.priorities[live] = stored_p[live]
        self.tree.rebuild(np.where(live, self.priorities.astype(np.float64) ** self.alpha, 0.0))
        if self.dense and present:
            for cid, blob in zip(present, self.storage.load_frames(present)):
                if blob is None:  # its meta was there a moment ago: Redis restarted since
                    raise Unavailable(f"Redis lost the frames of chunk {cid} while the replay "
                                      f"table opened (it restarted?): retry")
                self._cache_frames(cid, self._split_blob(cid, blob))
        if self.missing:
            log.warning("Redis lacks %d of the %d live chunks (%d transitions): they are dropped "
                        "from the index and counted as missing (Redis lost its last writes?)",
                        len(self._lost), len(cids), self.missing)
        log.info("replay table rebuilt from Redis: %d transitions in %d chunks (keys %d..%d)",
                 self.size, len(self.chunks), self.oldest_key, self.next_key)

    def _index_lost(self, cids: list[int], key_start: int, key_end: int,
                    frame_start: int | None, frame_end: int) -> None:
        """Index entries for consecutive lost chunks ``cids`` spanning keys
        [key_start, key_end) and frames [frame_start, frame_end): the first entry carries
        the span, the others are empty, so live chunk ids stay consecutive."""
        key_start = max(key_start, self.oldest_key)
        if frame_start is None:  # the span opens the table: its frames start where they may
            frame_start = frame_end
        self.chunks.append((cids[0], key_start, key_end - key_start, frame_start,
                            frame_end - frame_start))
        for cid in cids[1:]:
            self.chunks.append((cid, key_end, 0, frame_end, 0))
        self._lost.update(cids)
        self.missing += key_end - key_start

    def _index_chunk(self, meta: ChunkMeta) -> None:
        t = meta.num_transitions
        keys = meta.first_key + np.arange(t, dtype=np.int64)
        keep = keys >= self.oldest_key
        slots = keys[keep] % self.capacity
        self.slot_key[slots] = keys[keep]
        self.obs_fid[slots] = meta.frame_base + meta.obs_idx[keep]
        self.next_fid[slots] = meta.frame_base + meta.next_obs_idx[keep]
        self.actions[slots] = meta.actions[keep]
        self.rewards[slots] = meta.rewards[keep]
        self.discounts[slots] = meta.discounts[keep]
        fslots = (meta.frame_base + np.arange(meta.num_frames)) % self.frame_capacity
        self.frame_chunk[fslots] = meta.chunk_id
        self.chunks.append((meta.chunk_id, meta.first_key, t, meta.frame_base, meta.num_frames))
        self._offsets[meta.chunk_id] = meta.frame_offsets

    def reconcile(self) -> int:
        """Checks that Redis still holds every live chunk (after it restarted, possibly
        without its last writes) and marks the keys of those it lacks missing; writes the
        layout again if Redis lost it and takes each sender's newest stored sequence from
        it. Returns the transitions newly missing."""
        with self.lock:
            if self.storage.load_layout() is None:
                self.storage.write_layout(_layout(self.spec, self.capacity, self.compression))
            # what each sender has stored is what Redis holds now: a chunk it lost is new
            self._senders = collections.OrderedDict(self.storage.load_senders())
            held = [e for e in self.chunks if e[2] > 0 and e[0] not in self._lost]
            exists = self.storage.chunks_exist([e[0] for e in held])
            newly = 0
            for (cid, first, t, _, _), ok in zip(held, exists):
                if ok:
                    continue
                keys = np.arange(max(first, self.oldest_key), first + t, dtype=np.int64)
                slots = keys % self.capacity
                self.slot_key[slots] = -1
                self.priorities[slots] = 0
                self.tree.update(slots, np.zeros(slots.size))
                self._uncache(cid)
                self._offsets.pop(cid, None)
                self._lost.add(cid)
                newly += int(keys.size)
            self.missing += newly
        if newly:
            log.warning("Redis lacks %d transitions of live chunks (it restarted without its "
                        "last writes?): marked missing; %d remain", newly, self.size)
        return newly
