"""ParameterService fuzzed on a live server: PushGradients, PullParameters, WatchParameters
and Info get random, mutated, reshaped (PushGradients: a tensor's shape huge, negative or
wrong) and undecodable requests on the main port, and the read-only pull port gets the
same.

Properties, per example: an allowed status with a message (never INTERNAL or UNKNOWN),
every reply parses (a pull's last message says so), health SERVING, no watch stream left
open, and a refused request changes nothing stored: the weights, the optimizer state, the
version and the counts of applied steps stay as they were. Nothing may wait but a watch,
which waits for a new version on purpose and gets a short deadline.
"""

from __future__ import annotations

import math

import grpc
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from amprl.config import config_from_dict
from amprl.paramserver.service import SERVICE_NAME, create_server
from amprl.paramserver.store import ParameterStore
from amprl.v1 import paramserver_pb2, tensor_pb2
from amprl.wire.compressed import encode

from .harness import (CALL_TIMEOUT_S, MAX_MESSAGE_BYTES, Code, Outcome, assert_serving, call, check,
                      eventually, fuzz, rpcs)
from .protofuzz import HUGE_SHAPES, floats, messages, mutated, raw_bytes, reshaped, text

RPC = rpcs(paramserver_pb2.DESCRIPTOR.services_by_name["ParameterService"])

# Examples per strategy (the whole module takes about 15 s on two cores).
EX_PUSH, EX_PULL, EX_WATCH, EX_INFO, EX_PULL_PORT = 60, 40, 10, 30, 15

WATCH_DEADLINE_S = 0.15
"""A watch waits for a new version on purpose: its calls end at this deadline."""


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


SHAPES = {name: tuple(p.shape) for name, p in small_model().named_parameters()}


def _encoded(values: list[float], encoding: int) -> bytes:
    a = np.asarray(values, np.float32)
    if encoding == tensor_pb2.ENCODING_FP16:
        with np.errstate(over="ignore"):
            return a.astype("<f2").tobytes()
    if encoding == tensor_pb2.ENCODING_BF16:
        return (a.view("<u4") >> 16).astype("<u2").tobytes()
    return a.astype("<f4").tobytes()


@st.composite
def gradients(draw) -> tensor_pb2.CompressedTensor:
    """A CompressedTensor: mostly one named and shaped as a parameter of the model, in any
    encoding, its values from the float extremes (NaN, inf, 3.4e38 ...), its byte counts
    right or one off; else anything the generic walk makes."""
    if draw(st.integers(0, 3)) == 0:
        return draw(messages(tensor_pb2.CompressedTensor))
    msg = tensor_pb2.CompressedTensor(preconditioned=draw(st.booleans()))
    msg.name = draw(st.one_of(st.sampled_from(sorted(SHAPES)), text()))
    shape = draw(st.one_of(st.just(list(SHAPES.get(msg.name, (3,)))), st.sampled_from(HUGE_SHAPES),
                           st.lists(st.integers(0, 9), max_size=3)))
    msg.shape[:] = shape
    msg.encoding = draw(st.sampled_from([tensor_pb2.ENCODING_FP32, tensor_pb2.ENCODING_FP16,
                                         tensor_pb2.ENCODING_BF16, tensor_pb2.ENCODING_ONE_BIT,
                                         0, 5, -1, 2**31 - 1]))
    n = math.prod(shape) if min(shape, default=0) >= 0 and math.prod(shape) <= 64 else draw(st.integers(0, 8))
    off = draw(st.sampled_from([0, 0, 0, 1, -1]))  # a byte count right, or one off
    if msg.encoding == tensor_pb2.ENCODING_ONE_BIT:
        msg.block_size = draw(st.one_of(st.sampled_from([0, 1, 2, 7, 2**32 - 1]), st.integers(1, 64)))
        blocks = max(1, math.ceil(n / msg.block_size)) if msg.block_size else 1
        msg.data = draw(st.binary(min_size=math.ceil(n / 8), max_size=math.ceil(n / 8)))
        scales = _encoded(draw(st.lists(floats(32), min_size=blocks, max_size=blocks)), tensor_pb2.ENCODING_FP32)
        msg.scales = scales[:len(scales) + off] if off < 0 else scales + bytes(4 * off)
    else:
        data = _encoded(draw(st.lists(floats(32), min_size=n, max_size=n)), msg.encoding)
        msg.data = data[:len(data) + off] if off < 0 else data + bytes(off)
    return msg


OVERRIDES = {"amprl.v1.CompressedTensor": gradients()}


def valid_push(version: int, seed: int = 0) -> paramserver_pb2.PushGradientsRequest:
    g = torch.Generator().manual_seed(seed)
    return paramserver_pb2.PushGradientsRequest(
        learner_id="learner-0", base_version=version, batch_size=32,
        gradients=[encode(name, torch.randn(shape, generator=g) * 0.01, "fp32") for name, shape in SHAPES.items()])


