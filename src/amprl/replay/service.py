"""The gRPC boundary of the replay service: messages in, ``ReplayTable`` calls, messages out.

The servicer runs on a ``grpc.aio`` event loop (``amprl.common.aioserver``), because its
calls wait: inserts on the rate limiter, samples on the minimum size, streams on their
actors. A waiting call is a suspended coroutine, so a fleet of waiting actors holds no thread
that Sample, UpdatePriorities, Info or health need. The table's blocking work (encoding,
the Redis transaction, drawing and gathering a batch) runs on two small thread pools, one
for inserts and one for samples and priorities, so a burst of inserts never queues in
front of the learner.

Everything a client can open is bounded: insert streams (``replay.max_insert_streams``,
then RESOURCE_EXHAUSTED), the received chunks waiting to be stored
(``replay.max_pending_insert_bytes``, then streams stop reading), concurrent samples
(``MAX_CONCURRENT_SAMPLES``), a stream's silence (``replay.insert_idle_timeout_s``), a dead
peer's connection (keepalive), and the record of actor ids (``ActorRegistry``).

Errors raised below (``amprl.errors``) become canonical status codes in
``map_errors_async``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
from grpc_health.v1 import health_pb2

from amprl import errors
from amprl.common import grpcutil
from amprl.common.aioserver import AioServer
from amprl.config import ExperimentConfig, ReplayConfig
from amprl.envs.spec import EnvSpec
from amprl.replay.actors import LIVE_WINDOW_S, ActorRegistry
from amprl.replay.ratelimiter import RateLimiter
from amprl.replay.storage import ReplayStorage
from amprl.replay.table import ReplayTable, SampleResult, Sender
from amprl.v1 import replay_pb2, replay_pb2_grpc
from amprl.wire.tensors import tensor_from_proto, tensor_to_proto
from amprl.wire.transitions import InvalidChunk, check_chunks_values, chunk_from_proto

log = logging.getLogger(__name__)

# Insert groups (see ReplayServicer.Insert).
GROUP_MAX_TRANSITIONS = 4096
GROUP_MAX_BYTES = 8 * 1024 * 1024
GROUP_MAX_AGE_S = 0.05

MAX_CONCURRENT_SAMPLES = 256
"""Sample calls admitted at once (running or waiting on the limiter); beyond it
RESOURCE_EXHAUSTED. A learner keeps a handful in flight."""

REDIS_MEMORY_REFRESH_S = 1.0
"""Info's redis_used_memory_bytes is read from Redis this often, off the event loop."""

SERVICE_NAME = replay_pb2.DESCRIPTOR.services_by_name["ReplayService"].full_name


def _deadline(context) -> float | None:
    remaining = context.time_remaining()
    # grpc reports a huge number when the caller set no deadline
    return None if remaining is None or remaining > 1e7 else max(0.0, remaining)


def sample_response(r: SampleResult, spec: EnvSpec) -> replay_pb2.SampleResponse:
    """The SampleResponse carrying a drawn batch (frames raw, or lz4 blocks)."""
    resp = replay_pb2.SampleResponse(size=r.size)
    b = resp.batch
    if r.frames is not None:
        tensor_to_proto(r.frames, b.frames)
    else:
        tensor_to_proto(np.zeros((0, *spec.frame_shape), spec.frame_dtype), b.frames)
        b.frames.shape[0] = r.num_frames
        b.lz4_frames.extend(r.lz4_frames)
    tensor_to_proto(r.obs_idx, b.obs_frame_indices)
    tensor_to_proto(r.next_obs_idx, b.next_obs_frame_indices)
    tensor_to_proto(r.actions, b.actions)
    tensor_to_proto(r.rewards, b.rewards)
    tensor_to_proto(r.discounts, b.discounts)
    tensor_to_proto(r.keys, resp.keys)
    tensor_to_proto(r.weights, resp.weights)
    tensor_to_proto(r.probabilities, resp.probabilities)
    return resp


