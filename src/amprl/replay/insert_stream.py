"""The Insert RPC's streams: chunks read, checked, grouped and stored, within the bounds a
replay shard sets on what clients can open.

``InsertStreams`` serves each Insert call for the servicer (``service.py``), which counts on
it for Info's ``insert_streams`` and ``pending_insert_bytes``. It is its own module because
reading a stream (groups that age out, back-pressure on received bytes, an idle stream's
timeout, a bad chunk's report) is the servicer's one long piece of logic; the other RPCs
are a few lines each.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from amprl import errors
from amprl.config import ReplayConfig
from amprl.replay.actors import ActorRegistry
from amprl.replay.calls import check_group, deadline, read_insert, run_in
from amprl.replay.insert import Sender
from amprl.replay.ratelimiter import RateLimiter
from amprl.replay.table import ReplayTable
from amprl.v1 import replay_pb2

# Insert groups (see InsertStreams._stream).
GROUP_MAX_TRANSITIONS = 4096
GROUP_MAX_BYTES = 8 * 1024 * 1024
GROUP_MAX_AGE_S = 0.05



class InsertStreams:
    """The open Insert streams of one replay shard and the received chunks they hold."""

    def __init__(self, table: ReplayTable, cfg: ReplayConfig, limiter: RateLimiter,
                 actors: ActorRegistry, pool: ThreadPoolExecutor):
        self.table = table
        self.spec = table.spec
        self.limiter = limiter
        self.actors = actors
        self.pool = pool
        """The worker threads that check and store groups (one Redis writer at a time)."""
        self.max_insert_streams = int(cfg.max_insert_streams)
        self.max_pending_insert_bytes = int(cfg.max_pending_insert_bytes)
        self.pending_insert_bytes = 0
        """Frame bytes of received chunks not yet stored (groups being read or waiting)."""
        self._room = asyncio.Event()  # set whenever pending_insert_bytes went down
        self.idle_timeout_s = float(cfg.insert_idle_timeout_s)
        self.streams = 0
        """Insert calls open now."""

    async def serve(self, request_iterator, context) -> replay_pb2.InsertResponse:
        """One Insert call, refused with RESOURCE_EXHAUSTED beyond replay.max_insert_streams."""
        if self.streams >= self.max_insert_streams:
            raise errors.ResourceExhausted(
                f"this replay shard already serves {self.streams} insert streams "
                f"(replay.max_insert_streams = {self.max_insert_streams}); retry later, raise "
                f"replay.max_insert_streams or add replay shards")
        self.streams += 1
        try:
            return await self._stream(request_iterator, context)
        finally:
            self.streams -= 1

    async def _stream(self, request_iterator, context):
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
        received = 0  # chunks read so far

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
                bad = await run_in(self.pool, check_group, items, table)
                good = items if bad is None else items[:bad[0]]
                if good:
                    n = t if bad is None else sum(len(c) for c, _, _ in good)
                    gone = False
                    async with self.limiter.insert(n, deadline(context),
                                                   continuing=stored_chunks > 0):
                        # Once admitted, the group is stored even if the caller goes away
                        # (the worker thread cannot be stopped), and counted as stored.
                        sender = Sender(actor_id, incarnation, seqs[:len(good)])
                        work = asyncio.ensure_future(
                            run_in(self.pool, table.insert_many, good, sender))
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
                except errors.InvalidArgument:  # bytes that do not parse (common.inbound)
                    await flush()  # the chunks before it are kept, as before any bad chunk
                    raise
                finally:
                    read = None
                waiting_since = time.monotonic()
                try:
                    chunk, priorities = read_insert(request, table)
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

