"""ParameterService on a real gRPC server on loopback, called through ParameterClient
and, where the wire itself is the point, through the raw stub."""

import time

import grpc
import numpy as np
import pytest
import torch
from torch import nn

from amprl import errors
from amprl.wire.compressed import ErrorFeedback, decode, encode
from amprl.config import config_from_dict
from amprl.paramserver.client import ParameterClient, load_into, reply_weights
from amprl.paramserver.service import create_server
from amprl.paramserver.store import ParameterStore
from amprl.v1 import paramserver_pb2, paramserver_pb2_grpc, tensor_pb2



@pytest.fixture
def raw_stub():
    """A ParameterService stub on a plain channel (no retries, no error mapping): for the
    tests of what the server itself answers, status codes and trailers included."""
    channels = []

    def make(client):
        channels.append(grpc.insecure_channel(client.address))
        return paramserver_pb2_grpc.ParameterServiceStub(channels[-1])
    yield make
    for channel in channels:
        channel.close()

def small_model(seed=0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))


def wide_model(seed=0) -> nn.Module:
    # 8 x (64*64 + 64) fp32 = ~135 KB: several times a 40 KB message limit.
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])


@pytest.fixture
def start_server():
    started = []

    def start(model=None, max_message_bytes=None, **cfg_overrides):
        cfg = config_from_dict({"paramserver": {"lr": 1e-2, **cfg_overrides}})
        kwargs = {"max_message_bytes": max_message_bytes} if max_message_bytes else {}
        ps = create_server(cfg, model or small_model(), host="127.0.0.1", port=0, **kwargs)
        client = ParameterClient(f"127.0.0.1:{ps.port}", "learner-0", timeout_s=10)
        started.append((ps, client))
        return ps, client

    yield start
    for ps, client in started:
        client.close()
        ps.stop(grace_s=0)


def fp32_grads(ps, seed=0, names=None):
    g = torch.Generator().manual_seed(seed)
    return [encode(n, torch.randn(s, generator=g), "fp32") for n, s in ps.store.shapes.items()
            if names is None or n in names]


def test_push_then_pull_returns_the_stepped_weights(start_server):
    model = small_model()
    ps, client = start_server(model)
    version, weights = client.pull()
    assert version == 0 and list(weights) == [n for n, _ in model.named_parameters()]
    assert all(torch.equal(weights[n], p.detach()) for n, p in model.named_parameters())
    reply = client.push(0, fp32_grads(ps), batch_size=64)
    assert reply.version == 1 and reply.disposition == paramserver_pb2.PUSH_DISPOSITION_APPLIED
    assert reply.staleness == 0 and reply.scale == 1.0
    version, new = client.pull(have_version=0)
    assert version == 1
    assert all(torch.equal(new[n], ps.store.params[n].detach()) for n in new)
    assert not torch.equal(new["0.weight"], weights["0.weight"])
    load_into(model, new)
    info = client.info()
    assert (info.version, info.pushes_applied, info.transitions_trained) == (1, 1, 64)
    assert info.learners_live == 1 and info.num_tensors == 6


def test_a_push_asking_for_weights_gets_exactly_the_version_it_made(start_server):
    ps, client = start_server()
    assert reply_weights(client.push(0, fp32_grads(ps, 0))) is None  # not asked: none sent
    reply = client.push_future(1, fp32_grads(ps, 1), return_weights=True).result(timeout=10)
    weights = reply_weights(reply)
    assert reply.version == 2 and weights is not None
    assert all(torch.equal(weights[n], ps.store.params[n].detach()) for n in ps.store.shapes)
    client.push(2, fp32_grads(ps, 2))  # the server moves on; the reply stays version 2's
    version, pulled = client.pull(have_version=0)
    assert version == 3 and not torch.equal(pulled["0.weight"], weights["0.weight"])
    assert client.info().pulls_with_weights == 2  # the reply counts as a pull


