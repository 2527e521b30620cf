"""ReplayService fuzzed on a live shard with a real Redis: Insert, Sample, UpdatePriorities
and Info get random, mutated, reshaped (a tensor's shape huge, negative or wrong) and
undecodable requests.

Properties, per example: an allowed status with a message (never INTERNAL or UNKNOWN),
health SERVING, every open stream and pending byte released, and a refused request stores
nothing: a refused Insert keeps exactly the valid chunks sent before the bad one (and says
how many), a refused Sample or UpdatePriorities changes no counter, priority or Redis key.
The shard does not rate-limit, so nothing may wait: DEADLINE_EXCEEDED is a hang. A second,
rate-limited shard, whose Sample and Insert do wait, is fuzzed with short deadlines.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from amprl.common.redis_server import EmbeddedRedis
from amprl.config import ExperimentConfig
from amprl.replay.client import insert_request
from amprl.replay.service import SERVICE_NAME, create_server
from amprl.v1 import replay_pb2, tensor_pb2
from amprl.wire.tensors import DTYPES, tensor_to_proto
from amprl_testing.replay import make_chunk, vector_spec

from .harness import (CALL_TIMEOUT_S, MAX_MESSAGE_BYTES, Code, Outcome, assert_serving, call, check,
                      eventually, fuzz, rpcs)
from .protofuzz import HUGE_SHAPES, messages, mutated, raw_bytes, reshaped

SPEC = vector_spec()
T = 8
CAPACITY = 256
RPC = rpcs(replay_pb2.DESCRIPTOR.services_by_name["ReplayService"])

# Examples per strategy (the whole module takes about 15 s on two cores).
EX_INSERT, EX_SAMPLE, EX_UPDATE, EX_INFO, EX_WAITING = 60, 40, 50, 40, 30


@st.composite
def tensors(draw) -> tensor_pb2.Tensor:
    """A Tensor: bytes that match its dtype and shape, a huge or negative shape over a few
    bytes, one past the message limit, or anything the generic walk makes."""
    kind = draw(st.sampled_from(["consistent"] * 3 + ["huge shape"] * 2 + ["generic"] * 2 + ["oversized"]))
    t = tensor_pb2.Tensor()
    if kind == "consistent":
        t.dtype = draw(st.sampled_from(sorted(DTYPES)))
        t.shape[:] = draw(st.lists(st.integers(0, 9), max_size=3))
        n = math.prod(t.shape) * DTYPES[t.dtype].itemsize
        t.data = draw(st.binary(min_size=n, max_size=n))
    elif kind == "huge shape":
        t.dtype = draw(st.sampled_from(sorted(DTYPES) + [0, 99]))
        t.shape[:] = draw(st.sampled_from(HUGE_SHAPES))
        t.data = draw(st.binary(max_size=16))
    elif kind == "oversized":  # over the shard's message limit
        t.dtype = tensor_pb2.DTYPE_FLOAT32
        t.shape[:] = [MAX_MESSAGE_BYTES // 4 + 1024]
        t.data = bytes(4 * t.shape[0])
    else:
        t = draw(messages(tensor_pb2.Tensor))
    return t


TENSORS = {"amprl.v1.Tensor": tensors()}


def valid_insert(seed: int = 0, actor_id: str = "fuzz-actor") -> replay_pb2.InsertRequest:
    return insert_request(actor_id, make_chunk(SPEC, T, seed=seed), np.ones(T, np.float32), env_steps=T)


def valid_update(keys: np.ndarray) -> replay_pb2.UpdatePrioritiesRequest:
    req = replay_pb2.UpdatePrioritiesRequest()
    tensor_to_proto(keys.astype(np.int64), req.keys)
    tensor_to_proto(np.linspace(0.5, 2.0, len(keys)).astype(np.float32), req.priorities)
    return req


VALID = {
    "Insert": valid_insert(),
    "Sample": replay_pb2.SampleRequest(batch_size=4, beta=0.4),
    "UpdatePriorities": valid_update(np.arange(4)),
    "Info": replay_pb2.ReplayServiceInfoRequest(),
}


def strategies(name: str, valid=None) -> dict[str, st.SearchStrategy]:
    valid = valid if valid is not None else VALID[name]
    return {"random": messages(RPC[name].request, overrides=TENSORS),
            "mutated": mutated(valid, overrides=TENSORS),
            "reshaped": reshaped(valid),  # Insert and UpdatePriorities: the RPCs with tensors
            "raw bytes": raw_bytes(valid)}


def start_shard(redis_url: str, prefix: str, **replay):
    cfg = ExperimentConfig()
    cfg.replay.capacity = CAPACITY
    cfg.replay.min_size_to_sample = 1
    for key, value in replay.items():
        setattr(cfg.replay, key, value)
    return create_server(cfg, SPEC, redis_url, "127.0.0.1", 0, max_message_bytes=MAX_MESSAGE_BYTES,
                         prefix=prefix, seed=0)


@pytest.fixture(scope="module")
def redis_url():
    with tempfile.TemporaryDirectory(prefix="amprl-fuzz-") as tmp:
        redis = EmbeddedRedis(Path(tmp) / "redis")
        try:
            yield redis.url
        finally:
            redis.stop()


@pytest.fixture(scope="module")
def shard(redis_url):
    """A shard that never waits, holding some transitions, and a channel to it."""
    rs = start_shard(redis_url, "fuzz:replay")
    channel = grpc.insecure_channel(f"127.0.0.1:{rs.port}")
    try:
        for seed in range(4):
            assert call(channel, RPC["Insert"], [valid_insert(seed)]).code == Code.OK
        yield rs, channel
    finally:
        channel.close()
        rs.stop(0)


def stored(rs) -> dict:
    """What the shard stores: the table's counters and sums, Redis's counters and senders
    (actor id -> newest chunk), the actor ids it counts."""
    info = rs.table.info()
    info.pop("cache_bytes")
    storage = rs.table.storage
    return {**info, "redis": storage.load_counters(), "senders": storage.load_senders(),
            "actors_seen": rs.servicer.actors.seen}


def released(rs) -> bool:
    """No stream open, no received byte held, no call waiting."""
    s = rs.servicer
    return (s.inserts.streams == 0 and s.inserts.pending_insert_bytes == 0 and s.samples == 0
            and s.limiter.waiting_samples == 0 and s.limiter.waiting_inserts == 0)


def settle(rs, channel) -> dict:
    assert eventually(lambda: released(rs)), "a call left a stream, bytes or a waiter behind"
    assert_serving(channel, SERVICE_NAME)
    return stored(rs)


def exchange(shard, name: str, strategy: str, requests: list, *, timeout: float = CALL_TIMEOUT_S,
             may_wait: bool = False) -> tuple[dict, Outcome, dict]:
    """Sends ``requests`` to ``name``, checks the outcome (``check``) and that the shard
    serves on: (what it stored before, the outcome, what it stores after)."""
    rs, channel = shard
    before = stored(rs)
    out = call(channel, RPC[name], requests, timeout)
    check(out, RPC[name], strategy, may_wait=may_wait)
    return before, out, settle(rs, channel)


# -- Insert ------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["random", "mutated", "reshaped", "raw bytes"])
@fuzz(EX_INSERT)
@given(data=st.data())
def test_insert_refusal_keeps_exactly_the_chunks_before_the_bad_one(shard, strategy, data):
    prefix = data.draw(st.integers(0, 2), label="valid chunks sent first")
    bad = data.draw(strategies("Insert")[strategy], label="request")
    before, out, after = exchange(shard, "Insert", strategy,
                                  [valid_insert(100 + i) for i in range(prefix)] + [bad])
    added = after["inserted_total"] - before["inserted_total"]
    if out.code == Code.OK:
        if out.replies[0].chunks_duplicate == 0:
            assert added == out.replies[0].transitions_stored
        return
    if out.code == Code.INVALID_ARGUMENT:
        # the contract: the chunks before the bad one are stored, and the message says so
        assert added == prefix * T, out.details
        if prefix:
            assert f"{prefix * T} transitions of this call are stored" in out.details
    else:  # RESOURCE_EXHAUSTED (the message limit) may end the call before a flush
        assert added in (0, prefix * T), out.details
    if added == 0:
        assert after == before, f"refused ({out.code.name}: {out.details}) yet stored changed"
    else:
        assert after["env_steps_total"] - before["env_steps_total"] == added


def _huge(shape: list[int]) -> replay_pb2.InsertRequest:
    req = valid_insert()
    req.chunk.obs_frame_indices.shape[:] = shape
    req.chunk.obs_frame_indices.data = b""
    return req


@pytest.mark.parametrize("request_", [
    # found by the reshaped strategy: INTERNAL (a NumPy ValueError) before the fix
    pytest.param(_huge([2**32, 2**32]), id="element count wrapping to 0"),
    pytest.param(_huge([2**62, 4]), id="element count wrapping to 0 (2^62 x 4)"),
    pytest.param(_huge([-1, -1]), id="negative dimensions whose product is positive"),
    pytest.param(_huge([0, 2**63 - 1]), id="no elements in a huge shape"),
    pytest.param(valid_insert(actor_id="a" * 100_000), id="100k-character actor_id"),
    pytest.param(b"\x0a\x02\xc3\x28", id="actor_id that is not UTF-8"),
])
def test_pinned_bad_inserts_are_invalid_argument_and_store_nothing(shard, request_):
    rs, channel = shard
    before = stored(rs)
    out = call(channel, RPC["Insert"], [request_])
    assert out.code == Code.INVALID_ARGUMENT, f"{out.code.name}: {out.details}"
    assert settle(rs, channel) == before


def test_an_undecodable_chunk_mid_stream_keeps_the_chunks_before_it(shard):
    rs, channel = shard
    before = stored(rs)
    out = call(channel, RPC["Insert"], [valid_insert(7), valid_insert(8), b"\xff\xff"])
    assert out.code == Code.INVALID_ARGUMENT
    assert "does not parse" in out.details and "2 chunks, 16 transitions of this call are stored" in out.details
    assert settle(rs, channel)["inserted_total"] == before["inserted_total"] + 2 * T


# -- Sample, UpdatePriorities, Info ------------------------------------------------------

@pytest.mark.parametrize("strategy", ["random", "mutated", "raw bytes"])
@fuzz(EX_SAMPLE)
@given(data=st.data())
def test_sample_refusal_changes_nothing(shard, strategy, data):
    request = data.draw(strategies("Sample")[strategy], label="request")
    before, out, after = exchange(shard, "Sample", strategy, [request])
    if out.code == Code.OK:
        batch = out.replies[0].keys.shape[0]
        assert batch >= 1 and after["sampled_total"] - before["sampled_total"] == batch
    else:
        assert after == before, f"refused ({out.code.name}: {out.details}) yet stored changed"


@pytest.mark.parametrize("strategy", ["random", "mutated", "reshaped", "raw bytes"])
@fuzz(EX_UPDATE)
@given(data=st.data())
def test_priority_update_refusal_changes_nothing(shard, strategy, data):
    table = shard[0].table
    live = np.arange(table.oldest_key, table.oldest_key + 4)  # keys sampling could issue
    request = data.draw(strategies("UpdatePriorities", valid_update(live))[strategy], label="request")
    priorities = table.priorities.copy()
    before, out, after = exchange(shard, "UpdatePriorities", strategy, [request])
    if out.code == Code.OK:
        assert after["priority_updates_total"] - before["priority_updates_total"] == out.replies[0].updated
    else:
        assert after == before, f"refused ({out.code.name}: {out.details}) yet stored changed"
        assert np.array_equal(table.priorities, priorities)


@pytest.mark.parametrize("strategy", ["random", "raw bytes"])
@fuzz(EX_INFO)
@given(data=st.data())
def test_info_changes_nothing(shard, strategy, data):
    request = data.draw(strategies("Info")[strategy], label="request")
    before, out, after = exchange(shard, "Info", strategy, [request])
    assert after == before


# -- a rate-limited shard: Sample and Insert wait, up to the call's deadline ---------------

WAIT_DEADLINE_S = 0.2
"""Deadline of the waiting shard's calls: they wait on purpose, so DEADLINE_EXCEEDED is
allowed there (and must change nothing)."""


@pytest.fixture(scope="module")
def waiting_shard(redis_url):
    """Samples wait for 64 transitions, then (one sample per inserted transition, give or
    take 16) for inserts; inserts, past 64, wait for samples."""
    rs = start_shard(redis_url, "fuzz:waiting", min_size_to_sample=64, samples_per_insert=1.0,
                     samples_per_insert_error_buffer=16.0)
    channel = grpc.insecure_channel(f"127.0.0.1:{rs.port}")
    try:
        yield rs, channel
    finally:
        channel.close()
        rs.stop(0)


@pytest.mark.parametrize("name", ["Sample", "Insert"])
@fuzz(EX_WAITING)
@given(data=st.data())
def test_waiting_calls_end_at_their_deadline_and_change_nothing(waiting_shard, name, data):
    strategy = data.draw(st.sampled_from(["mutated", "raw bytes"]), label="strategy")
    request = data.draw(strategies(name)[strategy], label="request")
    before, out, after = exchange(waiting_shard, name, f"{strategy}, rate-limited", [request],
                                  timeout=WAIT_DEADLINE_S, may_wait=True)
    if out.code != Code.OK:
        assert after == before, f"refused ({out.code.name}: {out.details}) yet stored changed"


def test_the_shards_still_serve_valid_calls(shard, waiting_shard):
    rs, channel = shard
    assert call(channel, RPC["Insert"], [valid_insert(999)]).code == Code.OK
    out = call(channel, RPC["Sample"], [VALID["Sample"]])
    assert out.code == Code.OK
    keys = np.frombuffer(out.replies[0].keys.data, np.int64)
    out = call(channel, RPC["UpdatePriorities"], [valid_update(keys)])
    assert out.code == Code.OK and out.replies[0].updated + out.replies[0].evicted == len(keys)
    assert call(channel, RPC["Info"], [VALID["Info"]]).code == Code.OK
    rs, channel = waiting_shard
    assert call(channel, RPC["Info"], [VALID["Info"]]).code == Code.OK
