"""A thin typed client of ``amprl.v1.ReplayService``; methods mirror the RPCs.

    client = ReplayClient("localhost:7000")
    client.insert("actor-0", [(chunk, priorities, env_steps), ...])
    batch = client.sample(256, beta=0.4)
    client.update_priorities(batch.keys, new_priorities)

Failures arrive as ``amprl.errors`` (InvalidArgument, ResourceExhausted, DeadlineExceeded,
Unavailable, ...). Nothing is retried automatically: an Insert that failed mid-stream
reports what was stored, and only the caller knows whether to resend the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import grpc
import lz4.block
import numpy as np

from amprl.common.grpcutil import DEFAULT_MAX_MESSAGE_BYTES, make_channel, raise_for_rpc_error
from amprl.v1 import replay_pb2, replay_pb2_grpc
from amprl.wire.tensors import DTYPES, tensor_from_proto, tensor_to_proto
from amprl.wire.transitions import Chunk, chunk_to_proto


@dataclass
class SampledBatch:
    """A prioritized batch with observations rebuilt (NumPy)."""

    obs: np.ndarray
    """[B, *obs_shape]: [B, *frame_shape] when frame_stack == 1, else [B, stack, *frame_shape]."""
    next_obs: np.ndarray
    """Same layout as obs: the n-step next observations."""
    actions: np.ndarray
    """int64 [B] or float32 [B, action_dim]."""
    rewards: np.ndarray
    """float32 [B]: n-step returns."""
    discounts: np.ndarray
    """float32 [B]: gamma^n, or 0 at termination."""
    keys: np.ndarray
    """int64 [B]: pass back to update_priorities."""
    weights: np.ndarray
    """float32 [B]: importance weights (N P(i))^-beta / max_j w_j."""
    probabilities: np.ndarray
    """float32 [B]: P(i)."""
    size: int
    """Transitions in the table when the batch was drawn."""

    def __len__(self) -> int:
        return int(self.keys.shape[0])


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
                   env_steps: int = 0) -> replay_pb2.InsertRequest:
    req = replay_pb2.InsertRequest(actor_id=actor_id, env_steps=int(env_steps))
    chunk_to_proto(chunk, req.chunk)
    tensor_to_proto(np.asarray(priorities, dtype=np.float32), req.priorities)
    return req


class ReplayClient:
    """Client of one replay service at ``address`` ("host:port")."""

    def __init__(self, address: str, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
        self.address = address
        self._channel = make_channel(address, max_message_bytes=max_message_bytes)
        self._stub = replay_pb2_grpc.ReplayServiceStub(self._channel)

    def insert(self, actor_id: str,
               items: Iterable[tuple[Chunk, np.ndarray, int]],
               timeout: float | None = None) -> replay_pb2.InsertResponse:
        """Streams ``(chunk, priorities float32 [T], env_steps)`` items as one Insert call;
        returns once every chunk is stored (the response counts them)."""
        def requests() -> Iterator[replay_pb2.InsertRequest]:
            for chunk, priorities, env_steps in items:
                yield insert_request(actor_id, chunk, priorities, env_steps)
        return self.insert_requests(requests(), timeout=timeout)

    def insert_requests(self, requests: Iterable[replay_pb2.InsertRequest],
                        timeout: float | None = None) -> replay_pb2.InsertResponse:
        """Insert with prebuilt requests (see ``insert_request``)."""
        try:
            return self._stub.Insert(iter(requests), timeout=timeout)
        except grpc.RpcError as exc:
            raise_for_rpc_error(exc)
            raise

    def sample(self, batch_size: int, beta: float,
               timeout: float | None = None) -> SampledBatch:
        """Draws a prioritized batch; waits (up to ``timeout``) for the min size / rate."""
        return sampled_batch_from_proto(self.sample_raw(batch_size, beta, timeout))

    def sample_raw(self, batch_size: int, beta: float,
                   timeout: float | None = None) -> replay_pb2.SampleResponse:
        try:
            return self._stub.Sample(replay_pb2.SampleRequest(batch_size=batch_size, beta=beta),
                                     timeout=timeout)
        except grpc.RpcError as exc:
            raise_for_rpc_error(exc)
            raise

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
        try:
            return self._stub.UpdatePriorities(req, timeout=timeout)
        except grpc.RpcError as exc:
            raise_for_rpc_error(exc)
            raise

    def info(self, timeout: float | None = None) -> replay_pb2.ReplayServiceInfoResponse:
        try:
            return self._stub.Info(replay_pb2.ReplayServiceInfoRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            raise_for_rpc_error(exc)
            raise

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "ReplayClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
