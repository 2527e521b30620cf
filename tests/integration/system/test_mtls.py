"""Mutual TLS with roles on real servers over loopback: the parameter server (a
synchronous gRPC server) and replay (``grpc.aio``, on a real Redis), each with its own
role's certificate, and clients holding each role's certificate in turn.

What the issue asks of identity: a client without a certificate is refused at the
handshake; a certificate from another CA too; a role that an RPC does not admit gets
PERMISSION_DENIED naming the role it needs, and nothing is applied; the roles that it
admits are served; a server holding another role's certificate is refused by the client.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
from torch import nn

from amprl import errors
from amprl.common import certs, channels
from amprl.common.redis_server import EmbeddedRedis
from amprl.config import ExperimentConfig
from amprl.paramserver.client import ParameterClient
from amprl.paramserver.service import create_server as create_paramserver
from amprl.replay.client import ReplayClient
from amprl.replay.service import create_server as create_replay
from amprl.wire.compressed import encode
from amprl_testing.replay import make_chunk, vector_spec

from .tls import make_role_dirs


@pytest.fixture
def system(tmp_path, monkeypatch):
    """A parameter server and a replay server with mutual TLS, each started with its own
    role's certificate; ``as_role(role)`` points this process's clients at another."""
    roles = make_role_dirs(tmp_path / "tls")
    monkeypatch.setenv("AMPRL_TLS_SERVER_NAME", "amprl.test")

    def as_role(role):
        monkeypatch.setenv("AMPRL_TLS_CERT_DIR", str(roles[role]))

    redis = EmbeddedRedis(tmp_path / "redis")
    started = []
    try:
        as_role("paramserver")
        torch.manual_seed(0)
        ps = create_paramserver(ExperimentConfig(), nn.Sequential(nn.Linear(4, 2)),
                                host="127.0.0.1", port=0)
        started.append(lambda: ps.stop(0))
        as_role("replay")
        cfg = ExperimentConfig()
        cfg.replay.min_size_to_sample = 1
        rs = create_replay(cfg, vector_spec(), redis.url, "127.0.0.1", 0, prefix="mtls", seed=0)
        started.append(lambda: rs.stop(0))
        yield type("System", (), {"ps": ps, "rs": rs, "roles": roles, "as_role": staticmethod(as_role),
                                  "ps_address": f"127.0.0.1:{ps.port}",
                                  "replay_address": f"127.0.0.1:{rs.port}"})
    finally:
        for stop in reversed(started):
            stop()
        redis.stop()


def grads_of(ps) -> list:
    return [encode(name, torch.full_like(p, 0.01), "fp32") for name, p in ps.store.params.items()]


def items(n=2, t=8):
    spec = vector_spec()
    return [(make_chunk(spec, t, seed=i), np.ones(t, np.float32), t) for i in range(n)]


def denied(call) -> str:
    with pytest.raises(grpc.RpcError) as exc:
        call()
    assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED, exc.value
    return exc.value.details()


def test_only_a_learner_certificate_pushes_gradients(system):
    system.as_role("actor")
    with ParameterClient(system.ps_address, "actor:a-0", timeout_s=10) as actor:
        version, _ = actor.pull()  # every role reads weights
        why = denied(lambda: actor.push(version, grads_of(system.ps)))
        assert "PushGradients needs the learner role" in why and "the actor role" in why
    assert system.ps.store.version == 0  # nothing applied
    system.as_role("learner")
    with ParameterClient(system.ps_address, "learner:l-0", timeout_s=10) as learner:
        assert learner.push(0, grads_of(system.ps)).version == 1
    for role in ("evaluator", "operator", "replay", "paramserver"):
        system.as_role(role)
        with ParameterClient(system.ps_address, f"{role}:x", timeout_s=10) as reader:
            assert reader.pull()[0] == 1 and reader.info().version == 1
            denied(lambda: reader.push(1, grads_of(system.ps)))
    assert system.ps.store.version == 1


def test_only_actors_insert_and_only_learners_sample_and_reprioritize(system):
    system.as_role("learner")
    with ReplayClient(system.replay_address) as learner:
        why = denied(lambda: learner.insert("learner-0", items()))
        assert "Insert needs the actor role" in why
    system.as_role("actor")
    with ReplayClient(system.replay_address) as actor:
        assert actor.insert("actor-0", items()).chunks_stored == 2
        assert "Sample needs the learner role" in denied(lambda: actor.sample(4, beta=0.4))
        denied(lambda: actor.update_priorities(np.array([0]), np.array([2.0])))
        assert actor.info().size == 16
    system.as_role("learner")
    with ReplayClient(system.replay_address) as learner:
        batch = learner.sample(4, beta=0.4)
        assert learner.update_priorities(batch.keys, np.full(4, 2.0)).updated == len(set(batch.keys))
    system.as_role("operator")
    with ReplayClient(system.replay_address) as operator:
        assert operator.info().size == 16
        denied(lambda: operator.insert("actor-9", items()))


def test_a_client_without_a_certificate_or_from_another_ca_is_refused(system, tmp_path):
    with grpc.insecure_channel(system.ps_address) as plain:
        with pytest.raises(grpc.FutureTimeoutError):
            grpc.channel_ready_future(plain).result(timeout=2)
    ca = (system.roles["actor"] / "ca.crt").read_bytes()
    server_only = grpc.ssl_channel_credentials(root_certificates=ca)  # trusts, presents nothing
    options = [("grpc.ssl_target_name_override", "paramserver.amprl.test")]
    with grpc.secure_channel(system.ps_address, server_only, options=options) as anonymous:
        with pytest.raises(grpc.FutureTimeoutError):
            grpc.channel_ready_future(anonymous).result(timeout=2)
    # A learner certificate, but signed by a CA of someone else's making.
    stranger = certs.make_role_certs(tmp_path / "other", roles=("learner",), server_name="amprl.test")
    foreign = grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=(stranger["learner"] / "tls.key").read_bytes(),
        certificate_chain=(stranger["learner"] / "tls.crt").read_bytes())
    with grpc.secure_channel(system.ps_address, foreign, options=options) as impostor:
        with pytest.raises(grpc.FutureTimeoutError):
            grpc.channel_ready_future(impostor).result(timeout=2)
    assert system.ps.store.version == 0


def test_a_server_with_another_roles_certificate_is_not_trusted(system):
    # The replay server holds the replay certificate; a client that means to reach the
    # parameter server there (expecting paramserver.amprl.test) refuses it.
    system.as_role("learner")
    with ParameterClient(system.replay_address, "learner:l-0", timeout_s=2) as confused:
        with pytest.raises((errors.Unavailable, errors.DeadlineExceeded)):
            confused.info()
    channels.wait_until_serving(system.replay_address, timeout_s=10, server_role="replay")


def test_grpcurl_with_the_operator_certificate_reads_and_without_one_is_refused(system):
    """The README's grpcurl line, with the real grpcurl binary."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    binary = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    operator = system.roles["operator"]

    def grpcurl(*args, cert=True):
        tls = ["-cacert", str(operator / "ca.crt"), "-servername", "replay.amprl.test"]
        if cert:
            tls += ["-cert", str(operator / "tls.crt"), "-key", str(operator / "tls.key")]
        return subprocess.run([binary, "-max-time", "10", *tls, *args], capture_output=True,
                              text=True, timeout=30)

    info = grpcurl("-d", "{}", system.replay_address, "amprl.v1.ReplayService/Info")
    assert info.returncode == 0 and '"capacity"' in info.stdout, info.stderr
    listed = grpcurl(system.replay_address, "list")  # reflection: open to every role
    assert "amprl.v1.ReplayService" in listed.stdout, listed.stderr
    sample = grpcurl("-d", '{"batch_size": 1}', system.replay_address, "amprl.v1.ReplayService/Sample")
    assert sample.returncode != 0 and "PermissionDenied" in sample.stderr, sample.stderr
    assert "needs the learner role" in sample.stderr
    anonymous = grpcurl("-d", "{}", system.replay_address, "amprl.v1.ReplayService/Info", cert=False)
    assert anonymous.returncode != 0, anonymous.stdout


