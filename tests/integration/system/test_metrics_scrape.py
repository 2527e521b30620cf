"""``/metrics`` of real servers, scraped over HTTP: the parameter server (a synchronous gRPC
server, with its pull port) and replay (``grpc.aio``, on a real Redis), each with its
series (``<service>/telemetry.py``), after real calls: the figures agree with what was
done, every RPC is timed and counted with its status code, refused calls included (by a
synchronous servicer, by a ``grpc.aio`` one, and with mutual TLS by the authorization
interceptor, which runs inside the counting one); ``/metrics`` itself stays plain HTTP
when gRPC speaks mutual TLS."""

from __future__ import annotations

import urllib.request

import grpc
import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

from amprl import errors
from amprl.common.metrics import MetricsServer
from amprl.common.redis_server import EmbeddedRedis
from amprl.config import ExperimentConfig
from amprl.paramserver.client import ParameterClient
from amprl.paramserver.service import create_server as create_paramserver
from amprl.paramserver.telemetry import telemetry as paramserver_telemetry
from amprl.replay.client import ReplayClient
from amprl.replay.service import create_server as create_replay
from amprl.replay.telemetry import telemetry as replay_telemetry
from amprl.wire.compressed import encode
from amprl_testing.replay import make_chunk, vector_spec

from .tls import make_role_dirs

PS = "amprl.v1.ParameterService"
REPLAY = "amprl.v1.ReplayService"


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample, sorted labels): value} from GET /metrics, parsed as Prometheus parses it."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def handled(got: dict, service: str, method: str, code: str) -> float:
    return sum(v for (name, labels), v in got.items() if name == "grpc_server_handled_total"
               and dict(labels).get("grpc_service") == service and dict(labels).get("grpc_method") == method
               and dict(labels).get("grpc_code") == code)


def latency_count(got: dict, service: str, method: str) -> float:
    return sum(v for (name, labels), v in got.items() if name == "grpc_server_handling_seconds_count"
               and dict(labels).get("grpc_service") == service and dict(labels).get("grpc_method") == method)


@pytest.fixture
def system(tmp_path, monkeypatch, request):
    """A parameter server (main and pull port) and a replay server, each with its /metrics;
    with ``request.param`` "tls", mutual TLS, each server holding its role's certificate.
    ``as_role(role)`` points this process's clients at a role's certificate."""
    tls = getattr(request, "param", "plaintext") == "tls"
    roles = make_role_dirs(tmp_path / "tls") if tls else {}

    def as_role(role):
        if tls:
            monkeypatch.setenv("AMPRL_TLS_CERT_DIR", str(roles[role]))

    if tls:
        monkeypatch.setenv("AMPRL_TLS_SERVER_NAME", "amprl.test")
    redis = EmbeddedRedis(tmp_path / "redis")
    started = []
    try:
        as_role("paramserver")
        torch.manual_seed(0)
        ps = create_paramserver(ExperimentConfig(), nn.Sequential(nn.Linear(4, 2)), host="127.0.0.1",
                                port=0, pull_port=0)
        started.append(lambda: ps.stop(0))
        ps_metrics = MetricsServer.start(paramserver_telemetry(ps.servicer), host="127.0.0.1",
                                         port="any", instance="paramserver")
        started.append(ps_metrics.stop)
        as_role("replay")
        cfg = ExperimentConfig()
        cfg.replay.min_size_to_sample = 1
        rs = create_replay(cfg, vector_spec(), redis.url, "127.0.0.1", 0, prefix="metrics", seed=0)
        started.append(lambda: rs.stop(0))
        rs_metrics = MetricsServer.start(replay_telemetry(rs), host="127.0.0.1", port="any",
                                         instance="replay")
        started.append(rs_metrics.stop)
        yield type("System", (), {"ps": ps, "rs": rs, "as_role": staticmethod(as_role),
                                  "ps_metrics": ps_metrics.port, "rs_metrics": rs_metrics.port})
    finally:
        for stop in reversed(started):
            stop()
        redis.stop()


def grads(ps, encoding: str) -> list:
    return [encode(name, torch.full_like(p, 0.01), encoding) for name, p in ps.store.params.items()]


def chunks(n: int = 2, t: int = 8) -> list:
    return [(make_chunk(vector_spec(), t, seed=i), np.ones(t, np.float32), t) for i in range(n)]


