"""The start-up and shutdown every service process shares (``amprl.common.bootstrap``):
a missing address is exit 2, SIGTERM turns health NOT_SERVING, drains, stops; a worker
whose thread died exits 1."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from amprl.common.bootstrap import ServiceProcess
from amprl.common.grpcutil import LIVENESS
from amprl.common.supervise import ThreadDied

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(autouse=True)
def clean_process(monkeypatch):
    """No AMPRL_* from the outer environment, and this process's signal handlers back."""
    for key in [k for k in os.environ if k.startswith("AMPRL_")]:
        monkeypatch.delenv(key)
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def serving_process(*flags: str) -> ServiceProcess:
    proc = ServiceProcess("test", "a test service")
    proc.parse(["--host", "127.0.0.1", *flags])
    proc.serve([], port=0)
    return proc


def health(port: int, service: str = "") -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def signal_soon(*signums: int, after_s: float = 0.2) -> None:
    def send():
        for signum in signums:
            os.kill(os.getpid(), signum)
            time.sleep(0.05)
    threading.Timer(after_s, send).start()


def test_a_missing_address_is_one_error_line_and_status_2(caplog):
    proc = ServiceProcess("test", "a test service")
    proc.parse(["--paramserver", "127.0.0.1:1"])
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as exit_:
        proc.setup(require=("replay", "paramserver"))
    assert exit_.value.code == 2
    assert caplog.messages == ["--replay and --paramserver (or AMPRL_REPLAY_ADDRESS / "
                               "AMPRL_PARAMSERVER_ADDRESS) are required"]


def test_serve_writes_the_bound_port_to_the_port_file(tmp_path):
    proc = serving_process("--port-file", str(tmp_path / "port"))
    try:
        assert int((tmp_path / "port").read_text()) == proc.port > 0
        assert health(proc.port) == SERVING
    finally:
        proc.server.stop(0)


def test_readiness_follows_set_ready_and_liveness_stays_serving():
    proc = serving_process()
    try:
        proc.set_ready(False)
        assert health(proc.port) == NOT_SERVING and health(proc.port, LIVENESS) == SERVING
        proc.set_ready(True)
        assert health(proc.port) == SERVING
    finally:
        proc.server.stop(0)


def test_sigterm_turns_health_not_serving_drains_then_stops():
    proc = serving_process("--drain-s", "0.5")
    seen = {}

    def on_stop():  # after the drain, before the server stops
        seen["health"] = health(proc.port)
        seen["after_s"] = time.monotonic() - start

    start = time.monotonic()
    signal_soon(signal.SIGTERM)
    assert proc.run_until_stopped(grace_s=1.0, drain=True, on_stop=on_stop) == 0
    assert seen["health"] == NOT_SERVING and seen["after_s"] >= 0.2 + 0.5
    with pytest.raises(grpc.RpcError):
        health(proc.port)


def test_a_second_signal_cuts_the_drain_short():
    proc = serving_process("--drain-s", "60")
    start = time.monotonic()
    signal_soon(signal.SIGTERM, signal.SIGINT)
    assert proc.run_until_stopped(grace_s=1.0, drain=True) == 0
    assert time.monotonic() - start < 10


def test_a_worker_runs_until_the_signal_and_does_not_drain():
    proc = serving_process("--drain-s", "60")
    order = []

    def run(stop: threading.Event) -> None:
        stop.wait(30)
        order.append("run returned")

    signal_soon(signal.SIGTERM)
    start = time.monotonic()
    status = proc.run_until_stopped(run, grace_s=1.0,
                                    on_stop=lambda: order.append(health(proc.port)))
    assert status == 0 and order == ["run returned", NOT_SERVING]
    assert time.monotonic() - start < 10


def test_a_worker_whose_thread_died_stops_its_server_and_exits_1(caplog):
    proc = serving_process()
    stopped = []

    def run(stop: threading.Event) -> None:
        raise ThreadDied("test: the sender thread died: KeyError")

    with caplog.at_level(logging.ERROR):
        assert proc.run_until_stopped(run, grace_s=1.0, on_stop=lambda: stopped.append(1)) == 1
    assert stopped == [1]
    assert "exiting so that the pod is restarted" in caplog.text
    with pytest.raises(grpc.RpcError):
        health(proc.port)


def test_a_worker_stops_with_status_0_when_its_certificate_is_renewed(tmp_path, monkeypatch, caplog):
    """cert-manager renews the Secret, the kubelet swaps the files: a worker (whose client
    channels hold the old certificate) stops so that Kubernetes starts it with the new."""
    from amprl.common import bootstrap, certs

    folder = certs.make_role_certs(tmp_path, roles=("actor",))["actor"]
    monkeypatch.setenv("AMPRL_TLS_CERT_DIR", str(folder))
    monkeypatch.setattr(bootstrap, "RENEWAL_CHECK_S", 0.05)
    proc = serving_process()
    renew = threading.Timer(0.3, lambda: certs.make_role_certs(tmp_path, roles=("actor",)))
    renew.start()
    start = time.monotonic()
    with caplog.at_level(logging.INFO):
        status = proc.run_until_stopped(lambda stop: stop.wait(30), grace_s=1.0)
    renew.join()
    assert status == 0 and time.monotonic() - start < 10
    assert "was renewed" in caplog.text


def test_a_server_that_reloads_in_place_keeps_running_through_a_renewal(tmp_path, monkeypatch):
    from amprl.common import bootstrap, certs

    certs.make_role_certs(tmp_path, roles=("replay",))
    monkeypatch.setenv("AMPRL_TLS_CERT_DIR", str(tmp_path / "replay"))
    monkeypatch.setattr(bootstrap, "RENEWAL_CHECK_S", 0.05)
    proc = serving_process()
    certs.make_role_certs(tmp_path, roles=("replay",))
    signal_soon(signal.SIGTERM, after_s=1.0)
    start = time.monotonic()
    assert proc.run_until_stopped(grace_s=1.0, renewal=bootstrap.Renewal.RELOAD) == 0
    assert time.monotonic() - start >= 0.9  # ran until the signal, not stopped by the renewal