def test_a_model_over_one_message_gets_no_weights_in_the_reply(start_server):
    # ~135 KB of fp32 weights over a 40 KB message limit: the reply stays small; pull instead
    ps, client = start_server(wide_model(), max_message_bytes=40_000)
    reply = client.push(0, fp32_grads(ps, names=["0.weight"]), return_weights=True)  # 16 KB
    assert reply.version == 1 and reply_weights(reply) is None
    version, weights = client.pull(have_version=0)
    assert version == 1 and all(torch.equal(weights[n], ps.store.params[n].detach()) for n in weights)


def test_an_unchanged_pull_carries_only_the_version(start_server, raw_stub):
    ps, client = start_server()
    client.push(0, fp32_grads(ps))
    stub = raw_stub(client)
    replies = list(stub.PullParameters(paramserver_pb2.PullParametersRequest(have_version=1,
                                                                             client_id="actor-0")))
    assert len(replies) == 1
    r = replies[0]
    assert r.unchanged and r.last and r.version == 1 and len(r.parameters) == 0
    assert r.ByteSize() < 32  # the version, the flags and the server's incarnation
    assert client.pull(have_version=1) == (1, None)
    info = client.info()
    assert info.pulls_unchanged == 2 and info.pulls_with_weights == 0
    assert info.actors_live == 1 and info.clients_live == 2


def test_a_model_over_the_message_limit_is_pulled_in_chunks(start_server, raw_stub):
    model = wide_model()
    limit = 40 * 1024
    ps, client = start_server(model, max_message_bytes=limit)
    stub = raw_stub(client)
    replies = list(stub.PullParameters(paramserver_pb2.PullParametersRequest()))
    assert len(replies) >= 4
    assert all(r.ByteSize() <= limit for r in replies)
    assert [r.last for r in replies] == [False] * (len(replies) - 1) + [True]
    assert {r.version for r in replies} == {0}
    names = [t.name for r in replies for t in r.parameters]
    assert names == [n for n, _ in model.named_parameters()]
    _, weights = client.pull()
    assert all(torch.equal(weights[n], p.detach()) for n, p in model.named_parameters())
    # Pushes of the whole model still fit in one message as 1-bit.
    ef = ErrorFeedback("onebit", block_size=256, min_elements=64)
    msgs = ef.compress({n: torch.randn_like(p) for n, p in model.named_parameters()})
    assert client.push(0, msgs).version == 1


def test_a_parameter_larger_than_the_message_limit_is_refused_at_startup():
    cfg = config_from_dict({})
    with pytest.raises(errors.ConfigError, match="does not fit one message"):
        create_server(cfg, nn.Linear(256, 256), host="127.0.0.1", port=0, max_message_bytes=64 * 1024)


@pytest.mark.parametrize("encoding,tol", [("bf16", 2**-8), ("fp16", 2**-11)])
def test_weights_can_be_pulled_in_half_precision(start_server, encoding, tol):
    model = small_model()
    _, client = start_server(model)
    _, weights = client.pull(encoding=encoding)
    for n, p in model.named_parameters():
        assert torch.allclose(weights[n], p.detach(), rtol=tol, atol=1e-6)


def test_onebit_pushes_with_error_feedback_are_applied(start_server):
    ps, client = start_server()
    ef = ErrorFeedback("onebit", block_size=64, min_elements=64)
    version = 0
    for step in range(5):
        g = {n: torch.randn(s) for n, s in ps.store.shapes.items()}
        version = client.push(version, ef.compress(g), batch_size=32).version
    assert version == 5
    info = client.info()
    assert 0 < info.gradient_bytes_received < 5 * 4 * info.num_parameters / 8