VALID = {
    "PullParameters": paramserver_pb2.PullParametersRequest(have_version=0, client_id="actor-0",
                                                            encoding=tensor_pb2.ENCODING_BF16),
    "WatchParameters": paramserver_pb2.WatchParametersRequest(have_version=1, client_id="actor-0"),
    "Info": paramserver_pb2.ParameterServiceInfoRequest(),
}


def strategies(name: str, valid) -> dict[str, st.SearchStrategy]:
    return {"random": messages(RPC[name].request, overrides=OVERRIDES),
            "mutated": mutated(valid, overrides=OVERRIDES),
            "reshaped": reshaped(valid),  # PushGradients: the RPC with tensors
            "raw bytes": raw_bytes(valid)}


@pytest.fixture(scope="module")
def server():
    """The parameter server (main and pull port) and a channel to each."""
    store = ParameterStore.from_model(small_model(), lr=1e-2, max_staleness=4,
                                      reorder_wait_s=0.05)  # a base version ahead waits this long
    ps = create_server(config_from_dict({}), store=store, host="127.0.0.1", port=0, pull_port=0,
                       max_message_bytes=MAX_MESSAGE_BYTES, max_workers=32)
    main = grpc.insecure_channel(f"127.0.0.1:{ps.port}")
    pull = grpc.insecure_channel(f"127.0.0.1:{ps.pull_port}")
    try:
        yield ps, main, pull
    finally:
        main.close()
        pull.close()
        ps.stop(grace_s=0)


STORED_INFO = ("version", "pushes_applied", "pushes_scaled", "transitions_trained",
               "steps_applied_by_learner", "max_staleness", "checkpoint_version", "num_tensors",
               "num_parameters", "incarnation")
"""Info's fields a refused request must leave as they were (the counts of refusals, pulls
and live clients may move)."""


