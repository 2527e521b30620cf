"""The replay table's write path: an insert checked, merged, encoded, written to Redis in one
transaction, and only then put in the in-memory index.

``InsertPath`` is a part of ``ReplayTable`` (it is mixed into it, see ``table.py``) and works
on the table's state (``state.py``), which ``ReplayTable.__init__`` sets up. It is its own module because
the write path (resends stored once, FIFO eviction, the frame ring kept from wrapping, the
Redis transaction before memory) is the table's largest concern; sampling reads what it
wrote.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from amprl.errors import InvalidArgument
from amprl.replay.checks import check_rewards, first_bad_chunk, validate_priorities
from amprl.replay.frames import FrameCache
from amprl.replay.storage import ChunkMeta, RedisFull
from amprl.rl.transitions import Chunk

MAX_TRACKED_SENDERS = 16_384
"""Actors whose newest chunk sequence a table remembers (the longest silent is forgotten
beyond it: a resend from an actor silent that long is stored again)."""


class Sender(NamedTuple):
    """Who sends an insert, for storing each numbered chunk at most once."""

    actor_id: str
    incarnation: int
    """The actor process's random incarnation; 0 = its chunks are not numbered."""
    sequences: list[int]
    """Each item's number within the incarnation."""


class Stored(NamedTuple):
    """What ``insert_many`` stored, and what it found stored already."""

    first_key: int
    """Key of the first stored transition (the others follow); next_key when none."""
    chunks: int
    transitions: int
    duplicate_chunks: int
    """Items this table had stored for the sender before (left out)."""
    duplicate_transitions: int


def merge_chunks(chunks: list[Chunk]) -> Chunk:
    """Consecutive chunks as one: frames concatenated, indices shifted."""
    if len(chunks) == 1:
        return chunks[0]
    base = np.cumsum([0] + [c.frames.shape[0] for c in chunks[:-1]]).astype(np.int32)
    return Chunk(frames=np.concatenate([c.frames for c in chunks]),
                 obs_idx=np.concatenate([c.obs_idx + b for c, b in zip(chunks, base)]),
                 next_obs_idx=np.concatenate([c.next_obs_idx + b for c, b in zip(chunks, base)]),
                 actions=np.concatenate([c.actions for c in chunks]),
                 rewards=np.concatenate([c.rewards for c in chunks]),
                 discounts=np.concatenate([c.discounts for c in chunks]))