def test_preconditioned_one_bit_tensors_take_the_momentum_step(start_server):
    """Over gRPC: the tensors a learner sends 1-bit and preconditioned get the server's
    momentum-only step, the small ones it sends dense get Adam's."""
    ps, client = start_server()
    ef = ErrorFeedback("onebit", block_size=64, min_elements=64, precondition=True)
    g = torch.Generator().manual_seed(3)
    for version in range(2):
        msgs = ef.compress({n: torch.randn(s, generator=g) for n, s in ps.store.shapes.items()})
        assert client.push(version, msgs, batch_size=32).version == version + 1
    one_bit = {m.name for m in msgs if m.preconditioned}
    assert one_bit and one_bit != set(ps.store.shapes)
    for n, p in ps.store.params.items():
        state = ps.store.optimizer.state[p]
        assert ("precond_avg" in state) == (n in one_bit) and ("exp_avg_sq" in state) != (n in one_bit), n


def test_subset_pushes_step_only_the_named_parameters(start_server):
    ps, client = start_server()
    client.push(0, fp32_grads(ps))
    _, before = client.pull()
    client.push(1, fp32_grads(ps, 1, names={"4.weight", "4.bias"}))
    _, after = client.pull()
    for n in before:
        assert torch.equal(before[n], after[n]) == (n not in {"4.weight", "4.bias"}), n


def test_watch_coalesces_for_a_slow_subscriber(start_server):
    ps, client = start_server(max_staleness=1000)
    with client.watch(have_version=0) as watch:
        assert watch.next(timeout=5) == 0  # 0 = "none held": the current version at once
        client.push(0, fp32_grads(ps))
        assert watch.next(timeout=5) == 1
        # The subscriber is busy while 30 versions go by...
        for v in range(1, 31):
            client.push(v, fp32_grads(ps, v))
        time.sleep(0.3)
        # ...then gets the newest one, and no backlog behind it.
        assert watch.next(timeout=5) == 31
        assert watch.next(timeout=0.3) is None
        client.push(31, fp32_grads(ps, 31))
        assert watch.next(timeout=5) == 32


def test_watch_first_message_is_the_current_version_when_it_differs(start_server):
    ps, client = start_server()
    client.push(0, fp32_grads(ps))
    with client.watch(have_version=0) as watch:
        assert watch.next(timeout=5) == 1
    with client.watch(have_version=1) as watch:
        assert watch.next(timeout=0.3) is None


def test_watch_ends_cleanly_on_client_cancel(start_server):
    ps, client = start_server()
    watch = client.watch(have_version=5)
    assert watch.next(timeout=5) == 0
    deadline = time.monotonic() + 5
    while ps.servicer._watchers != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    watch.cancel()
    assert list(watch) == []
    while ps.servicer._watchers and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ps.servicer._watchers == 0
    assert client.push(0, fp32_grads(ps)).version == 1  # the server is unaffected


def test_watch_ends_cleanly_when_the_server_stops(start_server):
    ps, client = start_server()
    watch = client.watch(have_version=0)
    assert watch.next(timeout=5) == 0
    assert watch.next(timeout=0.2) is None
    t = time.monotonic()
    ps.stop(grace_s=5)
    assert list(watch) == []  # StopIteration, no error
    assert time.monotonic() - t < 3


def _raw_push(ps, gradients, base_version=0):
    return paramserver_pb2.PushGradientsRequest(learner_id="learner-x", base_version=base_version,
                                                gradients=gradients)


def _one(ps, name="0.weight", base="fp32", **changes):
    msg = encode(name, torch.randn(ps.store.shapes[name]), base)
    for k, v in changes.items():
        setattr(msg, k, v)
    return msg


def _bad_cases(ps):
    ok = fp32_grads(ps)
    nan = encode("0.bias", torch.tensor([float("nan")] + [0.0] * 31), "fp32")
    inf_scale = _one(ps, base="onebit")
    inf_scale.scales = np.array([np.inf], "<f4").tobytes()
    wrong_shape = encode("0.weight", torch.randn(4, 32), "fp32")
    return {
        "unknown name": ok + [encode("9.weight", torch.ones(3), "fp32")],
        "duplicate name": ok + [ok[0]],
        "shape mismatch": ok[1:] + [wrong_shape],
        "unspecified encoding": [_one(ps, encoding=tensor_pb2.ENCODING_UNSPECIFIED)],
        "unknown encoding": [_one(ps, encoding=42)],
        "wrong byte count": [_one(ps, data=b"\x00" * 12)],
        "onebit block size 0": [_one(ps, base="onebit", block_size=0)],
        "onebit wrong scales": [_one(ps, base="onebit", scales=b"\x00\x00")],
        "nan": ok[:1] + [nan],
        "inf scale": [inf_scale],
        "empty": [],
    }


