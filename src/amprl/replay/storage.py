"""The Redis layout of a replay table, and the only module that talks to Redis.

Every key starts with the table's prefix and a colon (``{p}:`` below; the prefix is
``amprl:replay:default`` unless configured), so the replay ACL user may touch exactly
``{p}:*`` and send exactly the commands this module sends
(``amprl.common.redis_acl.REPLAY_COMMANDS``):

    {p}:layout        string  JSON of what the data was written with (frame shape and dtype,
                              stack, actions, capacity, compression); checked when the table
                              opens, so a restarted service never misreads old data.
    {p}:counters      hash    next_key, oldest_key, next_chunk, oldest_chunk, next_frame,
                              inserted_total, env_steps_total, sampled_total,
                              priority_updates_total (decimal integers).
    {p}:chunk:<id>    hash    meta: a fixed header and the chunk's arrays (see ChunkMeta);
                              frames: the chunk's F frames, each encoded on its own (lz4
                              block or raw bytes) and concatenated; meta holds the offsets.
    {p}:senders       hash    actor id -> "<incarnation>:<sequence>" of the newest chunk it
                              stored (inserts that number their chunks are stored at most
                              once; written in the insert's transaction).
    {p}:priorities    string  capacity x 4 bytes: the priority p_i of slot i as a big-endian
                              float32. A batch of scattered slots is rewritten by one small
                              Lua script (_SET_PRIORITIES) that takes the (slot, value) pairs
                              as a single packed argument, so the client does O(1) work per
                              batch instead of encoding a command argument per slot.

A transition's key is a monotonically increasing int64; its slot is key % capacity. The live
keys are exactly [oldest_key, next_key) and the live chunks [oldest_chunk, next_chunk), so
the whole index is rebuilt from the counters, the chunk metas and the priorities string.
An insert writes the chunk, its priorities, the counters and the deletion of chunks that
eviction emptied in ONE MULTI/EXEC transaction before it is acknowledged: Redis applies
all of it or none, whenever the replay process dies.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Iterable, Sequence, cast

import numpy as np
import redis
from redis.maint_notifications import MaintNotificationsConfig

from amprl.common.redis_acl import REPLAY_PREFIX, check_prefix
from amprl.errors import ConfigError, FailedPrecondition, ResourceExhausted, Unavailable

COUNTERS = ("next_key", "oldest_key", "next_chunk", "oldest_chunk", "next_frame",
            "inserted_total", "env_steps_total", "sampled_total", "priority_updates_total")

_HEADER = struct.Struct("<4sqqqIIII")  # magic, chunk id, first key, frame base, T, F, stack, action width
_MAGIC = b"AMC1"
_LOAD_BATCH = 512  # chunks per pipelined round trip when rebuilding


@dataclass
class ChunkMeta:
    """Everything about a stored chunk except its frames."""

    chunk_id: int
    first_key: int
    """Key of the chunk's first transition; its T transitions have consecutive keys."""
    frame_base: int
    """Global id of the chunk's first frame; its F frames have consecutive ids."""
    obs_idx: np.ndarray
    """int32 [T, stack], indices into the chunk's frames."""
    next_obs_idx: np.ndarray
    actions: np.ndarray
    """int64 [T] or float32 [T, action_dim]."""
    rewards: np.ndarray
    discounts: np.ndarray
    frame_offsets: np.ndarray
    """int64 [F + 1]: frame f is frames_blob[offsets[f]:offsets[f + 1]]."""

    @property
    def num_transitions(self) -> int:
        return int(self.rewards.shape[0])

    @property
    def num_frames(self) -> int:
        return int(self.frame_offsets.shape[0]) - 1

    def encode(self) -> bytes:
        t, stack = self.obs_idx.shape
        width = 0 if self.actions.ndim == 1 else int(self.actions.shape[1])
        header = _HEADER.pack(_MAGIC, self.chunk_id, self.first_key, self.frame_base, t,
                              self.num_frames, stack, width)
        return b"".join((header,
                         np.ascontiguousarray(self.obs_idx, "<i4").tobytes(),
                         np.ascontiguousarray(self.next_obs_idx, "<i4").tobytes(),
                         np.ascontiguousarray(self.actions, "<i8" if width == 0 else "<f4").tobytes(),
                         np.ascontiguousarray(self.rewards, "<f4").tobytes(),
                         np.ascontiguousarray(self.discounts, "<f4").tobytes(),
                         np.ascontiguousarray(self.frame_offsets, "<i8").tobytes()))

    @classmethod
    def decode(cls, blob: bytes) -> "ChunkMeta":
        magic, cid, first, fbase, t, f, stack, width = _HEADER.unpack_from(blob, 0)
        if magic != _MAGIC:
            raise FailedPrecondition(f"chunk meta with magic {magic!r}, expected {_MAGIC!r}")
        pos = _HEADER.size

        def take(dtype: str, count: int) -> np.ndarray:
            nonlocal pos
            a = np.frombuffer(blob, dtype=dtype, count=count, offset=pos)
            pos += a.nbytes
            return a

        obs = take("<i4", t * stack).reshape(t, stack)
        nxt = take("<i4", t * stack).reshape(t, stack)
        actions = take("<i8", t) if width == 0 else take("<f4", t * width).reshape(t, width)
        rewards = take("<f4", t)
        discounts = take("<f4", t)
        offsets = take("<i8", f + 1)
        return cls(cid, first, fbase, obs, nxt, actions, rewards, discounts, offsets)