class InsertPath(FrameCache):
    """Checking and storing inserts (a part of ``ReplayTable``)."""

    def check_chunk(self, chunk: Chunk, priorities: np.ndarray, name: str = "chunk", *,
                    values: bool = True) -> np.ndarray:
        """Checks what the EnvSpec cannot: priorities (their values unless ``values`` is
        False; see ``check_values``), rewards, and sizes against this table."""
        t = len(chunk)
        p = np.asarray(priorities)
        if p.dtype != np.float32 or p.shape != (t,):
            validate_priorities(p, t, "priorities")  # raises naming dtype or shape
        if values:
            validate_priorities(p, t, "priorities", self.max_priority)
            check_rewards(chunk.rewards, f"{name}.rewards", self.max_abs_reward)
        if t > self.capacity:
            raise InvalidArgument(f"{name}: {t} transitions exceed the table capacity {self.capacity}")
        return p

    def check_values(self, items: list[tuple[Chunk, np.ndarray]]) -> tuple[int, InvalidArgument] | None:
        """Validates many chunks' priorities and rewards against this table's bounds at
        once; returns (index of the first bad chunk, its error) or None."""
        return first_bad_chunk(items, self.max_priority, self.max_abs_reward)

    def insert(self, chunk: Chunk, priorities: np.ndarray, env_steps: int = 0) -> int:
        """Stores a validated chunk (see ``amprl.wire.transitions``) with its priorities.

        Returns the key of the chunk's first transition; the others follow consecutively.
        """
        return self.insert_many([(chunk, priorities, env_steps)]).first_key

    def insert_many(self, items: list[tuple[Chunk, np.ndarray, int]],
                    sender: Sender | None = None) -> Stored:
        """Stores consecutive chunks of one actor as ONE stored chunk, in one Redis
        transaction (all or nothing); their keys are consecutive from ``Stored.first_key``.

        With ``sender`` (the actor's id, incarnation and each item's sequence number), items
        that this table already stored for that sender are left out and counted as
        duplicates: a resent chunk is stored at most once, also after a restart (the
        sender's newest sequence is stored with the chunk)."""
        while True:
            keep = self._new_items(items, sender)
            kept = set(keep)
            dups = [c for i, (c, _, _) in enumerate(items) if i not in kept]
            if not keep:
                return Stored(self.next_key, 0, 0, len(dups), sum(len(c) for c in dups))
            prepared = self._prepare([items[i] for i in keep])
            with self.lock:
                if self._new_items(items, sender) != keep:
                    continue  # another call of this sender stored some meanwhile: again
                sequences = [sender.sequences[i] for i in keep] if sender is not None else []
                first = self._store(prepared, sender, sequences)
            return Stored(first, len(keep), len(prepared[0]), len(dups), sum(len(c) for c in dups))

    def _new_items(self, items: list, sender: Sender | None) -> list[int]:
        """Indices of ``items`` not yet stored for ``sender`` (all without one)."""
        if sender is None or not sender.incarnation:
            return list(range(len(items)))
        incarnation, newest = self._senders.get(sender.actor_id, (0, 0))
        if incarnation != sender.incarnation:
            return list(range(len(items)))
        return [i for i, seq in enumerate(sender.sequences) if seq > newest]

    def _prepare(self, items: list[tuple[Chunk, np.ndarray, int]]) -> tuple:
        """The work of an insert that needs no lock: merge, check, encode the frames."""
        prios = [self.check_chunk(c, p, values=False) for c, p, _ in items]
        chunk = merge_chunks([c for c, _, _ in items])
        priorities = prios[0] if len(prios) == 1 else np.concatenate(prios)
        validate_priorities(priorities, len(chunk), "priorities", self.max_priority)
        check_rewards(chunk.rewards, "chunk.rewards", self.max_abs_reward)
        env_steps = sum(int(e) for _, _, e in items)
        t = len(chunk)
        if t > self.capacity:
            raise InvalidArgument(f"chunks: {t} transitions exceed the table capacity {self.capacity}")
        num_frames = int(chunk.frames.shape[0])
        if num_frames > self.frame_capacity:
            raise InvalidArgument(f"chunk.frames: {num_frames} frames exceed the frame ring "
                                  f"({self.frame_capacity})")
        encoded, frames_blob, offsets = self._encode_chunk_frames(chunk.frames)
        p_alpha = priorities.astype(np.float64) ** self.alpha
        return chunk, priorities, env_steps, encoded, frames_blob, offsets, p_alpha

    def _store(self, prepared: tuple, sender: Sender | None, sequences: list[int]) -> int:
        """Writes a prepared insert to Redis, then to the index (lock held); the first key."""
        chunk, priorities, env_steps, encoded, frames_blob, offsets, p_alpha = prepared
        t = len(chunk)
        num_frames = int(chunk.frames.shape[0])
        senders: dict[str, str] = {}
        forget: list[str] = []
        if sender is not None and sender.incarnation:
            senders[sender.actor_id] = f"{sender.incarnation}:{max(sequences)}"
            if sender.actor_id not in self._senders and len(self._senders) >= MAX_TRACKED_SENDERS:
                forget.append(next(iter(self._senders)))  # the longest silent
        cid, first, fbase = self.next_chunk, self.next_key, self.next_frame
        end_key, end_frame = first + t, fbase + num_frames
        # FIFO: make room for t transitions, and keep the frame ring from wrapping onto
        # frames of live chunks.
        new_oldest = max(self.oldest_key, end_key - self.capacity)
        dead: list[int] = []
        for c_id, c_first, c_t, c_fbase, _ in self.chunks:
            if c_first + c_t <= new_oldest:
                dead.append(c_id)
            elif c_fbase < end_frame - self.frame_capacity:
                dead.append(c_id)
                new_oldest = c_first + c_t
            else:
                break
        new_oldest_chunk = dead[-1] + 1 if dead else self.oldest_chunk
        meta = ChunkMeta(cid, first, fbase, chunk.obs_idx, chunk.next_obs_idx, chunk.actions,
                         chunk.rewards, chunk.discounts, offsets)
        slots = (first + np.arange(t, dtype=np.int64)) % self.capacity
        ranges = []
        s0 = int(slots[0])
        n0 = min(t, self.capacity - s0)
        ranges.append((s0, priorities[:n0]))
        if n0 < t:
            ranges.append((0, priorities[n0:]))
        self._write_or_explain_full(
            self.storage.write_chunk, meta.encode(), cid, frames_blob, ranges,
            self._counters(next_key=end_key, oldest_key=new_oldest, next_chunk=cid + 1,
                           oldest_chunk=new_oldest_chunk, next_frame=end_frame,
                           inserted_total=self.inserted_total + t,
                           env_steps_total=self.env_steps_total + int(env_steps)),
            dead, senders, forget)

        # Redis holds it: now memory.
        for actor in forget:
            self._senders.pop(actor, None)
        if sender is not None and senders:
            self._senders[sender.actor_id] = (sender.incarnation, max(sequences))
            self._senders.move_to_end(sender.actor_id)
        evicted = np.arange(self.oldest_key, new_oldest, dtype=np.int64)
        if self.missing:
            self.missing -= int((self.slot_key[evicted % self.capacity] != evicted).sum())
        evicted = evicted[evicted + self.capacity >= end_key]  # not overwritten below
        ev_slots = evicted % self.capacity
        self.slot_key[ev_slots] = -1
        self.priorities[ev_slots] = 0
        for c_id in dead:
            self._uncache(c_id)
            self.chunks.popleft()
            self._offsets.pop(c_id, None)
            self._lost.discard(c_id)
        self.slot_key[slots] = first + np.arange(t, dtype=np.int64)
        self.obs_fid[slots] = fbase + chunk.obs_idx
        self.next_fid[slots] = fbase + chunk.next_obs_idx
        self.actions[slots] = chunk.actions
        self.rewards[slots] = chunk.rewards
        self.discounts[slots] = chunk.discounts
        self.priorities[slots] = priorities
        self.tree.update(np.concatenate([ev_slots, slots]),
                         np.concatenate([np.zeros(ev_slots.size), p_alpha]))
        self.frame_chunk[self._frame_slots(fbase, num_frames)] = cid
        self.chunks.append((cid, first, t, fbase, num_frames))
        self._offsets[cid] = offsets
        if self.dense:
            self.frame_pool[self._frame_slots(fbase, num_frames)] = chunk.frames
        else:
            self._cache_frames(cid, encoded)
        self.next_key, self.oldest_key = end_key, new_oldest
        self.next_chunk, self.oldest_chunk = cid + 1, new_oldest_chunk
        self.next_frame = end_frame
        self.inserted_total += t
        self.env_steps_total += int(env_steps)
        return first

    def _write_or_explain_full(self, write, *args) -> None:
        try:
            write(*args)
        except RedisFull as exc:
            per = self.storage.used_memory() / self.size if self.size else 0.0
            raise RedisFull(
                f"{exc}. This table keeps replay.capacity = {self.capacity} transitions, "
                f"{self.size} so far at about {per:,.0f} bytes each in Redis: lower "
                f"replay.capacity or raise Redis's maxmemory") from None
