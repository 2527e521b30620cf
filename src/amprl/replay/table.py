"""The replay table: prioritized, FIFO-evicted, persisted in Redis, indexed in memory.

Concepts
--------
*Keys.* Every transition gets the next int64 key (0, 1, 2, ...) in insertion order and
lives in slot ``key % capacity``; the live keys are exactly ``[oldest_key, next_key)``.
Inserting past capacity advances ``oldest_key`` (FIFO eviction). A key below
``oldest_key`` is *evicted*; a key at or above ``next_key`` was *never issued*.

*Frames.* A chunk's F frames get consecutive global frame ids and sit in a ring of
``frame_capacity = (2 * stack + 4) * capacity`` frame slots; each transition keeps the frame
ids of its observation and next observation, so stacks are rebuilt at sample time and a
frame shared by eight stacks is stored once. Should the frames of live chunks ever outgrow
the ring (it takes chunks with many more frames than transitions), the oldest chunks are
evicted early.

*Priorities.* Slot i carries p_i (as sent, > 0) and the sum-tree carries p_i^alpha, so
P(i) = p_i^alpha / sum_j p_j^alpha. Importance weights are
w_i = (N * P(i))^-beta / max_j w_j, and max_j w_j belongs to the smallest priority in the
table, so w_i = (p_i^alpha / min_j p_j^alpha)^-beta (<= 1). The min-tree beside the sum-tree
gives min_j in O(1).

*Lost chunks.* Redis can come back from a crash without its last writes (AOF ``everysec``
loses up to a second). A table that opens on such data, or that sees Redis restart under
it (``reconcile``), keeps every chunk Redis still holds and marks the keys of the chunks it
lacks *missing*: they stay inside ``[oldest_key, next_key)`` but are never sampled,
updated or counted in ``size``, and they age out with FIFO eviction like any other key.
``missing`` counts them; nothing stops the table from opening.

*Storage.* Redis holds the truth (see ``storage.py``); memory holds the index (keys, frame
ids, actions, rewards, discounts, priorities per slot, the sum-tree) and a cache of the
encoded frames. Vector frames (CartPole, MuJoCo) are kept whole in one NumPy array when it
fits ``cache_max_bytes``; image frames are kept as one lz4 block each, at most
``cache_max_bytes`` of them (oldest chunks dropped first); a sample that needs a dropped
frame fetches its chunk back from Redis. An insert is written to Redis (one transaction)
before memory changes, so a failure stores nothing and an acknowledged chunk survives a
``kill -9``: ``ReplayTable`` rebuilds its whole index from Redis when it opens.

*Threads.* The table is called from the replay server's worker threads. One lock guards
the index; compression, decoding and message building stay outside it. The table never
waits: the rate limiter (``ratelimiter.py``) admits calls on the server's event loop before
they reach a worker, and the table counts what was inserted and sampled.
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass
from typing import NamedTuple

import lz4.block
import numpy as np

from amprl.config import ReplayConfig
from amprl.envs.spec import EnvSpec
from amprl.errors import ConfigError, FailedPrecondition, InvalidArgument, Unavailable
from amprl.replay.storage import ChunkMeta, RedisFull, ReplayStorage
from amprl.replay.sumtree import SumTree
from amprl.rl.transitions import Chunk

log = logging.getLogger(__name__)

# Frame ring slots per transition beyond the 2 * stack a transition can reference: room for
# the unreferenced frames of chunks sent with contiguous frames (n-step gaps, short chunks).
FRAME_SLACK = 4


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


@dataclass
class SampleResult:
    """A prioritized batch, frames deduplicated (what SampleResponse carries)."""

    keys: np.ndarray
    """int64 [B]."""
    weights: np.ndarray
    """float32 [B], importance weights normalised by the table's largest (<= 1)."""
    probabilities: np.ndarray
    """float32 [B], P(i)."""
    obs_idx: np.ndarray
    """int32 [B, stack], indices into the batch's distinct frames."""
    next_obs_idx: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    discounts: np.ndarray
    num_frames: int
    frames: np.ndarray | None
    """[U, *frame_shape] raw frames, or None when ``lz4_frames`` holds them."""
    lz4_frames: list[bytes] | None
    """U lz4 blocks (no size header), one per frame."""
    size: int


def resolve_compression(compression: str, spec: EnvSpec) -> str:
    """"auto" means lz4 for uint8 image frames (2-D or more), none for vectors."""
    if compression == "auto":
        return "lz4" if spec.frame_dtype == np.uint8 and len(spec.frame_shape) >= 2 else "none"
    return compression


