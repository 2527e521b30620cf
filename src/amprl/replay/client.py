"""A thin typed client of ``amprl.v1.ReplayService``; methods mirror the RPCs.

    client = ReplayClient("localhost:7000")
    client.insert("actor-0", [(chunk, priorities, env_steps), ...])
    batch = client.sample(256, beta=0.4)
    client.update_priorities(batch.keys, new_priorities)

Failures arrive as ``amprl.errors`` (InvalidArgument, ResourceExhausted, DeadlineExceeded,
Unavailable, ...; mapped by ``amprl.common.channels``). Sample, UpdatePriorities and Info are
retried on UNAVAILABLE by gRPC's retry policy; Insert is not: an Insert that failed
mid-stream reports what was stored, and only the caller knows whether to resend the rest.

Several shards (``AMPRL_REPLAY_ADDRESS=a:7000,b:7000``): ``connect`` returns a
``ShardedReplayClient`` with the same methods (see its docstring for the sampling rule).
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Iterable, Iterator

import grpc
import lz4.block
import numpy as np

from amprl import errors
from amprl.common.channels import make_channel
from amprl.common.grpcutil import DEFAULT_MAX_MESSAGE_BYTES
from amprl.rl.transitions import Chunk, SampledBatch
from amprl.v1 import replay_pb2, replay_pb2_grpc
from amprl.wire.tensors import DTYPES, tensor_from_proto, tensor_to_proto
from amprl.wire.transitions import chunk_to_proto


def decode_frames(batch: replay_pb2.TransitionBatch) -> np.ndarray:
    """The batch's distinct frames [F, *frame_shape], decompressing lz4_frames if used."""
    if not len(batch.lz4_frames):
        return tensor_from_proto(batch.frames, "batch.frames")
    dtype = DTYPES[batch.frames.dtype]
    shape = tuple(batch.frames.shape)
    nbytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
    raw = b"".join([lz4.block.decompress(b, uncompressed_size=nbytes) for b in batch.lz4_frames])
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def sampled_batch_from_proto(resp: replay_pb2.SampleResponse) -> SampledBatch:
    b = resp.batch
    frames = decode_frames(b)
    obs_idx = tensor_from_proto(b.obs_frame_indices, "obs_frame_indices")
    next_idx = tensor_from_proto(b.next_obs_frame_indices, "next_obs_frame_indices")
    if obs_idx.shape[1] == 1:  # vector observations: the frame is the observation
        obs_idx, next_idx = obs_idx[:, 0], next_idx[:, 0]
    return SampledBatch(
        obs=frames[obs_idx], next_obs=frames[next_idx],
        actions=tensor_from_proto(b.actions, "actions"),
        rewards=tensor_from_proto(b.rewards, "rewards"),
        discounts=tensor_from_proto(b.discounts, "discounts"),
        keys=tensor_from_proto(resp.keys, "keys"),
        weights=tensor_from_proto(resp.weights, "weights"),
        probabilities=tensor_from_proto(resp.probabilities, "probabilities"),
        size=int(resp.size))


def insert_request(actor_id: str, chunk: Chunk, priorities: np.ndarray,
                   env_steps: int = 0, incarnation: int = 0,
                   sequence: int = 0) -> replay_pb2.InsertRequest:
    req = replay_pb2.InsertRequest(actor_id=actor_id, env_steps=int(env_steps),
                                   incarnation=incarnation, sequence=sequence)
    chunk_to_proto(chunk, req.chunk)
    tensor_to_proto(np.asarray(priorities, dtype=np.float32), req.priorities)
    return req


_CANCEL_POLL_S = 0.1
"""How often a cancellable call looks at its cancel event."""

_SERVICE = "amprl.v1.ReplayService"
RETRIED = [f"{_SERVICE}/Sample", f"{_SERVICE}/UpdatePriorities", f"{_SERVICE}/Info"]
"""The calls gRPC repeats on UNAVAILABLE: reads, and priority updates (setting a priority
twice is setting it once)."""


