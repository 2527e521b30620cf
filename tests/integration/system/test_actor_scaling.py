"""What `kubectl scale deployment/<release>-amprl-actor` relies on: actors come and go
mid-run, configured only by their environment, and the rest of the system follows."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .conftest import LIVE_WINDOW_S, wait_for

ACTOR_SHARE = 0.25  # each actor pod's CPU limit (see CpuLimit), in cores
LEARNER_SHARE = 0.5
MEASURE_S = 5.0


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

    codes = [system.stop_actor(a) for a in ("actor-2", "actor-3")]
    assert codes == [0, 0], "a SIGTERMed actor should exit cleanly"
    time.sleep(1.0)
    rate2 = env_step_rate(system)
    # The removed actors age out of both live counts within the (short) live window.
    wait_for(lambda: live_counts(system) == (2, 2), LIVE_WINDOW_S + 10,
             "replay and paramserver to report 2 live actors")

    rates = f"rates 1 actor {rate1:.0f}/s, 4 actors {rate4:.0f}/s, 2 actors {rate2:.0f}/s"
    assert rate1 > 0, rates
    assert 2.0 * rate1 < rate4 < 6.0 * rate1, rates  # ideal 4x
    assert 0.3 * rate4 < rate2 < 0.8 * rate4, rates  # ideal 0.5x

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
