"""The gRPC boundary of the replay service: messages in, ``ReplayTable`` calls, messages out.

Errors raised below (``amprl.errors``) become canonical status codes in ``map_errors``.
"""

from __future__ import annotations

import logging
import time

import grpc
import numpy as np

from amprl import errors
from amprl.common import grpcutil
from amprl.config import ExperimentConfig
from amprl.envs.spec import EnvSpec
from amprl.replay.storage import ReplayStorage
from amprl.replay.table import ReplayTable
from amprl.v1 import replay_pb2, replay_pb2_grpc
from amprl.wire.tensors import tensor_from_proto, tensor_to_proto
from amprl.wire.transitions import InvalidChunk, check_chunks_values, chunk_from_proto

log = logging.getLogger(__name__)

# Insert groups (see ReplayServicer.Insert).
GROUP_MAX_TRANSITIONS = 4096
GROUP_MAX_BYTES = 8 * 1024 * 1024
GROUP_MAX_AGE_S = 0.05

SERVICE_NAME = replay_pb2.DESCRIPTOR.services_by_name["ReplayService"].full_name


def _deadline(context: grpc.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    # grpc reports a huge number when the caller set no deadline
    return None if remaining is None or remaining > 1e7 else max(0.0, remaining)


class ReplayServicer(replay_pb2_grpc.ReplayServiceServicer):
    def __init__(self, table: ReplayTable):
        self.table = table
        self.spec = table.spec

    @grpcutil.map_errors
    def Insert(self, request_iterator, context):
        # Chunks are validated as they arrive and written in groups: consecutive chunks of
        # the call become one stored chunk and one Redis transaction, which is what lets
        # small (CartPole) chunks reach hundreds of thousands of transitions per second.
        # A group is written when it reaches GROUP_MAX_TRANSITIONS or GROUP_MAX_BYTES, when
        # a chunk arrives GROUP_MAX_AGE_S after the group began, before a bad chunk is
        # reported, and at the end of the call, always before the response.
        table = self.table
        max_transitions = max(1, min(GROUP_MAX_TRANSITIONS, table.capacity // 16))
        cancelled = lambda: not context.is_active()  # noqa: E731
        stored_chunks = stored = 0
        group: list = []
        group_t = group_bytes = 0
        group_start = 0.0
        actor_id = ""

        def flush() -> None:
            # Value checks run here, over the whole group at once; a bad chunk still stores
            # the chunks before it and nothing of itself.
            nonlocal stored_chunks, stored, group, group_t, group_bytes, received
            if not group:
                return
            bad: tuple[int, errors.InvalidArgument] | None = None
            try:
                check_chunks_values([c for c, _, _ in group], self.spec)
            except InvalidChunk as exc:
                bad = (exc.index, errors.InvalidArgument(str(exc)))
            bad_p = table.check_priorities([p for _, p, _ in group])
            if bad_p is not None and (bad is None or bad_p[0] < bad[0]):
                bad = bad_p
            good = group if bad is None else group[:bad[0]]
            if good:
                table.insert_many(actor_id, good, timeout=_deadline(context), cancelled=cancelled)
                stored_chunks += len(good)
                stored += sum(len(c) for c, _, _ in good)
            group, group_t, group_bytes = [], 0, 0
            if bad is not None:
                received = stored_chunks  # the bad chunk's index in the call
                raise bad[1]

        received = 0  # chunks read so far
        try:
            for request in request_iterator:
                try:
                    chunk = chunk_from_proto(request.chunk, self.spec, check_values=False)
                    priorities = table.check_chunk(
                        chunk, tensor_from_proto(request.priorities, "priorities",
                                                 dtype=np.float32, ndim=1), values=False)
                except errors.AmprlError:
                    flush()
                    raise
                received += 1
                if group and (request.actor_id != actor_id
                              or group_t + len(chunk) > max_transitions
                              or group_bytes + chunk.frames.nbytes > GROUP_MAX_BYTES
                              or time.monotonic() - group_start > GROUP_MAX_AGE_S):
                    flush()
                if not group:
                    group_start = time.monotonic()
                actor_id = request.actor_id
                group.append((chunk, priorities, request.env_steps))
                group_t += len(chunk)
                group_bytes += chunk.frames.nbytes
            flush()
        except errors.AmprlError as exc:
            exc.args = (f"{exc} (chunk {received} of this call; {stored_chunks} chunks, "
                        f"{stored} transitions of this call are stored)",)
            raise
        return replay_pb2.InsertResponse(chunks_stored=stored_chunks, transitions_stored=stored,
                                         size=table.size)

    @grpcutil.map_errors
    def Sample(self, request, context):
        r = self.table.sample(int(request.batch_size), float(request.beta),
                              timeout=_deadline(context),
                              cancelled=lambda: not context.is_active())
        resp = replay_pb2.SampleResponse(size=r.size)
        b = resp.batch
        if r.frames is not None:
            tensor_to_proto(r.frames, b.frames)
        else:
            tensor_to_proto(np.zeros((0, *self.spec.frame_shape), self.spec.frame_dtype), b.frames)
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

    @grpcutil.map_errors
    def UpdatePriorities(self, request, context):
        keys = tensor_from_proto(request.keys, "keys", dtype=np.int64, ndim=1)
        priorities = tensor_from_proto(request.priorities, "priorities", dtype=np.float32, ndim=1)
        if keys.shape != priorities.shape:
            raise errors.InvalidArgument(f"priorities: {priorities.shape[0]} values for "
                                         f"{keys.shape[0]} keys")
        updated, evicted = self.table.update_priorities(keys, priorities)
        return replay_pb2.UpdatePrioritiesResponse(updated=updated, evicted=evicted)

    @grpcutil.map_errors
    def Info(self, request, context):
        i = self.table.info()
        lim = i["rate_limiter"]
        return replay_pb2.ReplayServiceInfoResponse(
            size=i["size"], capacity=i["capacity"], inserted_total=i["inserted_total"],
            sampled_total=i["sampled_total"], env_steps_total=i["env_steps_total"],
            priority_updates_total=i["priority_updates_total"],
            rate_limiter=replay_pb2.RateLimiterInfo(**lim),
            actors_seen=i["actors_seen"], actors_live=i["actors_live"],
            live_window_seconds=i["live_window_seconds"],
            redis_used_memory_bytes=self.table.storage.used_memory(),
            total_priority=i["total_priority"])


def create_server(cfg: ExperimentConfig, spec: EnvSpec, redis_url: str, host: str = "0.0.0.0",
                  port: int = 0, *, max_workers: int = 16,
                  max_message_bytes: int = grpcutil.DEFAULT_MAX_MESSAGE_BYTES,
                  prefix: str = "amprl:replay:default",
                  seed: int | None = None,
                  live_window_s: float | None = None) -> tuple[grpc.Server, int, ReplayTable]:
    """Opens (or rebuilds) the table in Redis at ``redis_url`` and starts serving it.

    ``live_window_s`` (default ``table.LIVE_WINDOW_S``): an actor counts as live in Info if
    it inserted within this many seconds. Returns the started server, the bound port and
    the table.
    """
    extra = {} if live_window_s is None else {"live_window_s": live_window_s}
    table = ReplayTable(ReplayStorage.from_url(redis_url, prefix), spec, cfg.replay, seed=seed,
                        **extra)
    servicer = ReplayServicer(table)
    server, bound = grpcutil.create_server(
        [(replay_pb2_grpc.add_ReplayServiceServicer_to_server, servicer, SERVICE_NAME)],
        host=host, port=port, max_workers=max_workers, max_message_bytes=max_message_bytes)
    log.info("replay serving on %s:%d (capacity %d, %s frames, size %d)", host, bound,
             table.capacity, table.compression, table.size)
    return server, bound, table