def _layout(spec: EnvSpec, capacity: int, compression: str) -> dict:
    return {"version": 1, "capacity": capacity, "compression": compression,
            "frame_shape": list(spec.frame_shape), "frame_dtype": np.dtype(spec.frame_dtype).str,
            "frame_stack": spec.frame_stack, "discrete": spec.discrete,
            "action_dim": 0 if spec.discrete else spec.action_dim}


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


def _validate_priorities(priorities: np.ndarray, n: int, name: str,
                         max_priority: float = float("inf")) -> np.ndarray:
    p = np.asarray(priorities)
    if p.dtype != np.float32:
        raise InvalidArgument(f"{name}: dtype {p.dtype}, expected float32")
    if p.shape != (n,):
        raise InvalidArgument(f"{name}: shape {list(p.shape)}, expected [{n}]")
    if not (np.isfinite(p.sum()) or np.isfinite(p).all()):
        raise InvalidArgument(f"{name}: NaN or infinite priority; priorities must be finite and > 0")
    if n and p.min() <= 0:
        raise InvalidArgument(f"{name}: priority {float(p.min())!r} <= 0; priorities must be "
                              f"|delta| + epsilon > 0")
    if n and p.max() > max_priority:
        raise InvalidArgument(f"{name}: priority {float(p.max()):g} above replay.max_priority "
                              f"({max_priority:g}); one such priority would dominate sampling")
    return p