def _frozen(obj):
    """``obj`` (a state dict) with every tensor as its bytes: NaN equals NaN."""
    if isinstance(obj, torch.Tensor):
        return (obj.dtype, tuple(obj.shape), obj.detach().cpu().numpy().tobytes())
    if isinstance(obj, dict):
        return {k: _frozen(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_frozen(v) for v in obj]
    return obj


def stored(ps) -> dict:
    """What the server stores: weights, optimizer state, version, revision, applied counts."""
    info = ps.store.info()
    return {"state": _frozen(ps.store.state_dict()), "revision": ps.store.revision,
            **{k: info[k] for k in STORED_INFO}}


def settle(ps, channel) -> dict:
    assert eventually(lambda: ps.servicer._watchers == 0), "a watch stream was left open"
    assert_serving(channel, SERVICE_NAME)
    return stored(ps)


def exchange(server, name: str, strategy: str, request, *,
             pull_port: bool = False) -> tuple[dict, Outcome, dict]:
    """Sends ``request`` to ``name`` (on the pull port with ``pull_port``), checks the
    outcome (``check``) and that both ports serve on: (what the server stored before, the
    outcome, what it stores after). A watch gets WATCH_DEADLINE_S and may end at it."""
    ps, main, pull = server
    watch = name == "WatchParameters"
    before = stored(ps)
    out = call(pull if pull_port else main, RPC[name], [request],
               timeout=WATCH_DEADLINE_S if watch else CALL_TIMEOUT_S)
    check(out, RPC[name], strategy + (", pull port" if pull_port else ""), may_wait=watch)
    after = settle(ps, main)
    assert_serving(pull, SERVICE_NAME)
    return before, out, after


def assert_unchanged(before: dict, after: dict, out) -> None:
    changed = [k for k in before if before[k] != after[k]]
    assert not changed, f"refused ({out.code.name}: {out.details}) yet {changed} changed"


# -- PushGradients ------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["random", "mutated", "reshaped", "raw bytes"])
@fuzz(EX_PUSH)
@given(data=st.data())
def test_push_refusal_changes_no_weight_state_or_count(server, strategy, data):
    version = server[0].store.version
    valid = valid_push(version, seed=data.draw(st.integers(0, 3), label="seed"))
    # mostly the current version; else stale, a little ahead (waits, then refused) or absurd
    valid.base_version = data.draw(st.sampled_from([version] * 4 + [max(0, version - 5), version + 1,
                                                                    version + 100, 2**64 - 1]),
                                   label="base_version")
    if data.draw(st.booleans(), label="two steps"):
        valid.more_steps.add(gradients=valid.gradients, batch_size=16)
    request = data.draw(strategies("PushGradients", valid)[strategy], label="request")
    before, out, after = exchange(server, "PushGradients", strategy, request)
    if out.code == Code.OK:
        reply = out.replies[0]
        assert reply.version == after["version"] or reply.repeat
    else:
        assert_unchanged(before, after, out)


@pytest.mark.parametrize("mutate", [
    pytest.param(lambda r: setattr(r, "learner_id", "l" * 100_000), id="100k-character learner_id"),
    pytest.param(lambda r: r.gradients[0].shape.__setitem__(slice(None), [2**32, 2**32]), id="wrapping shape"),
    pytest.param(lambda r: setattr(r.gradients[0], "encoding", 2**31 - 1), id="unknown encoding"),
    pytest.param(lambda r: r.gradients.append(r.gradients[0]), id="a parameter twice"),
])
def test_pinned_bad_pushes_are_invalid_argument_and_change_nothing(server, mutate):
    ps, channel, _ = server
    request = valid_push(ps.store.version)
    mutate(request)
    before, learners = stored(ps), ps.store.info()["learners_live"]
    out = call(channel, RPC["PushGradients"], [request])
    assert out.code == Code.INVALID_ARGUMENT, f"{out.code.name}: {out.details}"
    assert_unchanged(before, settle(ps, channel), out)
    if len(request.learner_id) > 1000:
        assert ps.store.info()["learners_live"] == learners  # the id was not remembered


def test_undecodable_push_is_invalid_argument_naming_the_type(server):
    ps, channel, _ = server
    before = stored(ps)
    out = call(channel, RPC["PushGradients"], [b"\x0a\x02\xc3\x28"])  # learner_id not UTF-8
    assert out.code == Code.INVALID_ARGUMENT
    assert "amprl.v1.PushGradientsRequest" in out.details and "does not parse" in out.details
    assert_unchanged(before, settle(ps, channel), out)


# -- PullParameters, WatchParameters, Info --------------------------------------------------

@pytest.mark.parametrize("strategy", ["random", "mutated", "raw bytes"])
@fuzz(EX_PULL)
@given(data=st.data())
def test_pull_answers_whole_weights_or_refuses_and_changes_nothing(server, strategy, data):
    request = data.draw(strategies("PullParameters", VALID["PullParameters"])[strategy], label="request")
    before, out, after = exchange(server, "PullParameters", strategy, request)
    assert_unchanged(before, after, out)
    if out.code == Code.OK:
        assert out.replies and out.replies[-1].last
        assert len({r.version for r in out.replies}) == 1
        if not out.replies[0].unchanged:
            got = {t.name: tuple(t.shape) for r in out.replies for t in r.parameters}
            assert got == SHAPES


def test_a_long_client_id_is_refused_and_not_remembered(server):
    ps, channel, _ = server
    live = ps.store.info()["clients_live"]
    for name in ("PullParameters", "WatchParameters"):
        request = RPC[name].request(client_id="c" * 513)
        out = call(channel, RPC[name], [request], timeout=WATCH_DEADLINE_S * 10)
        assert out.code == Code.INVALID_ARGUMENT and "client_id: 513 characters" in out.details
    assert ps.store.info()["clients_live"] == live
    settle(ps, channel)


@pytest.mark.parametrize("strategy", ["random", "mutated", "raw bytes"])
@fuzz(EX_WATCH)
@given(data=st.data())
def test_watch_ends_at_its_deadline_or_refuses_and_closes_its_stream(server, strategy, data):
    request = data.draw(strategies("WatchParameters", VALID["WatchParameters"])[strategy], label="request")
    before, out, after = exchange(server, "WatchParameters", strategy, request)
    assert_unchanged(before, after, out)
    assert all(r.version == before["version"] for r in out.replies)


@pytest.mark.parametrize("strategy", ["random", "raw bytes"])
@fuzz(EX_INFO)
@given(data=st.data())
def test_info_changes_nothing(server, strategy, data):
    request = data.draw(strategies("Info", VALID["Info"])[strategy], label="request")
    before, out, after = exchange(server, "Info", strategy, request)
    assert_unchanged(before, after, out)


# -- the pull port: the same RPCs, PushGradients refused ----------------------------------

@pytest.mark.parametrize("name", sorted(RPC))
@fuzz(EX_PULL_PORT)
@given(data=st.data())
def test_the_pull_port_refuses_pushes_and_changes_nothing(server, name, data):
    valid = valid_push(server[0].store.version) if name == "PushGradients" else VALID[name]
    strategy = data.draw(st.sampled_from(["random", "mutated", "raw bytes"]), label="strategy")
    request = data.draw(strategies(name, valid)[strategy], label="request")
    before, out, after = exchange(server, name, strategy, request, pull_port=True)
    if name == "PushGradients":  # (or the bytes do not parse, or are over the message limit)
        assert out.code in (Code.PERMISSION_DENIED, Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED), out.details
    assert_unchanged(before, after, out)


def test_the_server_still_applies_and_serves_valid_calls(server):
    ps, channel, _ = server
    version = ps.store.version
    out = call(channel, RPC["PushGradients"], [valid_push(version)])
    assert out.code == Code.OK and out.replies[0].version == version + 1
    out = call(channel, RPC["PullParameters"], [VALID["PullParameters"]])
    assert out.code == Code.OK and out.replies[-1].version == version + 1
