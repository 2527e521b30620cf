"""Each bad request gets its canonical status, stores nothing, and the service goes on."""

import grpc
import numpy as np
import pytest

from amprl import errors
from amprl.replay.client import insert_request
from amprl_testing.replay import atari_spec, make_chunk, vector_spec
from amprl.v1 import replay_pb2
from amprl.wire.tensors import tensor_to_proto

T = 8


def good(seed=0):
    return insert_request("actor-0", make_chunk(vector_spec(), T, seed=seed), np.ones(T, np.float32), T)


def status(exc_info) -> grpc.StatusCode:
    return exc_info.value.__cause__.code()


def mutated(fn):
    req = good()
    fn(req)
    return req


INSERT_CASES = {
    "rewards shorter than T": (lambda r: tensor_to_proto(np.zeros(T - 1, np.float32), r.chunk.rewards), "chunk.rewards"),
    "discounts longer than T": (lambda r: tensor_to_proto(np.ones(T + 1, np.float32), r.chunk.discounts), "chunk.discounts"),
    "actions shorter than T": (lambda r: tensor_to_proto(np.zeros(T - 2, np.int64), r.chunk.actions), "chunk.actions"),
    "priorities shorter than T": (lambda r: tensor_to_proto(np.ones(T - 1, np.float32), r.priorities), "priorities"),
    "frame shape != spec": (lambda r: tensor_to_proto(np.zeros((12, 5), np.float32), r.chunk.frames), r"\[F, 4\]"),
    "frame dtype != spec": (lambda r: tensor_to_proto(np.zeros((12, 4), np.uint8), r.chunk.frames), "chunk.frames: dtype"),
    "stack != spec": (lambda r: tensor_to_proto(np.zeros((T, 4), np.int32), r.chunk.obs_frame_indices), r"\[T, 1\]"),
    "frame index out of range": (lambda r: tensor_to_proto(np.full((T, 1), 99, np.int32), r.chunk.next_obs_frame_indices), "outside"),
    "action dtype != spec": (lambda r: tensor_to_proto(np.zeros(T, np.float32), r.chunk.actions), "chunk.actions: dtype"),
    "NaN priority": (lambda r: tensor_to_proto(np.r_[np.ones(T - 1), np.nan].astype(np.float32), r.priorities), "NaN"),
    "infinite priority": (lambda r: tensor_to_proto(np.r_[np.ones(T - 1), np.inf].astype(np.float32), r.priorities), "infinite"),
    "negative priority": (lambda r: tensor_to_proto(np.r_[np.ones(T - 1), -1].astype(np.float32), r.priorities), "<= 0"),
    "float64 priorities": (lambda r: tensor_to_proto(np.ones(T, np.float64), r.priorities), "priorities: dtype"),
    "NaN reward": (lambda r: tensor_to_proto(np.full(T, np.nan, np.float32), r.chunk.rewards), "chunk.rewards"),
    # finite but beyond the configured bounds (replay.max_abs_reward, replay.max_priority: 1e6)
    "absurd reward": (lambda r: tensor_to_proto(np.r_[np.ones(T - 1), -1e20].astype(np.float32), r.chunk.rewards),
                      r"\|reward\| 1e\+20 above replay.max_abs_reward"),
    "absurd priority": (lambda r: tensor_to_proto(np.r_[np.ones(T - 1), 3e38].astype(np.float32), r.priorities),
                        "above replay.max_priority"),
}


@pytest.mark.parametrize("case", list(INSERT_CASES))
def test_bad_insert_is_invalid_argument_and_stores_nothing(replay, case):
    r = replay(vector_spec(), capacity=1000)
    r.client.insert_requests([good()])
    mutate, message = INSERT_CASES[case]
    with pytest.raises(errors.InvalidArgument, match=message) as exc:
        r.client.insert_requests([mutated(mutate)])
    assert status(exc) == grpc.StatusCode.INVALID_ARGUMENT
    assert r.client.info().size == T
    assert r.table.storage.load_counters()["next_key"] == T  # nothing reached Redis
    assert r.client.insert_requests([good(1)]).transitions_stored == T  # still serving


