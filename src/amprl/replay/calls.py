"""What a replay call does at the gRPC boundary besides serving: reading its request into
the table's values (and checking them), building its response from the table's results,
reading its deadline, and running its blocking work on a worker pool.

Plain functions, so that the servicer (``service.py``) and the Insert streams
(``insert_stream.py``) read and check messages the same way.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from amprl import errors
from amprl.common.inbound import check_id
from amprl.envs.spec import EnvSpec
from amprl.replay.table import ReplayTable, SampleResult
from amprl.rl.transitions import Chunk
from amprl.v1 import replay_pb2
from amprl.wire.tensors import tensor_from_proto, tensor_to_proto
from amprl.wire.transitions import InvalidChunk, check_chunks_values, chunk_from_proto


def deadline(context) -> float | None:
    """Seconds the call has left, or None when the caller set no deadline."""
    remaining = context.time_remaining()
    # grpc reports a huge number when the caller set no deadline
    return None if remaining is None or remaining > 1e7 else max(0.0, remaining)


async def run_in(pool: ThreadPoolExecutor, fn, *args):
    """``fn(*args)`` on ``pool``, awaited without holding the event loop."""
    return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))


def read_insert(request: replay_pb2.InsertRequest, table: ReplayTable) -> tuple[Chunk, np.ndarray]:
    """An InsertRequest's chunk and priorities, their shapes and sizes checked (their
    values are checked per group, ``check_group``) and its actor_id's length."""
    check_id("actor_id", request.actor_id)
    chunk = chunk_from_proto(request.chunk, table.spec, check_values=False)
    priorities = table.check_chunk(
        chunk, tensor_from_proto(request.priorities, "priorities",
                                 dtype=np.float32, ndim=1), values=False)
    return chunk, priorities


def check_group(group: list, table: ReplayTable) -> tuple[int, errors.InvalidArgument] | None:
    """(index of the first bad chunk, its error) or None (a worker thread)."""
    bad: tuple[int, errors.InvalidArgument] | None = None
    try:
        check_chunks_values([c for c, _, _ in group], table.spec)
    except InvalidChunk as exc:
        bad = (exc.index, errors.InvalidArgument(str(exc)))
    bad_p = table.check_values([(c, p) for c, p, _ in group])
    if bad_p is not None and (bad is None or bad_p[0] < bad[0]):
        bad = bad_p
    return bad


def read_priority_update(request: replay_pb2.UpdatePrioritiesRequest) -> tuple[np.ndarray, np.ndarray]:
    """An UpdatePrioritiesRequest's keys (int64 [K]) and priorities (float32 [K])."""
    keys = tensor_from_proto(request.keys, "keys", dtype=np.int64, ndim=1)
    priorities = tensor_from_proto(request.priorities, "priorities", dtype=np.float32, ndim=1)
    if keys.shape != priorities.shape:
        raise errors.InvalidArgument(f"priorities: {priorities.shape[0]} values for "
                                     f"{keys.shape[0]} keys")
    return keys, priorities


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
