"""The parameter server's read-only pull port, and TLS settings that are missing or
incomplete (mutual TLS itself: test_mtls.py)."""

from __future__ import annotations

import grpc
import pytest
import torch
from torch import nn

from amprl import errors
from amprl.common import channels, grpcutil
from amprl.wire.compressed import encode
from amprl.config import ExperimentConfig
from amprl.paramserver.client import ParameterClient
from amprl.paramserver.service import create_server

from .tls import make_role_dirs


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def grads_of(ps) -> list:
    return [encode(name, torch.ones_like(p), "fp32") for name, p in ps.store.params.items()]


@pytest.fixture
def paramserver():
    started = []

    def start():
        ps = create_server(ExperimentConfig(), model(), host="127.0.0.1", port=0, pull_port=0)
        started.append(ps)
        return ps

    yield start
    for ps in started:
        ps.stop(0)


def test_the_pull_port_serves_reads_and_refuses_pushes(paramserver):
    ps = paramserver()
    assert ps.pull_port and ps.pull_port != ps.port
    with ParameterClient(f"127.0.0.1:{ps.pull_port}", "actor:a-0") as reader, \
            ParameterClient(f"127.0.0.1:{ps.port}", "learner:l-0") as writer:
        channels.wait_until_serving(f"127.0.0.1:{ps.pull_port}", timeout_s=10)
        version, weights = reader.pull()
        assert version == 0 and set(weights) == set(ps.store.params)
        with pytest.raises(grpc.RpcError) as denied:
            reader.push(version, grads_of(ps))
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "main port" in denied.value.details()
        assert ps.store.version == 0  # nothing was applied
        assert writer.push(version, grads_of(ps)).version == 1
        with reader.watch(0) as watch:
            assert watch.next(timeout=5) == 1
        # Both ports share one store, so Info agrees on versions and live clients.
        assert reader.info().version == writer.info().version == 1
        assert reader.info().actors_live == 1 and reader.info().learners_live == 1


def test_a_missing_certificate_file_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("AMPRL_TLS_CERT_DIR", str(tmp_path))
    with pytest.raises(errors.ConfigError, match="tls.key"):
        grpcutil.create_server([], host="127.0.0.1", port=0)
    with pytest.raises(errors.ConfigError, match="ca.crt"):
        channels.make_channel("127.0.0.1:1", server_role="paramserver")


def test_with_tls_on_a_client_must_name_the_role_of_its_server(tmp_path, monkeypatch):
    roles = make_role_dirs(tmp_path / "tls")
    monkeypatch.setenv("AMPRL_TLS_CERT_DIR", str(roles["actor"]))
    with pytest.raises(errors.ConfigError, match="role of the server"):
        channels.make_channel("127.0.0.1:1")
