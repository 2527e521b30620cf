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

The Insert streams are read, grouped and stored in ``insert_stream.py``; requests and
responses are read and built in ``calls.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from amprl import errors
from amprl.common import grpcutil
from amprl.common.aioserver import AioServer
from amprl.common.redis_acl import REPLAY_PREFIX
from amprl.config import ExperimentConfig, ReplayConfig
from amprl.envs.spec import EnvSpec
from amprl.replay.actors import LIVE_WINDOW_S, ActorRegistry
from amprl.replay.calls import deadline, read_priority_update, run_in, sample_response
from amprl.replay.insert_stream import InsertStreams
from amprl.replay.ratelimiter import RateLimiter
from amprl.replay.storage import ReplayStorage
from amprl.replay.table import ReplayTable
from amprl.v1 import replay_pb2, replay_pb2_grpc

log = logging.getLogger(__name__)

MAX_CONCURRENT_SAMPLES = 256
"""Sample calls admitted at once (running or waiting on the limiter); beyond it
RESOURCE_EXHAUSTED. A learner keeps a handful in flight."""

REDIS_MEMORY_REFRESH_S = 1.0
"""Info's redis_used_memory_bytes is read from Redis this often, off the event loop."""

SERVICE_NAME = replay_pb2.DESCRIPTOR.services_by_name["ReplayService"].full_name


class ReplayServicer(replay_pb2_grpc.ReplayServiceServicer):
    """Serves one ReplayTable; every method runs on the server's event loop."""

    def __init__(self, table: ReplayTable, cfg: ReplayConfig, *,
                 live_window_s: float = LIVE_WINDOW_S):
        self.table = table
        self.spec = table.spec
        self.durability = cfg.durability
        self.limiter = RateLimiter(samples_per_insert=cfg.samples_per_insert,
                                   min_size_to_sample=cfg.min_size_to_sample,
                                   error_buffer=cfg.samples_per_insert_error_buffer,
                                   size=lambda: table.size, inserted=table.inserted_total,
                                   sampled=table.sampled_total)
        self.actors = ActorRegistry(live_window_s)
        self.samples = 0
        self.redis_used_memory_bytes = 0
        self._insert_pool = ThreadPoolExecutor(2, thread_name_prefix="replay-insert")
        self.inserts = InsertStreams(table, cfg, self.limiter, self.actors, self._insert_pool)
        self._sample_pool = ThreadPoolExecutor(2, thread_name_prefix="replay-sample")
        self._info_pool = ThreadPoolExecutor(1, thread_name_prefix="replay-info")
        self._refresher: asyncio.Task | None = None
        self._redis_server: str | None = None  # Redis's run id when last seen
        self.health: health_aio.HealthServicer | None = None
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
            self.redis_used_memory_bytes = await run_in(self._info_pool, storage.used_memory)
            server = await run_in(self._info_pool, storage.server_id)
            if self._redis_server is not None and server != self._redis_server:
                log.warning("Redis restarted (run id %s, was %s): reconciling the index",
                            server, self._redis_server)
                # a restarted Redis reads its own configuration again
                await run_in(self._info_pool, storage.ensure_durability, self.durability)
                await run_in(self._insert_pool, self.table.reconcile)
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

    # -- Insert, Sample, UpdatePriorities, Info -------------------------------------------

    @grpcutil.map_errors_async
    async def Insert(self, request_iterator, context):
        return await self.inserts.serve(request_iterator, context)

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
            async with self.limiter.sample(batch_size, deadline(context)):
                return await run_in(self._sample_pool, self._draw, batch_size, beta)
        finally:
            self.samples -= 1

    def _draw(self, batch_size: int, beta: float) -> replay_pb2.SampleResponse:
        return sample_response(self.table.sample(batch_size, beta), self.spec)

    @grpcutil.map_errors_async
    async def UpdatePriorities(self, request, context):
        keys, priorities = read_priority_update(request)
        updated, evicted = await run_in(self._sample_pool, self.table.update_priorities,
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
            total_priority=i["total_priority"], insert_streams=self.inserts.streams,
            pending_insert_bytes=self.inserts.pending_insert_bytes,
            missing_transitions=i["missing"])


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
                  prefix: str = REPLAY_PREFIX,
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