class ReplayTable:
    """One prioritized replay table; see the module docstring."""

    def __init__(self, storage: ReplayStorage, spec: EnvSpec, cfg: ReplayConfig, *,
                 seed: int | None = None):
        self.storage = storage
        self.spec = spec
        self.capacity = int(cfg.capacity)
        self.alpha = float(cfg.alpha)
        self.max_priority = float(cfg.max_priority)
        self.max_abs_reward = float(cfg.max_abs_reward)
        self.compression = resolve_compression(cfg.compression, spec)
        if self.compression not in ("lz4", "none"):
            raise InvalidArgument(f"replay.compression: {cfg.compression!r} is not one of auto, none, lz4")
        self.stack = spec.frame_stack
        self.frame_shape = tuple(spec.frame_shape)
        self.frame_dtype = np.dtype(spec.frame_dtype)
        self.frame_nbytes = int(np.prod(self.frame_shape, dtype=np.int64)) * self.frame_dtype.itemsize
        self.frame_capacity = (2 * self.stack + FRAME_SLACK) * self.capacity
        self.cache_max_bytes = int(cfg.cache_max_bytes)
        # Dense: every frame raw in one array (small vector frames). Otherwise one encoded
        # bytes object per frame slot (None when not cached).
        self.dense = (self.compression == "none"
                      and self.frame_capacity * self.frame_nbytes <= self.cache_max_bytes)

        self.lock = threading.Lock()
        self.rng = np.random.default_rng(seed)

        cap = self.capacity
        self.tree = SumTree(cap)
        self.slot_key = np.full(cap, -1, dtype=np.int64)
        self.obs_fid = np.zeros((cap, self.stack), dtype=np.int64)
        self.next_fid = np.zeros((cap, self.stack), dtype=np.int64)
        self.actions = (np.zeros(cap, dtype=np.int64) if spec.discrete
                        else np.zeros((cap, spec.action_dim), dtype=np.float32))
        self.rewards = np.zeros(cap, dtype=np.float32)
        self.discounts = np.zeros(cap, dtype=np.float32)
        self.priorities = np.zeros(cap, dtype=np.float32)

        fcap = self.frame_capacity
        self.frame_chunk = np.full(fcap, -1, dtype=np.int64)  # frame slot -> chunk id
        if self.dense:
            self.frame_pool = np.zeros((fcap, *self.frame_shape), dtype=self.frame_dtype)
        else:
            self.frame_pool = np.full(fcap, None, dtype=object)
        self.cache_bytes = 0
        self._cached: collections.OrderedDict[int, int] = collections.OrderedDict()  # chunk -> bytes
        # Live chunks, oldest first: (chunk id, first key, T, frame base, F).
        self.chunks: collections.deque[tuple[int, int, int, int, int]] = collections.deque()
        self._offsets: dict[int, np.ndarray] = {}  # chunk id -> frame offsets in its blob

        self.next_key = self.oldest_key = 0
        self.missing = 0
        """Keys in [oldest_key, next_key) whose chunk Redis lost (never sampled)."""
        self._lost: set[int] = set()  # live chunk ids whose data Redis lost
        # actor id -> (incarnation, newest sequence stored), the least recent first
        self._senders: collections.OrderedDict[str, tuple[int, int]] = collections.OrderedDict()
        self.next_chunk = self.oldest_chunk = 0
        self.next_frame = 0
        self.inserted_total = self.env_steps_total = 0
        self.sampled_total = self.priority_updates_total = 0
        self._open()

    # -- opening: rebuild the index from Redis --------------------------------------------

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

    # -- frames cache ---------------------------------------------------------------------

    @staticmethod
    def _encode_frames(frames: np.ndarray) -> list[bytes]:
        return [lz4.block.compress(f, store_size=False) for f in frames]

    def _frame_slots(self, frame_base: int, count: int) -> np.ndarray:
        return (frame_base + np.arange(count, dtype=np.int64)) % self.frame_capacity

    def _chunk_entry(self, cid: int) -> tuple[int, int, int, int, int]:
        return self.chunks[cid - self.chunks[0][0]]  # live chunk ids are consecutive

    def _split_blob(self, cid: int, blob: bytes) -> list[bytes]:
        off = self._offsets[cid].tolist()
        mv = memoryview(blob)
        return [bytes(mv[off[i]:off[i + 1]]) for i in range(len(off) - 1)]

    def _cache_frames(self, cid: int, encoded: list[bytes]) -> None:
        """Puts a live chunk's encoded frames in memory, dropping the oldest cached chunks
        beyond cache_max_bytes (never the one just added)."""
        _, _, _, fbase, f = self._chunk_entry(cid)
        slots = self._frame_slots(fbase, f)
        if self.dense:
            raw = np.frombuffer(b"".join(encoded), dtype=self.frame_dtype)
            self.frame_pool[slots] = raw.reshape(f, *self.frame_shape)
            return
        if cid in self._cached:
            return
        holder = np.empty(f, dtype=object)
        holder[:] = encoded
        self.frame_pool[slots] = holder
        nbytes = sum(len(e) for e in encoded)
        self._cached[cid] = nbytes
        self.cache_bytes += nbytes
        while self.cache_bytes > self.cache_max_bytes and len(self._cached) > 1:
            self._uncache(next(iter(self._cached)))

    def _uncache(self, cid: int) -> None:
        nbytes = self._cached.pop(cid, None)
        if nbytes is None:
            return
        self.cache_bytes -= nbytes
        _, _, _, fbase, f = self._chunk_entry(cid)
        self.frame_pool[self._frame_slots(fbase, f)] = None

    # -- the operations -------------------------------------------------------------------

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

    def check_chunk(self, chunk: Chunk, priorities: np.ndarray, name: str = "chunk", *,
                    values: bool = True) -> np.ndarray:
        """Checks what the EnvSpec cannot: priorities (their values unless ``values`` is
        False; see ``check_values``), rewards, and sizes against this table."""
        t = len(chunk)
        p = np.asarray(priorities)
        if p.dtype != np.float32 or p.shape != (t,):
            _validate_priorities(p, t, "priorities")  # raises naming dtype or shape
        if values:
            _validate_priorities(p, t, "priorities", self.max_priority)
            self._check_rewards(chunk.rewards, f"{name}.rewards")
        if t > self.capacity:
            raise InvalidArgument(f"{name}: {t} transitions exceed the table capacity {self.capacity}")
        return p

    def _check_rewards(self, rewards: np.ndarray, name: str) -> None:
        if rewards.size and float(np.abs(rewards).max()) > self.max_abs_reward:
            raise InvalidArgument(f"{name}: |reward| {float(np.abs(rewards).max()):g} above "
                                  f"replay.max_abs_reward ({self.max_abs_reward:g})")

    def check_values(self, items: list[tuple[Chunk, np.ndarray]]) -> tuple[int, InvalidArgument] | None:
        """Validates many chunks' priorities and rewards against this table's bounds at
        once; returns (index of the first bad chunk, its error) or None."""
        def check(chunk: Chunk, p: np.ndarray) -> None:
            _validate_priorities(p, p.shape[0], "priorities", self.max_priority)
            self._check_rewards(chunk.rewards, "chunk.rewards")

        try:
            if len(items) == 1:
                check(*items[0])
            else:
                _validate_priorities(np.concatenate([p for _, p in items]),
                                     sum(p.shape[0] for _, p in items), "priorities",
                                     self.max_priority)
                self._check_rewards(np.concatenate([c.rewards for c, _ in items]), "chunk.rewards")
            return None
        except InvalidArgument as first:
            for i, (chunk, p) in enumerate(items):
                try:
                    check(chunk, p)
                except InvalidArgument as exc:
                    return i, exc
            return 0, first

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
        _validate_priorities(priorities, len(chunk), "priorities", self.max_priority)
        self._check_rewards(chunk.rewards, "chunk.rewards")
        env_steps = sum(int(e) for _, _, e in items)
        t = len(chunk)
        if t > self.capacity:
            raise InvalidArgument(f"chunks: {t} transitions exceed the table capacity {self.capacity}")
        num_frames = int(chunk.frames.shape[0])
        if num_frames > self.frame_capacity:
            raise InvalidArgument(f"chunk.frames: {num_frames} frames exceed the frame ring "
                                  f"({self.frame_capacity})")
        if self.compression == "none":
            encoded = None
            frames_blob = np.ascontiguousarray(chunk.frames).tobytes()
            offsets = np.arange(num_frames + 1, dtype=np.int64) * self.frame_nbytes
            if not self.dense:
                mv = memoryview(frames_blob)
                encoded = [bytes(mv[i * self.frame_nbytes:(i + 1) * self.frame_nbytes])
                           for i in range(num_frames)]
        else:
            encoded = self._encode_frames(chunk.frames)
            offsets = np.zeros(num_frames + 1, dtype=np.int64)
            np.cumsum([len(e) for e in encoded], out=offsets[1:])
            frames_blob = b"".join(encoded)
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
        if senders:
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

    def check_sample(self, batch_size: int, beta: float) -> None:
        """InvalidArgument for a batch size or beta no table state could satisfy."""
        if batch_size <= 0:
            raise InvalidArgument(f"batch_size ({batch_size}) must be a positive integer")
        if batch_size > self.capacity:
            raise InvalidArgument(f"batch_size ({batch_size}) exceeds the table capacity "
                                  f"({self.capacity})")
        if not (0.0 <= beta <= 1.0):
            raise InvalidArgument(f"beta ({beta}) must be in [0, 1]")

    def sample(self, batch_size: int, beta: float) -> SampleResult:
        """Draws ``batch_size`` transitions with replacement, transition i with
        probability P(i)."""
        self.check_sample(batch_size, beta)
        with self.lock:
            size = self.size
            if batch_size > size:
                raise InvalidArgument(f"batch_size ({batch_size}) exceeds the {size} "
                                      f"transitions stored")
            slots = self.tree.sample(batch_size, self.rng)
            p_alpha = self.tree.get(slots)
            total, p_min = self.tree.total, self.tree.min
            keys = self.slot_key[slots]
            fids = np.concatenate([self.obs_fid[slots].ravel(), self.next_fid[slots].ravel()])
            actions = self.actions[slots]
            rewards = self.rewards[slots]
            discounts = self.discounts[slots]
            unique, inverse = np.unique(fids, return_inverse=True)
            fslots = unique % self.frame_capacity
            if self.dense:
                frames, encoded = self.frame_pool[fslots], None
            else:
                encoded = self._gather_encoded(unique)
                frames = None
            self.sampled_total += batch_size
        probabilities = p_alpha / total
        weights = (p_alpha / p_min) ** -beta if beta > 0 else np.ones(batch_size)
        inverse = inverse.astype(np.int32).reshape(2, batch_size, self.stack)
        if encoded is not None and self.compression == "none":
            frames = np.frombuffer(b"".join(encoded.tolist()), dtype=self.frame_dtype).reshape(
                len(encoded), *self.frame_shape)
            encoded = None
        return SampleResult(keys=keys, weights=weights.astype(np.float32),
                            probabilities=probabilities.astype(np.float32),
                            obs_idx=inverse[0], next_obs_idx=inverse[1], actions=actions,
                            rewards=rewards, discounts=discounts, num_frames=len(unique),
                            frames=frames,
                            lz4_frames=None if encoded is None else encoded.tolist(),
                            size=size)

    def _gather_encoded(self, fids: np.ndarray) -> np.ndarray:
        """Encoded frames of global frame ids (object array); cache misses are fetched
        from Redis, one pipelined round trip for all their chunks (lock held)."""
        fslots = fids % self.frame_capacity
        encoded = self.frame_pool[fslots]
        missing = np.flatnonzero(np.equal(encoded, None))
        if missing.size:
            cids = np.unique(self.frame_chunk[fslots[missing]]).tolist()
            fetched = {}
            for cid, blob in zip(cids, self.storage.load_frames(cids)):
                if blob is None:
                    raise Unavailable(f"Redis lost the frames of live chunk {cid} (it restarted "
                                      f"without its last writes?); replay reconciles its index "
                                      f"within a second: retry")
                fetched[cid] = self._split_blob(cid, blob)
                self._cache_frames(cid, fetched[cid])
            for i in missing.tolist():
                cid = int(self.frame_chunk[fslots[i]])
                encoded[i] = fetched[cid][int(fids[i]) - self._chunk_entry(cid)[3]]
        return encoded

    def update_priorities(self, keys: np.ndarray, priorities: np.ndarray) -> tuple[int, int]:
        """Sets new priorities; returns (updated, skipped because evicted). A key never
        issued is InvalidArgument and nothing is updated."""
        keys = np.asarray(keys)
        if keys.dtype != np.int64 or keys.ndim != 1:
            raise InvalidArgument(f"keys: dtype {keys.dtype} shape {list(keys.shape)}, expected int64 [K]")
        priorities = _validate_priorities(priorities, keys.shape[0], "priorities", self.max_priority)
        if keys.size == 0:
            return 0, 0
        with self.lock:
            bad = (keys < 0) | (keys >= self.next_key)
            if bad.any():
                raise InvalidArgument(f"keys: key {int(keys[bad][0])} was never issued "
                                      f"(issued keys are [0, {self.next_key}))")
            live = (keys >= self.oldest_key) & (self.slot_key[keys % self.capacity] == keys)
            n_evicted = int((~live).sum())  # evicted, or missing (lost by Redis)
            keys, priorities = keys[live], priorities[live]
            # Last value wins for a key given twice.
            rev_unique, rev_first = np.unique(keys[::-1], return_index=True)
            keep = keys.size - 1 - rev_first
            keys, priorities = keys[keep], priorities[keep]
            slots = keys % self.capacity
            updates = self.priority_updates_total + keys.size
            self._write_or_explain_full(self.storage.write_priorities, slots, priorities,
                                          self._counters(priority_updates_total=updates))
            self.priorities[slots] = priorities
            self.tree.update(slots, priorities.astype(np.float64) ** self.alpha)
            self.priority_updates_total = updates
            return int(keys.size), n_evicted

    def get(self, keys: np.ndarray) -> dict[str, np.ndarray]:
        """The stored fields of live ``keys`` (for tests and tools): priorities, rewards,
        discounts, actions, obs and next_obs (stacks rebuilt)."""
        keys = np.asarray(keys, dtype=np.int64)
        with self.lock:
            if keys.size and (keys.min() < self.oldest_key or keys.max() >= self.next_key):
                raise InvalidArgument(f"keys outside the live range [{self.oldest_key}, {self.next_key})")
            lost = self.slot_key[keys % self.capacity] != keys
            if lost.any():
                raise InvalidArgument(f"key {int(keys[lost][0])} is missing: Redis lost its chunk")
            slots = keys % self.capacity
            fids = np.concatenate([self.obs_fid[slots], self.next_fid[slots]], axis=1)
            if self.dense:
                pool = self.frame_pool[fids % self.frame_capacity]
            else:
                pool = self._gather_encoded(fids.ravel()).reshape(fids.shape)
            out = {"priorities": self.priorities[slots].copy(), "rewards": self.rewards[slots],
                   "discounts": self.discounts[slots], "actions": self.actions[slots]}
        if not self.dense:
            flat = [self._decode_frame(b) for b in pool.ravel().tolist()]
            pool = (np.stack(flat).reshape(*fids.shape, *self.frame_shape) if flat
                    else np.zeros((*fids.shape, *self.frame_shape), self.frame_dtype))
        out["obs"], out["next_obs"] = pool[:, :self.stack], pool[:, self.stack:]
        return out

    def _decode_frame(self, blob: bytes) -> np.ndarray:
        if self.compression == "lz4":
            blob = lz4.block.decompress(blob, uncompressed_size=self.frame_nbytes)
        return np.frombuffer(blob, dtype=self.frame_dtype).reshape(self.frame_shape)

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

    def info(self) -> dict:
        """Sizes and counters, read without the lock: a worker may hold it through a Redis
        round trip, and Info and health must answer at once. Each value is read whole;
        values may come from moments a single insert apart."""
        return {
            "size": self.size, "capacity": self.capacity,
            "inserted_total": self.inserted_total, "sampled_total": self.sampled_total,
            "env_steps_total": self.env_steps_total,
            "priority_updates_total": self.priority_updates_total,
            "total_priority": self.tree.total,
            "oldest_key": self.oldest_key, "next_key": self.next_key,
            "cache_bytes": self.cache_bytes, "missing": self.missing,
        }
