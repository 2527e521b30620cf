"""Bounded updates on a live ParameterService: a push far too large (a finite 1e20
gradient, a 1-bit tensor with a huge scale) is refused with INVALID_ARGUMENT and counted in
Info, and training afterwards lands on exactly the weights of a run that never saw it."""

import grpc
import pytest
import torch
from torch import nn

from amprl import errors
from amprl.config import config_from_dict
from amprl.paramserver.client import ParameterClient
from amprl.paramserver.service import create_server
from amprl.v1 import paramserver_pb2, paramserver_pb2_grpc, tensor_pb2
from amprl.wire.compressed import ErrorFeedback, encode

PUSHES = 160
"""Normal pushes per run: past paramserver.push_norm_window (100), so both the absolute cap
and the ratio to the median of recent norms are tried."""

ATTACKS_AT = (20, 130)
"""Before which normal push each huge push comes: in the warm-up, and after it."""


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))


@pytest.fixture
def start_server():
    started = []

    def start():
        cfg = config_from_dict({"paramserver": {"lr": 1e-3}})
        ps = create_server(cfg, model(), host="127.0.0.1", port=0)
        client = ParameterClient(f"127.0.0.1:{ps.port}", "learner-0", timeout_s=10)
        started.append((ps, client))
        return ps, client

    yield start
    for ps, client in started:
        client.close()
        ps.stop(grace_s=0)


def normal_gradients(shapes: dict, encoding: str) -> list[list[tensor_pb2.CompressedTensor]]:
    """The pushes of a run: gradients with a steady direction and noise, fp32 (norm ~2.6)
    or 1-bit with error feedback and preconditioning, as a learner sends them (decoded
    norm ~39)."""
    g = torch.Generator().manual_seed(1)
    drift = {n: torch.randn(s, generator=g) * 0.05 for n, s in shapes.items()}
    ef = ErrorFeedback("onebit", block_size=64, min_elements=64, precondition=True)
    pushes = []
    for _ in range(PUSHES):
        grads = {n: drift[n] + torch.randn(s, generator=g) * 0.05 for n, s in shapes.items()}
        pushes.append(ef.compress(grads) if encoding == "onebit"
                      else [encode(n, t, "fp32") for n, t in grads.items()])
    return pushes


def huge_fp32(shapes: dict, value: float) -> list[tensor_pb2.CompressedTensor]:
    return [encode(n, torch.full(s, value), "fp32") for n, s in shapes.items()]


def huge_scale(push: list[tensor_pb2.CompressedTensor], scale: float) -> list[tensor_pb2.CompressedTensor]:
    """``push`` with the first block scale of its first 1-bit tensor set to ``scale``."""
    out = [tensor_pb2.CompressedTensor.FromString(m.SerializeToString()) for m in push]
    target = next(m for m in out if m.encoding == tensor_pb2.ENCODING_ONE_BIT)
    target.scales = torch.tensor([scale], dtype=torch.float32).numpy().tobytes() + target.scales[4:]
    return out


def train(client: ParameterClient, pushes, attacks: dict) -> list[str]:
    """Pushes ``pushes`` in order, each ``attacks[i]`` just before push i; the refusals'
    messages (a huge push that is applied fails the test)."""
    refusals = []
    for i, grads in enumerate(pushes):
        if i in attacks:
            with pytest.raises(errors.InvalidArgument) as err:
                client.push(i, attacks[i], batch_size=32)
            refusals.append(str(err.value))
        assert client.push(i, grads, batch_size=32).version == i + 1
    return refusals


def moved(ps) -> float:
    start = dict(model().named_parameters())
    return float(torch.sqrt(sum(((p.detach() - start[n].detach()) ** 2).sum()
                                for n, p in ps.store.params.items())))


@pytest.mark.parametrize("encoding", ["fp32", "onebit"])
def test_huge_pushes_are_refused_and_training_lands_where_it_would_without_them(start_server, encoding):
    control_ps, control = start_server()
    ps, client = start_server()
    shapes = ps.store.shapes
    pushes = normal_gradients(shapes, encoding)
    if encoding == "fp32":  # a finite 1e20 gradient; then 1e3 (norm 3.6e4: under the cap, 1.4e4 x the median)
        attacks = {ATTACKS_AT[0]: huge_fp32(shapes, 1e20), ATTACKS_AT[1]: huge_fp32(shapes, 1e3)}
    else:  # one block scale of 1e36; then of 1e4 (a decoded norm of 8e4, 2e3 x the median)
        attacks = {at: huge_scale(pushes[at], scale) for at, scale in zip(ATTACKS_AT, (1e36, 1e4))}

    assert train(control, pushes, {}) == []
    refusals = train(client, pushes, attacks)

    assert "exceeds the bound 1e+06 (paramserver.max_push_norm, until 100 steps" in refusals[0]
    assert "paramserver.max_push_norm_ratio 100 x " in refusals[1]
    _, weights = client.pull()
    _, control_weights = control.pull()
    assert all(torch.equal(weights[n], control_weights[n]) for n in weights)
    assert moved(ps) == moved(control_ps) > 0.1
    info = client.info()
    assert (info.version, info.pushes_applied, info.pushes_rejected_norm,
            info.pushes_rejected_invalid) == (PUSHES, PUSHES, 2, 0)
    assert info.push_norm_bound == control.info().push_norm_bound == ps.store.norm_bound.bound
    assert 10.0 <= info.push_norm_bound < 1e6  # past the warm-up: the ratio's bound


def test_a_refused_push_is_refused_again_when_resent(start_server):
    """A numbered push refused for its size gets the same answer on a resend (the ledger
    keeps the first outcome), so a retrying client cannot wear the bound down."""
    ps, client = start_server()
    request = paramserver_pb2.PushGradientsRequest(
        learner_id="learner-0", base_version=0, gradients=huge_fp32(ps.store.shapes, 1e20),
        learner_incarnation=7, sequence=1)
    with grpc.insecure_channel(client.address) as channel:
        stub = paramserver_pb2_grpc.ParameterServiceStub(channel)
        for _ in range(2):
            with pytest.raises(grpc.RpcError) as err:
                stub.PushGradients(request, timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "gradient norm 3.581e+21 exceeds the bound 1e+06" in err.value.details()
    info = client.info()
    assert (info.version, info.pushes_rejected_norm, info.pushes_repeated) == (0, 1, 1)
