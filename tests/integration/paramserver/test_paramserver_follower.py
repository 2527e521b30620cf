"""Pull-only followers (``amprl paramserver --follow``): a main server and its followers as
real gRPC servers on loopback, and once as real processes."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from torch import nn

from amprl import errors
from amprl.common import channels
from amprl.wire.compressed import encode
from amprl.config import config_from_dict
from amprl.paramserver import __main__ as ps_main
from amprl.paramserver import service
from amprl.paramserver.client import ParameterClient
from amprl.paramserver.follower import create_follower
from amprl.paramserver.service import create_server
from amprl.paramserver.store import build_store

FAST = {"poll_s": 0.1, "retry_watch_s": 60.0, "backoff_s": (0.05, 0.2), "pull_timeout_s": 2.0}


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def grads(ps, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [encode(n, torch.randn(s, generator=g), "fp32") for n, s in ps.store.shapes.items()]


def wait_for(predicate, timeout_s: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def health(address: str) -> int:
    with channels.make_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5).status


@pytest.fixture
def servers():
    """Starts mains (``main``) and followers (``follower``); stops them all at the end."""
    started, clients = [], []

    class Servers:
        def main(self, seed: int = 0, port: int = 0, **kwargs):
            ps = create_server(config_from_dict({"paramserver": {"lr": 1e-2}}), model(seed),
                               host="127.0.0.1", port=port, pull_port=0, **kwargs)
            started.append(ps)
            return ps

        def follower(self, main_address: str, m: nn.Module | None = None, **kwargs):
            fs = create_follower(m or model(), main_address, host="127.0.0.1", port=0,
                                 client_id="follower:test", **{**FAST, **kwargs})
            started.append(fs)
            return fs

        def client(self, port: int, client_id: str) -> ParameterClient:
            c = ParameterClient(f"127.0.0.1:{port}", client_id, timeout_s=10)
            clients.append(c)
            return c

    yield Servers()
    for c in clients:
        c.close()
    for s in reversed(started):
        s.stop(0)


def test_a_follower_serves_each_version_of_the_main_server(servers, monkeypatch):
    encodings = []
    real_encode = service.encode
    monkeypatch.setattr(service, "encode", lambda *a: encodings.append(a[2]) or real_encode(*a))
    main = servers.main()
    fs = servers.follower(f"127.0.0.1:{main.pull_port}")
    learner = servers.client(main.port, "learner-0")
    channels.wait_until_serving(f"127.0.0.1:{fs.port}", timeout_s=10)
    tensors = len(main.store.shapes)
    for version in range(1, 4):
        learner.push(version - 1, grads(main, version))
        wait_for(lambda: fs.server.store.version == version, what=f"version {version}")
        encodings.clear()
        # A fleet of 24 pullers in three encodings: each encoding made once, from the
        # fp32 weights the follower pulled once.
        pullers = [servers.client(fs.port, f"actor-{i}") for i in range(24)]
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            pulled = list(pool.map(lambda ic: ic[1].pull(encoding=("fp32", "bf16", "fp16")[ic[0] % 3]),
                                   enumerate(pullers)))
        assert sorted(encodings) == sorted(["bf16", "fp16", "fp32"] * tensors)
        for i, (v, weights) in enumerate(pulled):
            tol = (0, 2**-8, 2**-11)[i % 3]
            assert v == version
            assert all(torch.allclose(weights[n], p.detach(), rtol=tol, atol=1e-6)
                       for n, p in main.store.params.items())
    # One fp32 pull of each version reached the main server (the first one whole).
    assert fs.follower.pulls == learner.info().pulls_with_weights == 4
    info = servers.client(fs.port, "evaluator").info()
    assert info.version == 3 and info.num_tensors == tensors and info.pushes_applied == 0
    assert info.pulls_with_weights == 3 * 24 and info.actors_live == 24


def test_a_follower_refuses_pushes_naming_the_main_server(servers):
    main = servers.main()
    address = f"127.0.0.1:{main.pull_port}"
    fs = servers.follower(address)
    channels.wait_until_serving(f"127.0.0.1:{fs.port}", timeout_s=10)
    with pytest.raises(grpc.RpcError) as denied:
        servers.client(fs.port, "learner-0").push(0, grads(main))
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert address in denied.value.details() and "follower" in denied.value.details()
    assert main.store.version == 0


def test_a_follower_is_not_serving_until_it_holds_weights(servers):
    port = free_port()  # the main server starts later, on this port
    fs = servers.follower(f"127.0.0.1:{port}")
    address = f"127.0.0.1:{fs.port}"
    assert health(address) == health_pb2.HealthCheckResponse.NOT_SERVING
    actor = servers.client(fs.port, "actor-0")
    with pytest.raises(errors.Unavailable, match="no weights yet"):
        actor.pull(timeout=10.0)  # gRPC retries it (UNAVAILABLE), then reports the last answer
    with pytest.raises(errors.Unavailable, match="no weights yet"):
        actor.watch(0).next(timeout=5)
    assert actor.info().version == 0  # Info answers all along
    main = servers.main(seed=1, port=port)
    learner = servers.client(main.port, "learner-0")
    learner.push(0, grads(main))
    channels.wait_until_serving(address, timeout_s=10)
    wait_for(lambda: fs.server.store.version == 1, what="version 1")
    version, weights = actor.pull()
    assert version == 1
    assert all(torch.equal(weights[n], p.detach()) for n, p in main.store.params.items())


def test_a_follower_polls_when_the_main_server_refuses_its_watch(servers):
    main = servers.main(max_watchers=1)
    other = servers.client(main.pull_port, "actor-x")
    with other.watch(0) as taken:  # the main server's only watch stream
        assert taken.next(timeout=5) == 0
        fs = servers.follower(f"127.0.0.1:{main.pull_port}")
        channels.wait_until_serving(f"127.0.0.1:{fs.port}", timeout_s=10)
        learner = servers.client(main.port, "learner-0")
        for version in range(1, 4):
            learner.push(version - 1, grads(main, version))
            wait_for(lambda: fs.server.store.version == version, timeout_s=5, what=f"version {version}")
        assert main.servicer._watchers == 1
    # The follower's own watchers are served as ever.
    with servers.client(fs.port, "actor-0").watch(0) as watch:
        assert watch.next(timeout=5) == 3


def test_a_follower_keeps_serving_through_a_main_server_restart_and_adopts_its_weights(servers):
    main = servers.main()
    port = main.pull_port
    fs = servers.follower(f"127.0.0.1:{port}")
    learner = servers.client(main.port, "learner-0")
    for version in range(1, 3):
        learner.push(version - 1, grads(main, version))
    wait_for(lambda: fs.server.store.version == 2, what="version 2")
    actor = servers.client(fs.port, "actor-0")
    _, before = actor.pull()
    old_life = actor.pull_versioned(0, 0).incarnation
    assert old_life == main.store.incarnation  # a follower passes its main server's on

    main.stop(0)  # the follower goes on serving version 2
    time.sleep(0.5)
    assert health(f"127.0.0.1:{fs.port}") == health_pb2.HealthCheckResponse.SERVING
    version, weights = actor.pull()
    assert version == 2 and all(torch.equal(weights[n], before[n]) for n in before)

    # A new main server (other initial weights, no checkpoint) on the same pull port
    # reaches version 2 again: same number, other weights. The follower takes them.
    cfg = config_from_dict({"paramserver": {"lr": 1e-2}})
    restarted = create_server(cfg, store=build_store(cfg, model(seed=7)), host="127.0.0.1",
                              port=0, pull_port=port)
    try:
        with ParameterClient(f"127.0.0.1:{restarted.port}", "learner-0", timeout_s=10) as pusher:
            for version in range(1, 3):
                pusher.push(version - 1, grads(restarted, 10 + version))
        new = {n: p.detach().clone() for n, p in restarted.store.params.items()}
        wait_for(lambda: all(torch.equal(fs.server.store.params[n].detach(), new[n]) for n in new),
                 what="the restarted server's weights")
        version, weights = actor.pull()
        assert version == 2 and all(torch.equal(weights[n], new[n]) for n in new)
        # an actor holding version 2 of the old life is sent the new life's version 2
        assert fs.server.store.incarnation == restarted.store.incarnation != old_life
        got = actor.pull_versioned(2, old_life)
        assert got.incarnation == restarted.store.incarnation and got.weights is not None
        assert actor.pull_versioned(2, got.incarnation).weights is None
    finally:
        restarted.stop(0)


def test_a_follower_of_a_different_model_fails_for_good(servers):
    main = servers.main()
    failures = []
    fs = servers.follower(f"127.0.0.1:{main.pull_port}", m=nn.Linear(4, 2),
                          on_fatal=failures.append)
    wait_for(lambda: failures, what="the failure")
    assert isinstance(fs.follower.error, errors.ConfigError)
    assert "do not fit" in str(fs.follower.error)
    assert health(f"127.0.0.1:{fs.port}") == health_pb2.HealthCheckResponse.NOT_SERVING


def test_follow_and_pull_port_together_are_refused():
    with pytest.raises(SystemExit) as exit_:
        ps_main.main(["--follow", "127.0.0.1:1", "--pull-port", "0"])
    assert exit_.value.code == 2


# -- as processes --------------------------------------------------------------------------

def start(args: list[str], run_dir: Path, name: str, env: dict | None = None) -> tuple[subprocess.Popen, int]:
    port_file = run_dir / f"{name}.port"
    log = open(run_dir / f"{name}.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "amprl.paramserver", "--host", "127.0.0.1",
                             "--port", "0", "--port-file", str(port_file), "--run-dir", str(run_dir),
                             "--id", name, *args], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "AMPRL_SET": "", **(env or {})})
    log.close()
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{name} did not start:\n{(run_dir / f'{name}.log').read_text()}")
        time.sleep(0.05)
    return proc, int(port_file.read_text())


def test_amprl_paramserver_follow_runs_as_a_process(tmp_path):
    procs: list[subprocess.Popen] = []
    try:
        main, main_port = start(["--pull-port", "0", "--pull-port-file", str(tmp_path / "pull.port"),
                                 "--set", "paramserver.checkpoint_interval_s=0"], tmp_path, "paramserver")
        procs.append(main)
        pull_port = int((tmp_path / "pull.port").read_text())
        follower_run = tmp_path / "follower-run"
        follower, port = start(["--run-dir", str(follower_run)], tmp_path, "follower",
                               env={"AMPRL_FOLLOW": f"127.0.0.1:{pull_port}"})
        procs.append(follower)
        channels.wait_until_serving(f"127.0.0.1:{port}", timeout_s=30)
        with ParameterClient(f"127.0.0.1:{main_port}", "learner-0") as learner, \
                ParameterClient(f"127.0.0.1:{port}", "actor-0") as actor:
            _, initial = learner.pull()
            learner.push(0, [encode(n, torch.ones_like(t), "fp32") for n, t in initial.items()])
            wait_for(lambda: actor.info().version == 1, what="the follower at version 1")
            version, weights = actor.pull(encoding="bf16")
            assert version == 1 and weights.keys() == initial.keys()
            with pytest.raises(grpc.RpcError) as denied:
                actor.push(1, [])
            assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        follower.send_signal(signal.SIGTERM)
        assert follower.wait(timeout=30) == 0
        log = (tmp_path / "follower.log").read_text()
        assert "pull-only follower" in log and "stopped at version 1" in log
        assert not (follower_run / "checkpoints").exists()  # a follower writes none
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