def test_the_parameter_server_serves_its_figures_and_every_call_with_its_code(system):
    before = scrape(system.ps_metrics)
    with ParameterClient(f"127.0.0.1:{system.ps.port}", "learner:l-0", timeout_s=10) as learner:
        assert learner.push(0, grads(system.ps, "fp32")).version == 1
        assert learner.push(1, grads(system.ps, "bf16")).version == 2
    with ParameterClient(f"127.0.0.1:{system.ps.pull_port}", "actor:a-0", timeout_s=10) as actor:
        assert actor.pull(encoding="bf16")[0] == 2
        with pytest.raises(grpc.RpcError) as refused:  # the pull port takes no pushes
            actor.push(2, grads(system.ps, "fp32"))
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    got = scrape(system.ps_metrics)
    assert got[("amprl_paramserver_version", ())] == 2
    assert got[("amprl_paramserver_pushes_applied_total", ())] == 2
    assert got[("amprl_paramserver_pushes_rejected_norm_total", ())] == 0
    assert got[("amprl_paramserver_push_norm_bound", ())] > 0
    assert got[("amprl_paramserver_pulls_with_weights_total", ())] == 1
    assert got[("amprl_paramserver_actors_live", ())] == 1
    assert got[("amprl_paramserver_learners_live", ())] == 1
    n = sum(p.numel() for p in system.ps.store.params.values())  # 10 parameters
    received = {dict(labels)["encoding"]: v for (name, labels), v in got.items()
                if name == "amprl_paramserver_gradient_bytes_received_total"}
    assert received == {"fp32": 4 * n, "bf16": 2 * n}
    sent = {dict(labels)["encoding"]: v for (name, labels), v in got.items()
            if name == "amprl_paramserver_weight_bytes_sent_total"}
    assert set(sent) == {"bf16"} and sent["bf16"] > 2 * n  # the tensors and their framing
    assert handled(got, PS, "PushGradients", "OK") - handled(before, PS, "PushGradients", "OK") == 2
    assert (handled(got, PS, "PushGradients", "PERMISSION_DENIED")
            - handled(before, PS, "PushGradients", "PERMISSION_DENIED")) == 1
    assert handled(got, PS, "PullParameters", "OK") - handled(before, PS, "PullParameters", "OK") == 1
    assert latency_count(got, PS, "PushGradients") - latency_count(before, PS, "PushGradients") == 3
    seconds = [v for (name, labels), v in got.items() if name == "grpc_server_handling_seconds_sum"
               and dict(labels)["grpc_method"] == "PushGradients"]
    assert 0 < sum(seconds) < 30
    assert got[("amprl_service_info", (("id", "paramserver"), ("service", "paramserver")))] == 1
    assert got[("process_resident_memory_bytes", ())] > 0


def test_replay_serves_its_figures_and_its_calls_with_their_codes(system):
    before = scrape(system.rs_metrics)
    with ReplayClient(f"127.0.0.1:{system.rs.port}") as client:
        assert client.insert("actor-0", chunks()).chunks_stored == 2
        batch = client.sample(4, beta=0.4)
        client.update_priorities(batch.keys, np.full(4, 2.0))
        with pytest.raises(errors.InvalidArgument):  # the client's error for INVALID_ARGUMENT
            client.sample(0, beta=0.4)
        info = client.info()
    got = scrape(system.rs_metrics)
    assert got[("amprl_replay_size", ())] == info.size == 16
    assert got[("amprl_replay_inserted_total", ())] == 16
    assert got[("amprl_replay_sampled_total", ())] == 4
    assert got[("amprl_replay_priority_updates_total", ())] == info.priority_updates_total > 0
    assert got[("amprl_replay_actors_live", ())] == 1
    assert got[("amprl_replay_rate_limiter_waiting_samples", ())] == 0
    assert got[("amprl_replay_rate_limiter_sample_wait_seconds_total", ())] >= 0
    assert got[("amprl_replay_capacity", ())] == ExperimentConfig().replay.capacity
    assert handled(got, REPLAY, "Insert", "OK") - handled(before, REPLAY, "Insert", "OK") == 1
    assert handled(got, REPLAY, "Sample", "OK") - handled(before, REPLAY, "Sample", "OK") == 1
    assert (handled(got, REPLAY, "Sample", "INVALID_ARGUMENT")
            - handled(before, REPLAY, "Sample", "INVALID_ARGUMENT")) == 1
    assert handled(got, REPLAY, "Info", "OK") - handled(before, REPLAY, "Info", "OK") == 1
    types = {dict(labels)["grpc_type"] for (name, labels), _ in got.items()
             if name == "grpc_server_handled_total" and dict(labels)["grpc_service"] == REPLAY}
    assert types == {"client_stream", "unary"}


@pytest.mark.parametrize("system", ["tls"], indirect=True)
def test_with_mutual_tls_a_call_the_role_may_not_make_is_counted_and_metrics_stay_plain_http(system):
    before = scrape(system.ps_metrics)  # plain HTTP while every gRPC port wants a certificate
    system.as_role("actor")
    with ParameterClient(f"127.0.0.1:{system.ps.port}", "actor:a-0", timeout_s=10) as actor:
        with pytest.raises(grpc.RpcError) as refused:
            actor.push(0, grads(system.ps, "fp32"))
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    system.as_role("learner")
    with ReplayClient(f"127.0.0.1:{system.rs.port}") as learner:
        with pytest.raises(grpc.RpcError) as refused:
            learner.insert("learner-0", chunks())
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    got = scrape(system.rs_metrics)
    for service, method in ((PS, "PushGradients"), (REPLAY, "Insert")):
        assert (handled(got, service, method, "PERMISSION_DENIED")
                - handled(before, service, method, "PERMISSION_DENIED")) == 1, method
    assert scrape(system.ps_metrics)[("amprl_paramserver_version", ())] == 0  # nothing applied
    assert scrape(system.rs_metrics)[("amprl_replay_size", ())] == 0
