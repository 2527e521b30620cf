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

*Code.* ``ReplayTable`` is this module's; three parts of it live beside it, each one concern
on the same state: ``insert.py`` (the write path), ``recovery.py`` (opening on Redis's data,
reconciling after Redis restarted) and ``frames.py`` (encoding, the frame ring, the cache);
``state.py`` declares that state once for all of them; the checks on priorities and rewards
are plain functions in ``checks.py``.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass

import numpy as np

from amprl.config import ReplayConfig
from amprl.envs.spec import EnvSpec
from amprl.errors import InvalidArgument
from amprl.replay.checks import validate_priorities
from amprl.replay.frames import resolve_compression
from amprl.replay.insert import InsertPath
from amprl.replay.recovery import Recovery
from amprl.replay.storage import ReplayStorage
from amprl.replay.sumtree import SumTree

# Frame ring slots per transition beyond the 2 * stack a transition can reference: room for
# the unreferenced frames of chunks sent with contiguous frames (n-step gaps, short chunks).
FRAME_SLACK = 4


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



class ReplayTable(InsertPath, Recovery):
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
        self._cached = collections.OrderedDict()  # chunk -> bytes
        # Live chunks, oldest first: (chunk id, first key, T, frame base, F).
        self.chunks = collections.deque()
        self._offsets = {}  # chunk id -> frame offsets in its blob

        self.next_key = self.oldest_key = 0
        self.missing = 0
        """Keys in [oldest_key, next_key) whose chunk Redis lost (never sampled)."""
        self._lost = set()  # live chunk ids whose data Redis lost
        # actor id -> (incarnation, newest sequence stored), the least recent first
        self._senders = collections.OrderedDict()
        self.next_chunk = self.oldest_chunk = 0
        self.next_frame = 0
        self.inserted_total = self.env_steps_total = 0
        self.sampled_total = self.priority_updates_total = 0
        self._open()

    # -- the operations -------------------------------------------------------------------

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
        stacks = inverse.astype(np.int32).reshape(2, batch_size, self.stack)
        if encoded is not None and self.compression == "none":
            frames = np.frombuffer(b"".join(encoded.tolist()), dtype=self.frame_dtype).reshape(
                len(encoded), *self.frame_shape)
            encoded = None
        return SampleResult(keys=keys, weights=weights.astype(np.float32),
                            probabilities=probabilities.astype(np.float32),
                            obs_idx=stacks[0], next_obs_idx=stacks[1], actions=actions,
                            rewards=rewards, discounts=discounts, num_frames=len(unique),
                            frames=frames,
                            lz4_frames=None if encoded is None else encoded.tolist(),
                            size=size)

    def update_priorities(self, keys: np.ndarray, priorities: np.ndarray) -> tuple[int, int]:
        """Sets new priorities; returns (updated, skipped because evicted). A key never
        issued is InvalidArgument and nothing is updated."""
        keys = np.asarray(keys)
        if keys.dtype != np.int64 or keys.ndim != 1:
            raise InvalidArgument(f"keys: dtype {keys.dtype} shape {list(keys.shape)}, expected int64 [K]")
        priorities = validate_priorities(priorities, keys.shape[0], "priorities", self.max_priority)
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