CASES = ["unknown name", "duplicate name", "shape mismatch", "unspecified encoding",
         "unknown encoding", "wrong byte count", "onebit block size 0", "onebit wrong scales",
         "nan", "inf scale", "empty"]


@pytest.mark.parametrize("steps", [1, 3])
def test_every_bad_push_is_invalid_argument_and_the_server_keeps_serving(start_server, steps, raw_stub):
    """Each bad case alone, and as the last step of a 3-step push (two good steps before it,
    which must not be applied either; the message names the step)."""
    ps, client = start_server()
    stub = raw_stub(client)
    client.push(0, fp32_grads(ps))
    _, before = client.pull()
    cases = _bad_cases(ps)
    good = [(fp32_grads(ps, k), 0) for k in range(1, steps)]
    for case in CASES:
        parts = [g for g, _ in good] + [cases[case]]
        request = _raw_push(ps, parts[0], base_version=1)
        for part in parts[1:]:
            request.more_steps.add().gradients.extend(part)
        with pytest.raises(grpc.RpcError) as err:
            stub.PushGradients(request, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
        assert err.value.details(), case
        if steps > 1:
            assert err.value.details().startswith(f"step {steps - 1} of {steps}: "), case
        with pytest.raises(errors.InvalidArgument):
            if steps == 1:
                client.push(1, cases[case])
            else:
                client.push(1, good[0][0], more_steps=good[1:] + [(cases[case], 0)])
    version, after = client.pull()
    assert version == 1
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert client.info().pushes_rejected_invalid == 2 * len(CASES)
    assert client.push(1, fp32_grads(ps, 5)).version == 2


def test_a_multi_step_push_applies_its_steps_in_order_one_version_each(start_server):
    ps, client = start_server()
    _, one_by_one = start_server()
    steps = [fp32_grads(ps, k) for k in range(3)]
    for k, g in enumerate(steps):
        one_by_one.push(k, g, batch_size=16)
    reply = client.push(0, steps[0], batch_size=16, return_weights=True,
                        more_steps=[(g, 16) for g in steps[1:]])
    assert (reply.version, reply.staleness) == (3, 0)
    expected = one_by_one.pull()[1]
    for n, w in reply_weights(reply).items():  # the weights of the last step
        assert torch.equal(w, expected[n]), n
    info = client.info()
    assert info.version == 3 and info.pushes_applied == 3 and info.transitions_trained == 48


def test_a_too_stale_push_is_failed_precondition_with_the_current_version(start_server, raw_stub):
    ps, client = start_server(max_staleness=1)
    for v in range(3):
        client.push(v, fp32_grads(ps, v))
    stub = raw_stub(client)
    with pytest.raises(grpc.RpcError) as err:
        stub.PushGradients(_raw_push(ps, fp32_grads(ps), base_version=0), timeout=5)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert ("amprl-current-version", "3") in tuple(err.value.trailing_metadata())
    with pytest.raises(errors.FailedPrecondition) as exc:
        client.push(1, fp32_grads(ps))
    assert exc.value.current_version == 3
    fut = client.push_future(0, fp32_grads(ps))
    with pytest.raises(errors.FailedPrecondition) as exc:
        fut.result(timeout=5)
    assert exc.value.current_version == 3
    assert client.push_future(2, fp32_grads(ps)).result(timeout=5).staleness == 1
    info = client.info()
    assert info.pushes_rejected_stale == 3 and info.max_staleness == 1


def test_staleness_scaling_is_reported_in_the_reply(start_server):
    ps, client = start_server(max_staleness=4, staleness_scaling=True)
    for v in range(2):
        client.push(v, fp32_grads(ps, v))
    reply = client.push(0, fp32_grads(ps))
    assert reply.disposition == paramserver_pb2.PUSH_DISPOSITION_SCALED
    assert reply.staleness == 2 and reply.scale == pytest.approx(1 / 3)
    assert client.info().pushes_scaled == 1


def test_pull_in_onebit_is_refused(start_server, raw_stub):
    _, client = start_server()
    stub = raw_stub(client)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.PullParameters(paramserver_pb2.PullParametersRequest(
            encoding=tensor_pb2.ENCODING_ONE_BIT)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_many_pushes_in_flight_from_two_learners(start_server):
    ps, client = start_server(max_staleness=64)
    other = ParameterClient(f"127.0.0.1:{ps.port}", "learner-1")
    try:
        futures = [c.push_future(0, fp32_grads(ps, i)) for i in range(10) for c in (client, other)]
        versions = sorted(f.result(timeout=10).version for f in futures)
        assert versions == list(range(1, 21))
        assert client.info().learners_live == 2
    finally:
        other.close()


def test_decode_of_pulled_weights_is_exact(start_server, raw_stub):
    ps, client = start_server()
    stub = raw_stub(client)
    (reply,) = list(stub.PullParameters(paramserver_pb2.PullParametersRequest()))
    for msg in reply.parameters:
        assert torch.equal(decode(msg), ps.store.params[msg.name].detach())


def test_the_client_reconnects_to_a_restarted_server(start_server):
    ps, client = start_server()
    client.push(0, fp32_grads(ps))
    port = ps.port
    ps.stop(grace_s=0)
    with pytest.raises((errors.Unavailable, errors.DeadlineExceeded)):
        client.pull(timeout=0.5)
    cfg = config_from_dict({})
    again = create_server(cfg, small_model(), host="127.0.0.1", port=port)
    try:
        version, weights = client.pull(timeout=10)  # same client object, same channel
        assert version == 0 and weights is not None
        assert client.push(0, fp32_grads(again)).version == 1
    finally:
        again.stop(grace_s=0)


# -- one encoding and one serialization per version, whoever pulls -------------------------

def _raw_pull(channel, encoding=tensor_pb2.ENCODING_FP32, have_version=0) -> list[bytes]:
    """A pull read as the bytes on the wire (no deserializer)."""
    pull = channel.unary_stream("/amprl.v1.ParameterService/PullParameters")
    request = paramserver_pb2.PullParametersRequest(have_version=have_version, encoding=encoding)
    return list(pull(request.SerializeToString(), timeout=10))


@pytest.fixture
def count_encodings(monkeypatch):
    """Counts the tensor encodings the server makes."""
    from amprl.paramserver import service
    calls = []

    def counting(name, tensor, encoding):
        calls.append((name, encoding))
        return encode(name, tensor, encoding)

    monkeypatch.setattr(service, "encode", counting)
    return calls


def test_every_pull_of_a_version_gets_the_same_bytes_encoded_once(start_server, count_encodings):
    ps, client = start_server()
    tensors = len(ps.store.shapes)
    first = _raw_pull(client.channel)
    assert _raw_pull(client.channel) == first and len(count_encodings) == tensors
    # The bytes sent are the cached ones, serialized when the version was encoded.
    cached = ps.servicer.encoded(tensor_pb2.ENCODING_FP32)
    assert cached is ps.servicer.encoded(tensor_pb2.ENCODING_FP32) and cached.replies == first
    (reply,) = [paramserver_pb2.PullParametersResponse.FromString(b) for b in first]
    assert reply.version == 0 and reply.last and not reply.unchanged
    assert [m.name for m in reply.parameters] == list(ps.store.shapes)
    assert all(torch.equal(decode(m), ps.store.params[m.name].detach()) for m in reply.parameters)
    # Each half-precision encoding is made once too, and serves what the client decodes.
    for encoding, name in ((tensor_pb2.ENCODING_BF16, "bf16"), (tensor_pb2.ENCODING_FP16, "fp16")):
        assert _raw_pull(client.channel, encoding) == _raw_pull(client.channel, encoding)
        assert client.pull(encoding=name)[1].keys() == ps.store.shapes.keys()
    assert len(count_encodings) == 3 * tensors
    assert {e for _, e in count_encodings} == {"fp32", "bf16", "fp16"}


def test_a_new_version_is_encoded_once_however_many_pull_it(start_server, count_encodings):
    import concurrent.futures

    ps, client = start_server()
    _raw_pull(client.channel)
    client.push(0, fp32_grads(ps))
    before = len(count_encodings)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        pulls = list(pool.map(lambda _: _raw_pull(client.channel), range(32)))
    assert len(count_encodings) - before == len(ps.store.shapes)
    assert all(p == pulls[0] for p in pulls)
    assert paramserver_pb2.PullParametersResponse.FromString(pulls[0][0]).version == 1
    assert client.info().pulls_with_weights == 33


def test_chunked_pull_replies_are_cached_bytes_that_parse_as_the_messages(start_server):
    ps, client = start_server(wide_model(), max_message_bytes=40 * 1024)
    replies = _raw_pull(client.channel)
    assert len(replies) >= 4 and replies == _raw_pull(client.channel)
    assert all(len(r) <= 40 * 1024 for r in replies)
    parsed = [paramserver_pb2.PullParametersResponse.FromString(r) for r in replies]
    assert [r.last for r in parsed] == [False] * (len(parsed) - 1) + [True]
    tensors = [m for r in parsed for m in r.parameters]  # 16 KB each: 3-byte length prefixes
    assert [m.name for m in tensors] == list(ps.store.shapes)
    assert all(torch.equal(decode(m), ps.store.params[m.name].detach()) for m in tensors)


def test_a_push_reply_with_weights_fills_the_pull_cache(start_server, count_encodings):
    ps, client = start_server()
    reply = client.push(0, fp32_grads(ps), return_weights=True)
    assert reply.version == 1 and reply.disposition == paramserver_pb2.PUSH_DISPOSITION_APPLIED
    assert len(count_encodings) == len(ps.store.shapes)
    pulled = [paramserver_pb2.PullParametersResponse.FromString(b) for b in _raw_pull(client.channel)]
    assert len(count_encodings) == len(ps.store.shapes)  # the pull found the push's encoding
    assert list(reply.weights) == list(pulled[0].parameters)


def test_add_to_server_registers_every_rpc_of_the_service():
    from amprl.paramserver.service import SERVICE_NAME, ParameterServicer, add_to_server

    class Recorder:
        def add_generic_rpc_handlers(self, handlers):
            self.generic = handlers

        def add_registered_method_handlers(self, name, handlers):
            self.name, self.handlers = name, handlers

    server = Recorder()
    add_to_server(ParameterServicer(ParameterStore.from_model(small_model())), server)
    methods = paramserver_pb2.DESCRIPTOR.services_by_name["ParameterService"].methods
    assert server.name == SERVICE_NAME and set(server.handlers) == {m.name for m in methods}
    assert len(server.generic) == 1


def test_a_new_server_life_sends_its_weights_even_under_the_version_number_held(start_server, raw_stub):
    # Two lives of "the" parameter server with the same version number and other weights,
    # as after a restart from an older checkpoint.
    first, c1 = start_server(small_model(seed=0))
    second, c2 = start_server(small_model(seed=1))
    c1.push(0, fp32_grads(first), batch_size=8)
    c2.push(0, fp32_grads(second), batch_size=8)
    one = c1.pull_versioned(0, 0)
    assert one.version == 1 and one.incarnation != 0
    assert c1.info().incarnation == one.incarnation
    # the same life: the number is enough
    assert c1.pull_versioned(1, one.incarnation).weights is None
    assert c1.push(1, fp32_grads(first)).incarnation == one.incarnation
    # another life: weights, though the numbers match
    two = c2.pull_versioned(1, one.incarnation)
    assert two.version == 1 and two.incarnation not in (0, one.incarnation)
    assert all(torch.equal(two.weights[n], second.store.params[n].detach()) for n in two.weights)
    # a client blind to incarnations (have_incarnation 0) keeps the old rule
    assert c2.pull_versioned(1, 0).weights is None
    # a watch of another life announces at once
    stub = raw_stub(c2)
    first_msg = next(iter(stub.WatchParameters(paramserver_pb2.WatchParametersRequest(
        have_version=1, have_incarnation=one.incarnation), timeout=5)))
    assert (first_msg.version, first_msg.incarnation) == (1, two.incarnation)


def test_a_push_whose_caller_went_away_while_it_waited_is_not_applied(start_server, raw_stub):
    # max_staleness 4: a push based one version ahead waits (up to reorder_wait_s) for the
    # push before it. Its caller gives up after 0.3 s; the push before it then arrives.
    ps, client = start_server(max_staleness=4)
    stub = raw_stub(client)
    early = stub.PushGradients.future(paramserver_pb2.PushGradientsRequest(
        base_version=1, gradients=fp32_grads(ps), learner_id="learner-0"), timeout=0.3)
    with pytest.raises(grpc.RpcError) as gone:
        early.result()
    assert gone.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert client.push(0, fp32_grads(ps, seed=1)).version == 1
    deadline = time.monotonic() + 5
    while client.info().pushes_abandoned == 0:
        assert time.monotonic() < deadline, "the abandoned push was never accounted for"
        time.sleep(0.05)
    time.sleep(0.2)
    assert client.info().version == 1  # only the push whose caller waited for it


def test_a_numbered_push_is_applied_once_and_a_resend_gets_its_first_outcome(start_server, raw_stub):
    ps, client = start_server(max_staleness=1)
    stub = raw_stub(client)

    def push(base, sequence, seed=0):
        return stub.PushGradients(paramserver_pb2.PushGradientsRequest(
            learner_id="learner-0", learner_incarnation=5, sequence=sequence,
            base_version=base, gradients=fp32_grads(ps, seed=seed)), timeout=5)

    first = push(0, 1)
    assert (first.version, first.repeat) == (1, False)
    weights = {n: p.detach().clone() for n, p in ps.store.params.items()}
    again = push(0, 1)  # its reply was lost: the learner sends it again
    assert (again.version, again.staleness, again.repeat) == (1, 0, True)
    assert all(torch.equal(ps.store.params[n].detach(), w) for n, w in weights.items())
    assert push(1, 2, seed=1).version == 2  # the next one is a new push
    # a refused push is refused again, with the same answer, and nothing moves
    push(2, 3, seed=2), push(3, 4, seed=3)
    for _ in range(2):
        with pytest.raises(grpc.RpcError) as stale:
            push(0, 9, seed=9)
        assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert client.info().version == 4
    # another incarnation of the learner (a restart) numbers anew
    fresh = stub.PushGradients(paramserver_pb2.PushGradientsRequest(
        learner_id="learner-0", learner_incarnation=6, sequence=1, base_version=4,
        gradients=fp32_grads(ps, seed=4)), timeout=5)
    assert (fresh.version, fresh.repeat) == (5, False)
    # the client numbers every push it sends
    assert client.push(5, fp32_grads(ps, seed=5)).repeat is False
    info = client.info()
    assert info.version == 6
    assert info.pushes_repeated == 2  # an applied push and a refused one, each answered again
    # steps applied per learner id: what a ledger of acknowledged pushes is checked against
    assert dict(info.steps_applied_by_learner) == {"learner-0": 6}