_SET_PRIORITIES = """
local blob = ARGV[1]
for i = 1, #blob, 8 do
  local slot = struct.unpack('>I4', blob, i)
  redis.call('SETRANGE', KEYS[1], slot * 4, string.sub(blob, i + 4, i + 7))
end
return #blob / 8
"""
"""Writes big-endian (u32 slot, f32 priority) pairs packed in ARGV[1] into KEYS[1]."""


def _unavailable(exc: Exception) -> Unavailable:
    return Unavailable(f"redis: {type(exc).__name__}: {exc}")


class RedisFull(ResourceExhausted):
    """Redis refused a write at its ``maxmemory`` (nothing of the write was stored)."""


class ReplayStorage:
    """Reads and writes one table's keys; every write is a single MULTI/EXEC."""

    def __init__(self, client: redis.Redis, prefix: str = REPLAY_PREFIX):
        self.redis = client
        self.prefix = check_prefix(prefix)
        self._counters = f"{prefix}:counters"
        self._priorities = f"{prefix}:priorities"
        self._layout = f"{prefix}:layout"
        self._senders = f"{prefix}:senders"
        self._set_priorities = client.register_script(_SET_PRIORITIES)

    @classmethod
    def from_url(cls, url: str, prefix: str = REPLAY_PREFIX) -> "ReplayStorage":
        """A client of ``url`` (``redis://`` or ``rediss://`` with ``ssl_ca_certs=`` for TLS;
        ``cli.redis_connection_url`` builds it). On connect it sends only AUTH/HELLO: no
        CLIENT SETINFO, no CLIENT MAINT_NOTIFICATIONS (a managed-cluster feature), which
        are not the ACL user's and would only fill Redis's ACL LOG with refusals."""
        return cls(redis.Redis.from_url(
            url, socket_timeout=30, socket_connect_timeout=10, health_check_interval=30,
            driver_info=None, maint_notifications_config=MaintNotificationsConfig(enabled=False)),
            prefix)

    def chunk_key(self, chunk_id: int) -> str:
        return f"{self.prefix}:chunk:{chunk_id}"

    def close(self) -> None:
        self.redis.close()

    # -- writes ---------------------------------------------------------------------------

    def write_chunk(self, meta: bytes, chunk_id: int, frames: bytes,
                    priority_ranges: Sequence[tuple[int, np.ndarray]], counters: dict[str, int],
                    delete_chunks: Iterable[int], senders: dict[str, str] | None = None,
                    forget_senders: Sequence[str] = ()) -> None:
        """Stores a chunk, its slots' priorities (``(first_slot, float32 values)`` ranges),
        the counters, the sender's newest sequence (``senders``), deletes emptied chunks and
        forgotten senders: all or nothing."""
        try:
            pipe = self.redis.pipeline(transaction=True)
            pipe.hset(self.chunk_key(chunk_id), mapping={"meta": meta, "frames": frames})
            # redis types hset's mapping as Mapping[FieldT, ...], which a dict[str, ...] is
            # not (Mapping is invariant in its key type): the ignores below are for that.
            if senders:
                pipe.hset(self._senders, mapping=senders)  # type: ignore[arg-type]
            if forget_senders:
                pipe.hdel(self._senders, *forget_senders)
            for slot, values in priority_ranges:
                pipe.setrange(self._priorities, 4 * int(slot), values.astype(">f4").tobytes())
            pipe.hset(self._counters, mapping=counters)  # type: ignore[arg-type]
            dead = [self.chunk_key(c) for c in delete_chunks]
            if dead:
                pipe.delete(*dead)
            pipe.execute()
        except redis.RedisError as exc:
            raise self._write_error(exc) from exc

    def write_priorities(self, slots: np.ndarray, priorities: np.ndarray,
                         counters: dict[str, int]) -> None:
        """Sets scattered slots' priorities (one script call), plus the counters."""
        pairs = np.empty(len(slots), dtype=[("slot", ">u4"), ("value", ">f4")])
        pairs["slot"] = slots
        pairs["value"] = priorities
        try:
            pipe = self.redis.pipeline(transaction=True)
            if len(pairs):
                self._set_priorities(keys=[self._priorities], args=[pairs.tobytes()], client=pipe)
            pipe.hset(self._counters, mapping=counters)  # type: ignore[arg-type]  # as above
            pipe.execute()
        except redis.RedisError as exc:
            raise self._write_error(exc) from exc

    def write_layout(self, layout: dict) -> None:
        try:
            self.redis.set(self._layout, json.dumps(layout, sort_keys=True))
        except redis.RedisError as exc:
            raise _unavailable(exc) from exc

    # -- reads ----------------------------------------------------------------------------

    def load_layout(self) -> dict | None:
        try:
            raw = self.redis.get(self._layout)
        except redis.RedisError as exc:
            raise _unavailable(exc) from exc
        return None if raw is None else json.loads(raw)

    def load_counters(self) -> dict[str, int]:
        try:
            raw = self.redis.hgetall(self._counters)
        except redis.RedisError as exc:
            raise _unavailable(exc) from exc
        return {name: int(raw.get(name.encode(), 0)) for name in COUNTERS}

    def load_senders(self) -> dict[str, tuple[int, int]]:
        """Actor id -> (incarnation, sequence) of the newest numbered chunk it stored."""
        try:
            # bytes: the client does not decode responses (redis types them bytes | str)
            raw = cast(dict[bytes, bytes], self.redis.hgetall(self._senders))
        except redis.RedisError as exc:
            raise _unavailable(exc) from exc
        out = {}
        for actor, value in raw.items():
            incarnation, _, sequence = value.decode().partition(":")
            out[actor.decode()] = (int(incarnation), int(sequence))
        return out

    def load_priorities(self, capacity: int) -> np.ndarray:
        """float32 [capacity] (slots never written read as 0)."""
        try:
            raw = cast(bytes | None, self.redis.get(self._priorities)) or b""  # bytes, as above
        except redis.RedisError as exc:
            raise _unavailable(exc) from exc
        out = np.zeros(capacity, dtype=np.float32)
        n = min(len(raw) // 4, capacity)
        out[:n] = np.frombuffer(raw, dtype=">f4", count=n)
        return out

    def _hget_many(self, chunk_ids: Sequence[int], field: str) -> list[bytes | None]:
        out: list[bytes | None] = []
        try:
            for i in range(0, len(chunk_ids), _LOAD_BATCH):
                pipe = self.redis.pipeline(transaction=False)
                for cid in chunk_ids[i:i + _LOAD_BATCH]:
                    pipe.hget(self.chunk_key(cid), field)
                out.extend(pipe.execute())
        except redis.RedisError as exc:
            raise _unavailable(exc) from exc
        return out

    def load_metas(self, chunk_ids: Sequence[int]) -> list[ChunkMeta | None]:
        return [None if b is None else ChunkMeta.decode(b)
                for b in self._hget_many(chunk_ids, "meta")]

    def load_frames(self, chunk_ids: Sequence[int]) -> list[bytes | None]:
        """The chunks' concatenated encoded frames (None for a chunk that is gone)."""
        return self._hget_many(chunk_ids, "frames")

    def chunks_exist(self, chunk_ids: Sequence[int]) -> list[bool]:
        """Whether Redis holds each chunk's meta (pipelined, _LOAD_BATCH per round trip)."""
        out: list[bool] = []
        try:
            for i in range(0, len(chunk_ids), _LOAD_BATCH):
                pipe = self.redis.pipeline(transaction=False)
                for cid in chunk_ids[i:i + _LOAD_BATCH]:
                    pipe.hexists(self.chunk_key(cid), "meta")
                out.extend(bool(x) for x in pipe.execute())
        except redis.RedisError as exc:
            raise _unavailable(exc) from exc
        return out

    def server_id(self) -> str:
        """The Redis server's run id: a new one after every restart of the server."""
        try:
            return str(self.redis.info("server")["run_id"])
        except redis.RedisError as exc:
            raise _unavailable(exc) from exc

    def _write_error(self, exc: redis.RedisError) -> Unavailable | RedisFull:
        """What a failed write means for the caller: Redis at maxmemory refused it (an OOM
        reply, or a transaction discarded because a command in it got one: EXECABORT) or
        Redis could not be reached."""
        if isinstance(exc, redis.exceptions.OutOfMemoryError) or (
                isinstance(exc, redis.exceptions.ExecAbortError) and "OOM" in str(exc)):
            return self._full()
        return _unavailable(exc)

    def _full(self) -> RedisFull:
        try:
            used, limit = self.used_memory(), self.max_memory()
        except Unavailable:
            used = limit = -1
        return RedisFull(f"Redis is full: it refused a write at maxmemory ({limit} bytes; "
                         f"{used} used)")

    def ensure_durability(self, appendfsync: str) -> None:
        """Makes sure Redis keeps an AOF fsynced ``appendfsync`` ("everysec" or "always").

        Connected as the ``default`` user, replay sets it. A named ACL user (replay's own,
        ``amprl.common.redis_acl``) may not send CONFIG, whose GET would show the admin
        password, and replay does not try: Redis's own configuration sets the policy
        (``amprl run`` and the chart write it from replay.durability) and replay checks
        what INFO shows, that the AOF is on; so it does where CONFIG is refused or
        renamed. ConfigError naming the setting when the AOF is off, or when Redis
        refuses to be configured."""
        if self.redis.connection_pool.connection_kwargs.get("username") not in (None, "", "default"):
            self._check_aof_on(appendfsync)
            return
        try:
            current = self.redis.config_get("append*")
        except redis.ResponseError:  # NOPERM, or an unknown (renamed) command
            self._check_aof_on(appendfsync)
            return
        except redis.RedisError as exc:
            raise _unavailable(exc) from exc
        try:
            if current.get("appendonly") != "yes":
                self.redis.config_set("appendonly", "yes")
            if current.get("appendfsync") != appendfsync:
                self.redis.config_set("appendfsync", appendfsync)
        except redis.ResponseError as exc:
            raise ConfigError(f"replay.durability: {appendfsync} needs Redis with "
                              f"'appendonly yes' and 'appendfsync {appendfsync}', and this Redis "
                              f"refuses to be configured ({exc}): set both in its own "
                              f"configuration") from None
        except redis.RedisError as exc:
            raise _unavailable(exc) from exc

    def _check_aof_on(self, appendfsync: str) -> None:
        try:
            aof = int(self.redis.info("persistence").get("aof_enabled", 0))
        except redis.RedisError as exc:
            raise _unavailable(exc) from exc
        if not aof:
            raise ConfigError(f"replay.durability: {appendfsync} needs Redis with 'appendonly "
                              f"yes' and 'appendfsync {appendfsync}' in its own configuration "
                              f"(replay's ACL user may not send CONFIG), and its AOF is off")

    def max_memory(self) -> int:
        """Redis's maxmemory in bytes; 0 when it has none."""
        try:
            return int(self.redis.info("memory").get("maxmemory", 0))
        except redis.RedisError as exc:
            raise _unavailable(exc) from exc

    def used_memory(self) -> int:
        try:
            return int(self.redis.info("memory")["used_memory"])
        except redis.RedisError as exc:
            raise _unavailable(exc) from exc