def test_bad_chunk_mid_stream_keeps_the_chunks_before_it(replay):
    r = replay(vector_spec(), capacity=1000)
    bad = mutated(lambda q: tensor_to_proto(np.zeros(1, np.float32), q.chunk.rewards))
    with pytest.raises(errors.InvalidArgument, match=r"chunk 2 of this call; 2 chunks, 16 transitions"):
        r.client.insert_requests([good(0), good(1), bad, good(2)])
    assert r.client.info().size == 2 * T


def test_atari_shape_mismatch(replay):
    r = replay(atari_spec(84), capacity=100)
    req = insert_request("a", make_chunk(atari_spec(64), 4), np.ones(4, np.float32), 4)
    with pytest.raises(errors.InvalidArgument, match=r"expected \[F, 84, 84\]"):
        r.client.insert_requests([req])
    assert r.client.info().size == 0


def test_message_over_the_size_limit_is_resource_exhausted(replay):
    r = replay(vector_spec(), capacity=100_000, max_message_bytes=64 * 1024)
    big = insert_request("a", make_chunk(vector_spec(), 5000), np.ones(5000, np.float32), 5000)
    assert big.ByteSize() > 64 * 1024
    with pytest.raises(errors.ResourceExhausted) as exc:
        r.client.insert_requests([big])
    assert status(exc) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert r.client.info().size == 0
    assert r.client.insert_requests([good()]).transitions_stored == T


@pytest.mark.parametrize("keys,prios,message", [
    ([0, 1, 500], [1.0, 1.0, 1.0], "key 500 was never issued"),
    ([-1], [1.0], "key -1 was never issued"),
    ([0, 1], [1.0], "2 keys"),
    ([0, 1], [1.0, np.nan], "NaN"),
    ([0, 1], [1.0, -2.0], "<= 0"),
    ([0, 1], [np.inf, 1.0], "infinite"),
    ([0, 1], [1.0, 1e30], "above replay.max_priority"),
])
def test_bad_priority_update_is_invalid_argument_and_changes_nothing(replay, keys, prios, message):
    r = replay(vector_spec(), capacity=1000)
    r.client.insert_requests([good()])
    before = r.client.info().total_priority
    with pytest.raises(errors.InvalidArgument, match=message) as exc:
        r.client.update_priorities(np.array(keys), np.array(prios))
    assert status(exc) == grpc.StatusCode.INVALID_ARGUMENT
    info = r.client.info()
    assert info.total_priority == before and info.priority_updates_total == 0
    assert r.client.update_priorities(np.array([0]), np.array([2.0])).updated == 1


def test_update_with_wrong_key_dtype(replay):
    r = replay(vector_spec(), capacity=1000)
    r.client.insert_requests([good()])
    req = replay_pb2.UpdatePrioritiesRequest()
    tensor_to_proto(np.array([0.0]), req.keys)
    tensor_to_proto(np.array([1.0], np.float32), req.priorities)
    with pytest.raises(errors.InvalidArgument, match="keys: dtype") as exc:
        r.client._stub.UpdatePriorities(req)
    assert status(exc) == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("batch,beta,message", [
    (0, 0.4, "batch_size"), (T + 1, 0.4, f"exceeds the {T} transitions"), (10**6, 0.4, "capacity"),
    (4, 1.5, "beta"), (4, float("nan"), "beta"),
])
def test_bad_sample_request_is_invalid_argument(replay, batch, beta, message):
    r = replay(vector_spec(), capacity=1000)
    r.client.insert_requests([good()])
    with pytest.raises(errors.InvalidArgument, match=message) as exc:
        r.client.sample(batch, beta)
    assert status(exc) == grpc.StatusCode.INVALID_ARGUMENT
    assert len(r.client.sample(T, 0.4)) == T