class ReplayServicer(replay_pb2_grpc.ReplayServiceServicer):
    """Serves one ReplayTable; every method runs on the server's event loop."""

    def __init__(self, table: ReplayTable, cfg: ReplayConfig, *,
                 live_window_s: float = LIVE_WINDOW_S):
        self.table = table
        self.spec = table.spec
        self.max_insert_streams = int(cfg.max_insert_streams)
        self.durability = cfg.durability
        self.max_pending_insert_bytes = int(cfg.max_pending_insert_bytes)
        self.pending_insert_bytes = 0
        """Frame bytes of received chunks not yet stored (groups being read or waiting)."""
        self._room = asyncio.Event()  # set whenever pending_insert_bytes went down
        self.idle_timeout_s = float(cfg.insert_idle_timeout_s)
        self.limiter = RateLimiter(samples_per_insert=cfg.samples_per_insert,
                                   min_size_to_sample=cfg.min_size_to_sample,
                                   error_buffer=cfg.samples_per_insert_error_buffer,
                                   size=lambda: table.size, inserted=table.inserted_total,
                                   sampled=table.sampled_total)
        self.actors = ActorRegistry(live_window_s)
        self.insert_streams = 0
        self.samples = 0
        self.redis_used_memory_bytes = 0
        self._insert_pool = ThreadPoolExecutor(2, thread_name_prefix="replay-insert")
        self._sample_pool = ThreadPoolExecutor(2, thread_name_prefix="replay-sample")
        self._info_pool = ThreadPoolExecutor(1, thread_name_prefix="replay-info")
        self._refresher: asyncio.Task | None = None
        self._redis_server: str | None = None  # Redis's run id when last seen
        self.health = None
        """The server's grpc.aio health servicer (set by create_server)."""
        self._ready = True

    # -- life cycle (on the loop) ---------------------------------------------------------

    async def start(self) -> None:
        """Starts the background refresh of Redis's memory figure."""
        await self._refresh_redis_memory()
        self._refresher = asyncio.create_task(self._refresh_loop())

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        for pool in (self._insert_pool, self._sample_pool, self._info_pool):
            pool.shutdown(wait=False, cancel_futures=True)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(REDIS_MEMORY_REFRESH_S)
            await self._refresh_redis_memory()

    async def _refresh_redis_memory(self) -> None:
        """Reads Redis's memory figure and its run id; a new run id means Redis restarted,
        possibly without its last writes, and the table is reconciled with what it holds."""
        storage = self.table.storage
        try:
            self.redis_used_memory_bytes = await self._run(self._info_pool, storage.used_memory)
            server = await self._run(self._info_pool, storage.server_id)
            if self._redis_server is not None and server != self._redis_server:
                log.warning("Redis restarted (run id %s, was %s): reconciling the index",
                            server, self._redis_server)
                # a restarted Redis reads its own configuration again
                await self._run(self._info_pool, storage.ensure_durability, self.durability)
                await self._run(self._insert_pool, self.table.reconcile)
                self.limiter.notify()
            self._redis_server = server
        except errors.Unavailable as exc:
            log.warning("cannot read Redis's state: %s", exc)
            await self._set_ready(False)
        else:
            await self._set_ready(True)

    async def _set_ready(self, ready: bool) -> None:
        """Health follows Redis: NOT_SERVING while replay cannot reach it (a readiness
        probe then takes the shard out of its Service), SERVING again once it can."""
        if self.health is None or ready == self._ready:
            return
        self._ready = ready
        if not ready:
            log.warning("health NOT_SERVING until Redis answers again")
        else:
            log.info("Redis answers again: health SERVING")
        status = (health_pb2.HealthCheckResponse.SERVING if ready
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in (SERVICE_NAME, ""):
            await self.health.set(name, status)

    @staticmethod
    async def _run(pool: ThreadPoolExecutor, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))

    # -- Insert ---------------------------------------------------------------------------

    @grpcutil.map_errors_async
    async def Insert(self, request_iterator, context):
        if self.insert_streams >= self.max_insert_streams:
            raise errors.ResourceExhausted(
                f"this replay shard already serves {self.insert_streams} insert streams "
                f"(replay.max_insert_streams = {self.max_insert_streams}); retry later, raise "
                f"replay.max_insert_streams or add replay shards")
        self.insert_streams += 1
        try:
            return await self._insert_stream(request_iterator, context)
        finally:
            self.insert_streams -= 1

    async def _insert_stream(self, request_iterator, context):
        # Chunks are validated as they arrive and written in groups: consecutive chunks of
        # the call become one stored chunk and one Redis transaction, which is what lets
        # small (CartPole) chunks reach hundreds of thousands of transitions per second.
        # A group is written when it reaches GROUP_MAX_TRANSITIONS or GROUP_MAX_BYTES,
        # GROUP_MAX_AGE_S after it began (whether or not more chunks come), before a bad
        # chunk is reported, and at the end of the call, always before the response.
        table = self.table
        # a group waiting for the rate limiter goes in whole once admitted: no larger than
        # the limiter's window, so the ratio never overshoots by more than that
        max_transitions = max(1, min(GROUP_MAX_TRANSITIONS, table.capacity // 16,
                                     self.limiter.max_insert or GROUP_MAX_TRANSITIONS))
        stored_chunks = stored = duplicates = 0
        group: list = []
        group_seqs: list[int] = []
        group_t = group_bytes = 0
        group_start = 0.0
        actor_id = ""
        incarnation = 0

        async def flush() -> None:
            # Value checks run here, over the whole group at once; a bad chunk still stores
            # the chunks before it and nothing of itself.
            nonlocal stored_chunks, stored, duplicates, group, group_seqs, group_t, group_bytes
            nonlocal received
            if not group:
                return
            items, seqs, t, nbytes = group, group_seqs, group_t, group_bytes
            group, group_seqs, group_t, group_bytes = [], [], 0, 0
            try:
                bad = await self._run(self._insert_pool, self._check_group, items)
                good = items if bad is None else items[:bad[0]]
                if good:
                    n = t if bad is None else sum(len(c) for c, _, _ in good)
                    gone = False
                    async with self.limiter.insert(n, _deadline(context),
                                                   continuing=stored_chunks > 0):
                        # Once admitted, the group is stored even if the caller goes away
                        # (the worker thread cannot be stopped), and counted as stored.
                        sender = Sender(actor_id, incarnation, seqs[:len(good)])
                        work = asyncio.ensure_future(
                            self._run(self._insert_pool, table.insert_many, good, sender))
                        try:
                            result = await asyncio.shield(work)
                        except asyncio.CancelledError:
                            gone = True
                            result = await work
                    self.actors.saw(actor_id)
                    stored_chunks += len(good)  # a resent chunk stored before counts too
                    stored += n
                    duplicates += result.duplicate_chunks
                    if gone:
                        raise asyncio.CancelledError
            finally:
                self._release(nbytes)
            if bad is not None:
                received = stored_chunks  # the bad chunk's index in the call
                raise bad[1]

        received = 0  # chunks read so far
        requests = request_iterator.__aiter__()
        # One read is kept pending across waits: a group that ages out is flushed while the
        # read goes on (cancelling a read would lose the stream's place).
        read: asyncio.Future | None = None
        waiting_since = time.monotonic()  # for a chunk from the client, since then
        try:
            while True:
                if read is None:
                    if self.pending_insert_bytes >= self.max_pending_insert_bytes:
                        # Replay holds as many received chunks as it may: hand this stream's
                        # group to the limiter and read nothing more (HTTP/2 flow control
                        # then holds the actor back) until stored chunks make room.
                        await flush()
                        await self._room_for_chunks()
                        waiting_since = time.monotonic()
                    read = asyncio.ensure_future(anext(requests))
                # Wait for the next chunk no longer than the stream may idle, and, while a
                # group is open, no longer than the group may age.
                wait = max(0.0, waiting_since + self.idle_timeout_s - time.monotonic())
                if group:
                    wait = min(wait, max(0.0, group_start + GROUP_MAX_AGE_S - time.monotonic()))
                done, _ = await asyncio.wait((read,), timeout=wait)
                if not done:
                    if group:
                        await flush()
                        waiting_since = time.monotonic()
                        continue
                    raise errors.DeadlineExceeded(
                        f"insert stream sent no chunk for {self.idle_timeout_s:g}s "
                        f"(replay.insert_idle_timeout_s); {stored_chunks} chunks of this call "
                        f"are stored; send chunks or end the stream")
                try:
                    request = read.result()
                except StopAsyncIteration:
                    break
                finally:
                    read = None
                waiting_since = time.monotonic()
                try:
                    chunk = chunk_from_proto(request.chunk, self.spec, check_values=False)
                    priorities = table.check_chunk(
                        chunk, tensor_from_proto(request.priorities, "priorities",
                                                 dtype=np.float32, ndim=1), values=False)
                except errors.AmprlError:
                    await flush()
                    raise
                received += 1
                if group and (request.actor_id != actor_id or request.incarnation != incarnation
                              or group_t + len(chunk) > max_transitions
                              or group_bytes + chunk.frames.nbytes > GROUP_MAX_BYTES
                              or time.monotonic() - group_start > GROUP_MAX_AGE_S):
                    await flush()
                if not group:
                    group_start = time.monotonic()
                actor_id, incarnation = request.actor_id, request.incarnation
                group.append((chunk, priorities, request.env_steps))
                group_seqs.append(request.sequence)
                group_t += len(chunk)
                group_bytes += chunk.frames.nbytes
                self.pending_insert_bytes += chunk.frames.nbytes
            await flush()
        except errors.AmprlError as exc:
            exc.args = (f"{exc} (chunk {received} of this call; {stored_chunks} chunks, "
                        f"{stored} transitions of this call are stored)",)
            raise
        finally:
            if read is not None:
                read.cancel()
            self._release(group_bytes)  # a group the call ended with, unstored
        return replay_pb2.InsertResponse(chunks_stored=stored_chunks, transitions_stored=stored,
                                         size=table.size, chunks_duplicate=duplicates)

    def _release(self, nbytes: int) -> None:
        """Received chunks of ``nbytes`` left memory (stored, refused or dropped)."""
        if nbytes:
            self.pending_insert_bytes -= nbytes
            self._room.set()

    async def _room_for_chunks(self) -> None:
        while self.pending_insert_bytes >= self.max_pending_insert_bytes:
            self._room.clear()
            await self._room.wait()

    def _check_group(self, group: list) -> tuple[int, errors.InvalidArgument] | None:
        """(index of the first bad chunk, its error) or None (a worker thread)."""
        bad: tuple[int, errors.InvalidArgument] | None = None
        try:
            check_chunks_values([c for c, _, _ in group], self.spec)
        except InvalidChunk as exc:
            bad = (exc.index, errors.InvalidArgument(str(exc)))
        bad_p = self.table.check_values([(c, p) for c, p, _ in group])
        if bad_p is not None and (bad is None or bad_p[0] < bad[0]):
            bad = bad_p
        return bad

    # -- Sample, UpdatePriorities, Info ---------------------------------------------------

    @grpcutil.map_errors_async
    async def Sample(self, request, context):
        batch_size, beta = int(request.batch_size), float(request.beta)
        self.table.check_sample(batch_size, beta)
        if self.samples >= MAX_CONCURRENT_SAMPLES:
            raise errors.ResourceExhausted(
                f"{self.samples} Sample calls are already open on this replay shard (the limit "
                f"is {MAX_CONCURRENT_SAMPLES}); keep fewer calls in flight")
        self.samples += 1
        try:
            async with self.limiter.sample(batch_size, _deadline(context)):
                return await self._run(self._sample_pool, self._draw, batch_size, beta)
        finally:
            self.samples -= 1

    def _draw(self, batch_size: int, beta: float) -> replay_pb2.SampleResponse:
        return sample_response(self.table.sample(batch_size, beta), self.spec)

    @grpcutil.map_errors_async
    async def UpdatePriorities(self, request, context):
        keys = tensor_from_proto(request.keys, "keys", dtype=np.int64, ndim=1)
        priorities = tensor_from_proto(request.priorities, "priorities", dtype=np.float32, ndim=1)
        if keys.shape != priorities.shape:
            raise errors.InvalidArgument(f"priorities: {priorities.shape[0]} values for "
                                         f"{keys.shape[0]} keys")
        updated, evicted = await self._run(self._sample_pool, self.table.update_priorities,
                                           keys, priorities)
        return replay_pb2.UpdatePrioritiesResponse(updated=updated, evicted=evicted)

    @grpcutil.map_errors_async
    async def Info(self, request, context):
        i = self.table.info()
        lim = self.limiter
        return replay_pb2.ReplayServiceInfoResponse(
            size=i["size"], capacity=i["capacity"], inserted_total=i["inserted_total"],
            sampled_total=i["sampled_total"], env_steps_total=i["env_steps_total"],
            priority_updates_total=i["priority_updates_total"],
            rate_limiter=replay_pb2.RateLimiterInfo(
                samples_per_insert=lim.samples_per_insert, error_buffer=lim.error_buffer,
                min_size_to_sample=lim.min_size_to_sample,
                waiting_samples=lim.waiting_samples, waiting_inserts=lim.waiting_inserts,
                sample_wait_seconds=lim.sample_wait_seconds,
                insert_wait_seconds=lim.insert_wait_seconds),
            actors_seen=self.actors.seen, actors_live=self.actors.live(),
            live_window_seconds=self.actors.live_window_s,
            redis_used_memory_bytes=self.redis_used_memory_bytes,
            total_priority=i["total_priority"], insert_streams=self.insert_streams,
            pending_insert_bytes=self.pending_insert_bytes, missing_transitions=i["missing"])