def test_a_certificate_of_another_release_from_the_same_ca_is_refused(system, tmp_path, monkeypatch):
    # Two releases whose issuer shares one CA: the other release's learner may not push here.
    ca = certs.load_ca(system.roles["learner"].parent / "ca")
    other = certs.issue(ca, tmp_path / "other-learner", "learner", release="other-run",
                        server_name="amprl.test")
    monkeypatch.setenv("AMPRL_TLS_CERT_DIR", str(other))
    with ParameterClient(system.ps_address, "learner:other", timeout_s=10) as stranger:
        why = denied(lambda: stranger.push(0, grads_of(system.ps)))
        assert "release 'test'" in why and "release 'other-run'" in why
    assert system.ps.store.version == 0


def test_a_renewed_server_certificate_is_used_without_a_restart(system, tmp_path):
    # Rotate everything to a new CA: the parameter server's mounted files are replaced in
    # place (as the kubelet does for a renewed Secret); new connections use the new pair.
    fresh = make_role_dirs(tmp_path / "rotated")
    old_learner = system.roles["learner"] / "old"
    old_learner.mkdir()
    for name in ("tls.crt", "tls.key", "ca.crt"):
        (old_learner / name).write_bytes((system.roles["learner"] / name).read_bytes())
        (system.roles["paramserver"] / name).write_bytes((fresh["paramserver"] / name).read_bytes())
    system.as_role("learner")  # still the old CA's
    with ParameterClient(system.ps_address, "learner:old", timeout_s=2) as old:
        with pytest.raises((errors.Unavailable, errors.DeadlineExceeded)):
            old.info()
    for name in ("tls.crt", "tls.key", "ca.crt"):
        (system.roles["learner"] / name).write_bytes((fresh["learner"] / name).read_bytes())
    with ParameterClient(system.ps_address, "learner:new", timeout_s=10) as new:
        assert new.push(0, grads_of(system.ps)).version == 1