class ReplayClient:
    """Client of one replay service at ``address`` ("host:port")."""

    def __init__(self, address: str, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
        self.address = address
        self._channel = make_channel(address, server_role="replay", retry=RETRIED,
                                     max_message_bytes=max_message_bytes)
        self._stub = replay_pb2_grpc.ReplayServiceStub(self._channel)

    def insert(self, actor_id: str,
               items: Iterable[tuple[Chunk, np.ndarray, int]],
               timeout: float | None = None,
               cancel: threading.Event | None = None, *,
               incarnation: int = 0, first_sequence: int = 0) -> replay_pb2.InsertResponse:
        """Streams ``(chunk, priorities float32 [T], env_steps)`` items as one Insert call;
        returns once every chunk is stored (the response counts them). Setting ``cancel``
        ends a call still waiting (DeadlineExceeded): how a stopping actor leaves the rate
        limiter's queue without waiting out a long deadline. With an ``incarnation``, the
        items are numbered ``first_sequence``, ``first_sequence + 1``, ...: resent with the
        same numbers, replay stores each at most once."""
        def requests() -> Iterator[replay_pb2.InsertRequest]:
            for i, (chunk, priorities, env_steps) in enumerate(items):
                yield insert_request(actor_id, chunk, priorities, env_steps, incarnation,
                                     first_sequence + i if incarnation else 0)
        return self.insert_requests(requests(), timeout=timeout, cancel=cancel)

    def insert_requests(self, requests: Iterable[replay_pb2.InsertRequest],
                        timeout: float | None = None,
                        cancel: threading.Event | None = None) -> replay_pb2.InsertResponse:
        """Insert with prebuilt requests (see ``insert_request``)."""
        if cancel is None:
            return self._stub.Insert(iter(requests), timeout=timeout)
        call = self._stub.Insert.future(iter(requests), timeout=timeout)
        while not cancel.is_set():
            try:
                return call.result(timeout=_CANCEL_POLL_S)
            except grpc.FutureTimeoutError:
                continue
        call.cancel()
        raise errors.DeadlineExceeded("insert cancelled: the caller is stopping")

    def sample(self, batch_size: int, beta: float,
               timeout: float | None = None) -> SampledBatch:
        """Draws a prioritized batch; waits (up to ``timeout``) for the min size / rate."""
        return sampled_batch_from_proto(self.sample_raw(batch_size, beta, timeout))

    def sample_raw(self, batch_size: int, beta: float,
                   timeout: float | None = None) -> replay_pb2.SampleResponse:
        return self._stub.Sample(replay_pb2.SampleRequest(batch_size=batch_size, beta=beta),
                                 timeout=timeout)

    def sample_future(self, batch_size: int, beta: float, timeout: float | None = None):
        """A grpc Future of the SampleResponse (for prefetching); decode its result with
        ``sampled_batch_from_proto``."""
        return self._stub.Sample.future(replay_pb2.SampleRequest(batch_size=batch_size, beta=beta),
                                        timeout=timeout)

    def update_priorities(self, keys: np.ndarray, priorities: np.ndarray,
                          timeout: float | None = None) -> replay_pb2.UpdatePrioritiesResponse:
        """Sets new priorities (> 0, finite) for sampled keys."""
        req = replay_pb2.UpdatePrioritiesRequest()
        tensor_to_proto(np.asarray(keys, dtype=np.int64), req.keys)
        tensor_to_proto(np.asarray(priorities, dtype=np.float32), req.priorities)
        return self._stub.UpdatePriorities(req, timeout=timeout)

    def info(self, timeout: float | None = None) -> replay_pb2.ReplayServiceInfoResponse:
        return self._stub.Info(replay_pb2.ReplayServiceInfoRequest(), timeout=timeout)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "ReplayClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- several shards ------------------------------------------------------------------------

SHARD_KEY_BITS = 56
"""Keys handed out by ShardedReplayClient carry the shard index above this bit: a shard's own
keys are < 2**56 (at a million insertions a second, two thousand years)."""

_SHARD_INFO_MAX_AGE_S = 1.0


def shard_for(actor_id: str, num_shards: int) -> int:
    """The shard an actor inserts into: a stable hash of its id (the pod name), so an actor
    keeps its shard across restarts and the fleet spreads evenly without coordination."""
    digest = hashlib.blake2b(actor_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % num_shards


class ShardedReplayClient:
    """Several replay shards behind ReplayClient's methods (``connect`` builds one).

    Each actor inserts into one shard (``shard_for`` its id). Each ``sample`` draws the
    whole batch from one shard, chosen with probability proportional to the shard's total
    priority (Info's total_priority, refreshed at most every second), so a transition's
    chance of being drawn is the same as in one table holding every shard:
    P(i) = (T_s / T) * P_s(i). The batch's probabilities are rescaled to that global P(i);
    its importance weights are the shard's, which differ from the global ones by one
    factor per batch, removed anyway by the normalization by the batch maximum. Keys are
    tagged with their shard (``shard << SHARD_KEY_BITS | key``) so ``update_priorities``
    routes each key back to its shard.
    """

    def __init__(self, addresses: list[str], *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 seed: int | None = None):
        if len(addresses) < 2:
            raise ValueError(f"ShardedReplayClient needs at least 2 addresses, got {addresses}")
        self.addresses = list(addresses)
        self.shards = [ReplayClient(a, max_message_bytes=max_message_bytes) for a in addresses]
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        self._totals: np.ndarray | None = None
        self._totals_at = 0.0

    @property
    def address(self) -> str:
        return ",".join(self.addresses)

    def insert(self, actor_id: str, items: Iterable[tuple[Chunk, np.ndarray, int]],
               timeout: float | None = None,
               cancel: threading.Event | None = None, **numbering) -> replay_pb2.InsertResponse:
        """Inserts into the actor's own shard (its ``size`` is that shard's)."""
        return self.shards[shard_for(actor_id, len(self.shards))].insert(
            actor_id, items, timeout, cancel, **numbering)

    def _pick_shard(self, timeout: float | None) -> int:
        now = time.monotonic()
        with self._lock:
            fresh = self._totals is not None and now - self._totals_at < _SHARD_INFO_MAX_AGE_S
        if not fresh:
            fetched = np.array([float(s.info(timeout=timeout or 5.0).total_priority)
                                for s in self.shards])
            with self._lock:
                self._totals, self._totals_at = fetched, now
        with self._lock:
            totals = self._totals
            assert totals is not None  # set above, never unset
            if totals.sum() <= 0:  # nothing anywhere yet: wait on any shard's min size
                return int(self._rng.integers(len(self.shards)))
            return int(self._rng.choice(len(self.shards), p=totals / totals.sum()))

    def sample(self, batch_size: int, beta: float, timeout: float | None = None) -> SampledBatch:
        """A prioritized batch from one shard chosen by total priority (see the class)."""
        shard = self._pick_shard(timeout)
        batch = self.shards[shard].sample(batch_size, beta, timeout)
        with self._lock:
            totals = self._totals
        assert totals is not None  # _pick_shard set it, never unset
        share = totals[shard] / totals.sum() if totals.sum() > 0 else 1.0 / len(self.shards)
        batch.probabilities = (batch.probabilities * share).astype(np.float32)
        batch.keys = batch.keys | np.int64(shard << SHARD_KEY_BITS)
        return batch

    def update_priorities(self, keys: np.ndarray, priorities: np.ndarray,
                          timeout: float | None = None) -> replay_pb2.UpdatePrioritiesResponse:
        """Routes each tagged key to its shard; the counts are summed."""
        keys = np.asarray(keys, dtype=np.int64)
        priorities = np.asarray(priorities, dtype=np.float32)
        if keys.shape != priorities.shape:
            raise errors.InvalidArgument(f"priorities: {priorities.shape} values for {keys.shape} keys")
        shard_of = keys >> SHARD_KEY_BITS
        bad = (shard_of < 0) | (shard_of >= len(self.shards))
        if bad.any():
            raise errors.InvalidArgument(f"key {int(keys[bad][0])} names no shard of "
                                         f"{len(self.shards)}: pass back the keys sample returned")
        local = keys & np.int64((1 << SHARD_KEY_BITS) - 1)
        out = replay_pb2.UpdatePrioritiesResponse()
        for shard in np.unique(shard_of):
            mine = shard_of == shard
            r = self.shards[int(shard)].update_priorities(local[mine], priorities[mine], timeout)
            out.updated += r.updated
            out.evicted += r.evicted
        return out

    def info(self, timeout: float | None = None) -> replay_pb2.ReplayServiceInfoResponse:
        """Every shard's Info summed (counts, sizes, priorities); rate-limiter fields and the
        live window are the first shard's."""
        infos = [s.info(timeout=timeout) for s in self.shards]
        out = replay_pb2.ReplayServiceInfoResponse()
        out.CopyFrom(infos[0])
        for field in ("size", "capacity", "inserted_total", "sampled_total", "env_steps_total",
                      "priority_updates_total", "actors_seen", "actors_live",
                      "redis_used_memory_bytes", "total_priority"):
            setattr(out, field, sum(getattr(i, field) for i in infos))
        return out

    def close(self) -> None:
        for s in self.shards:
            s.close()

    def __enter__(self) -> "ShardedReplayClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect(addresses: str | list[str], *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
            ) -> ReplayClient | ShardedReplayClient:
    """A client of the replay shard(s) at ``addresses`` ("host:port", or a comma-separated
    list / a list with one address per shard, in shard order)."""
    if isinstance(addresses, str):
        addresses = [a.strip() for a in addresses.split(",") if a.strip()]
    if not addresses:
        raise errors.InvalidArgument("no replay address (set --replay or AMPRL_REPLAY_ADDRESS)")
    if len(addresses) == 1:
        return ReplayClient(addresses[0], max_message_bytes=max_message_bytes)
    return ShardedReplayClient(addresses, max_message_bytes=max_message_bytes)