class ReplayServer(NamedTuple):
    """A started replay server and what it serves."""

    server: AioServer
    port: int
    table: ReplayTable
    servicer: ReplayServicer

    def stop(self, grace_s: float | None = 1.0) -> None:
        """Stops serving (open calls get ``grace_s``), then closes the table's Redis client."""
        try:
            self.server.stop(grace_s)
        finally:
            self.table.storage.close()


def create_server(cfg: ExperimentConfig, spec: EnvSpec, redis_url: str, host: str = "0.0.0.0",
                  port: int = 0, *,
                  max_message_bytes: int = grpcutil.DEFAULT_MAX_MESSAGE_BYTES,
                  prefix: str = "amprl:replay:default",
                  seed: int | None = None,
                  live_window_s: float = LIVE_WINDOW_S) -> ReplayServer:
    """Opens (or rebuilds) the table in Redis at ``redis_url`` and starts serving it.

    ``live_window_s``: an actor counts as live in Info if it inserted within this many
    seconds.
    """
    storage = ReplayStorage.from_url(redis_url, prefix)
    try:
        storage.ensure_durability(cfg.replay.durability)
        table = ReplayTable(storage, spec, cfg.replay, seed=seed)
    except BaseException:
        storage.close()
        raise
    try:
        servicer = ReplayServicer(table, cfg.replay, live_window_s=live_window_s)
        server = AioServer.start(
            [(replay_pb2_grpc.add_ReplayServiceServicer_to_server, servicer, SERVICE_NAME)],
            host=host, port=port, max_message_bytes=max_message_bytes,
            keepalive_s=cfg.replay.keepalive_s, on_stop=[servicer.close])
        servicer.health = server.health
        try:
            server.call(servicer.start())
        except BaseException:
            server.stop(0)
            raise
    except BaseException:
        table.storage.close()
        raise
    log.info("replay serving on %s:%d (capacity %d, %s frames, size %d)", host, server.port,
             table.capacity, table.compression, table.size)
    return ReplayServer(server, server.port, table, servicer)
