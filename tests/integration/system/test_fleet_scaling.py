"""`kubectl scale` to a fleet and back with replay's rate limiter on: 16 actor processes (one
env each, configured only by their environment) against one replay shard and one parameter
server. Every actor's inserts wait on the limiter, yet replay keeps answering health, Info
and the learner's samples; scaling back down leaves no error anywhere.

Its own running system (see conftest.py), because the limiter paces every actor by the
learner: the other system's scaling test measures actor throughput with the limiter off.
"""

from __future__ import annotations

import threading

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from amprl.v1 import replay_pb2, replay_pb2_grpc, telemetry_pb2, telemetry_pb2_grpc

from .conftest import LIVE_WINDOW_S, TINY_CONFIG, running_system, wait_for

FLEET = 16


def fleet_config() -> str:
    cfg = yaml.safe_load(TINY_CONFIG)
    cfg["name"] = "system-fleet-test"
    # The learner samples 32 per update; 8 samples per insert lets the fleet insert about
    # 4 transitions per update, far less than 16 actors produce, so inserts wait.
    cfg["replay"].update(samples_per_insert=8.0, min_size_to_sample=200)
    # Held back, each actor takes a few steps a second, so its 200-step refreshes come tens
    # of seconds apart; its time floor keeps every one pulling within the 3 s live window.
    cfg["actor"].update(envs_per_actor=1, chunk_transitions=16, max_unacked_transitions=64,
                        weight_refresh_s=1.0)
    return yaml.safe_dump(cfg)


@pytest.fixture(scope="module")
def fleet_system(tmp_path_factory):
    with running_system(tmp_path_factory.mktemp("fleet"), fleet_config()) as sys_:
        yield sys_


class Prober:
    """Calls replay's health Check and Info every 0.2 s with a 1 s deadline, from its own
    thread, and keeps every failure: what a kubelet's probe and an operator would see."""

    def __init__(self, address: str):
        self.failures: list[str] = []
        self.calls = 0
        self._stop = threading.Event()
        self._channel = grpc.insecure_channel(address)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        health = health_pb2_grpc.HealthStub(self._channel)
        replay = replay_pb2_grpc.ReplayServiceStub(self._channel)
        while not self._stop.wait(0.2):
            try:
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
                if status != health_pb2.HealthCheckResponse.SERVING:
                    self.failures.append(f"health {status}")
                replay.Info(replay_pb2.ReplayServiceInfoRequest(), timeout=1.0)
                self.calls += 1
            except grpc.RpcError as exc:
                self.failures.append(f"{exc.code()}: {exc.details()}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._channel.close()


@pytest.mark.slow
def test_16_rate_limited_actors_join_and_leave_and_replay_keeps_answering(fleet_system):
    system = fleet_system
    system.check_alive()
    channel = grpc.insecure_channel(f"127.0.0.1:{system.ports['learner']}")
    learner = telemetry_pb2_grpc.LearnerServiceStub(channel)

    def learner_updates() -> int:
        return learner.Info(telemetry_pb2.LearnerServiceInfoRequest(), timeout=5).updates

    prober = Prober(system.replay_address)
    try:
        ids = [f"actor-{k}" for k in range(FLEET)]
        for actor_id in ids:
            system.start_actor(actor_id)
        wait_for(lambda: system.replay_info().actors_live >= FLEET, 180,
                 f"{FLEET} live actors in replay Info")
        # The fleet outruns the learner: inserts queue on the limiter while the learner's
        # samples (and so its updates) go on.
        wait_for(lambda: system.replay_info().rate_limiter.waiting_inserts > 0, 30,
                 "inserts waiting on the rate limiter")
        updates = learner_updates()
        wait_for(lambda: learner_updates() > updates + 100, 30,
                 "the learner to keep updating with a waiting fleet")
        # every actor within one 3 s live window at once, paced by the rate limiter
        wait_for(lambda: system.ps_info().actors_live >= FLEET, 60,
                 f"{FLEET} actors pulling weights")

        # Back to one actor: the others' streams close, they age out, training goes on.
        codes = system.stop_actors(ids[1:])
        assert codes == [0] * (FLEET - 1), f"SIGTERMed actors should exit cleanly: {codes}"
        wait_for(lambda: system.replay_info().insert_streams <= 1, 15, "the leavers' streams closed")
        wait_for(lambda: system.replay_info().actors_live == 1, LIVE_WINDOW_S + 10,
                 "the leavers to age out of replay's live count")
        updates = learner_updates()
        wait_for(lambda: learner_updates() > updates + 20, 30, "training to go on with one actor")
        assert system.stop_actors(ids[:1]) == [0]
    finally:
        prober.close()
        channel.close()

    assert prober.calls > 10 and not prober.failures, prober.failures[:5]
    system.check_alive()
    for name, proc in system.services.items():
        log = proc.log()
        assert "Traceback" not in log and " ERROR " not in log, f"{name} log:\n{log[-3000:]}"
