"""The progress of a run as `amprl run` shows it: the figures read from the services' Info
answers, rates between polls, the plain line, ETA, and the rich display on a terminal."""

from __future__ import annotations

import io
import os
import socket

from rich.console import Console

from amprl.config import RunConfig
from amprl.launch.progress import Progress, ProgressDisplay, duration, eta_seconds, render
from amprl.v1 import paramserver_pb2, replay_pb2, telemetry_pb2

NAMES = ["replay", "paramserver", "learner", "actor-0", "actor-1", "evaluator"]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answered(progress: Progress, env_steps: int = 15_712, updates: int = 3_336, version: int = 3_335,
             evaluations=((3_288, 240.9),)) -> Progress:
    """Sets every service's last Info as a poll would."""
    s = progress.services
    s["replay"].info = replay_pb2.ReplayServiceInfoResponse(size=15_616, capacity=100_000,
                                                           env_steps_total=env_steps, inserted_total=env_steps)
    s["paramserver"].info = paramserver_pb2.ParameterServiceInfoResponse(version=version)
    s["learner"].info = telemetry_pb2.LearnerServiceInfoResponse(updates=updates, q_mean=51.86,
                                                                 param_version=version - 40)
    s["actor-0"].info = telemetry_pb2.ActorServiceInfoResponse(env_steps=env_steps // 2, episodes=10,
                                                               recent_return=200.0)
    s["actor-1"].info = telemetry_pb2.ActorServiceInfoResponse(env_steps=env_steps // 2, episodes=12,
                                                               recent_return=100.0)
    s["evaluator"].info = telemetry_pb2.EvaluatorServiceInfoResponse(evaluations=[
        telemetry_pb2.Evaluation(param_version=v, mean_return=r, std_return=3.0, env_steps=14_000)
        for v, r in evaluations])
    return progress


def polled_twice() -> Progress:
    """Two polls 2 s apart: 3,638 env steps and 908 updates more."""
    p = answered(Progress({n: "127.0.0.1:1" for n in NAMES}), env_steps=12_074, updates=2_428)
    p.record(now=100.0)
    answered(p)
    p.record(now=102.0)
    return p


def test_figures_come_from_the_last_info_of_each_service():
    p = answered(Progress({n: "127.0.0.1:1" for n in NAMES}))
    assert (p.env_steps, p.replay_size, p.version, p.updates) == (15_712, 15_616, 3_335, 3_336)
    assert p.q_mean == 51.86 and p.evaluations[-1].mean_return == 240.9
    assert p.recent_return == 150.0  # the mean over the actors that finished an episode


def test_recent_return_is_none_before_any_actor_finished_an_episode():
    p = Progress({"actor-0": "127.0.0.1:1"})
    p.services["actor-0"].info = telemetry_pb2.ActorServiceInfoResponse(env_steps=50, recent_return=0.0)
    assert p.recent_return is None


def test_rates_are_the_counters_growth_per_second_between_polls():
    p = polled_twice()
    rates = p.rates()
    assert rates["env_steps"] == (15_712 - 12_074) / 2 and rates["updates"] == (3_336 - 2_428) / 2
    assert rates["replay.inserted_total"] == rates["env_steps"]
    assert rates["actor-0.env_steps"] == (15_712 // 2 - 12_074 // 2) / 2


def test_one_poll_has_no_rates():
    p = answered(Progress({n: "127.0.0.1:1" for n in NAMES}))
    p.record(now=1.0)
    assert p.rates() == {}


def test_the_plain_line_keeps_its_format():
    assert polled_twice().line(7.2) == (
        "[   7.2s] env steps    15,712 (  1,819/s)  updates   3,336 (  454/s)  Q   51.86  "
        "replay   15,616  version   3,335  eval   240.9 (v3288)")


def test_eta_is_the_nearer_of_the_step_budget_and_the_wall_limit():
    assert eta_seconds(10_000, 50_000, 1_000.0, elapsed=5.0) == 40.0
    assert eta_seconds(10_000, 50_000, 1_000.0, elapsed=5.0, max_wall_seconds=30.0) == 25.0
    assert eta_seconds(10_000, 50_000, 0.0, elapsed=5.0) is None  # no rate yet, no wall limit
    assert eta_seconds(10_000, 50_000, 0.0, elapsed=5.0, max_wall_seconds=60.0) == 55.0
    assert eta_seconds(60_000, 50_000, 1_000.0, elapsed=5.0) == 0.0


def test_durations_read_as_seconds_minutes_hours():
    assert [duration(s) for s in (None, 7.4, 75, 3725)] == ["-", "7s", "1m15s", "1h02m"]


def test_the_rich_display_shows_budget_eta_training_return_and_last_eval():
    run = RunConfig(total_env_steps=50_000, target_return=475.0)
    out = io.StringIO()
    Console(file=out, width=80).print(render(polled_twice(), run, elapsed=7.2, title="amprl run test"))
    text = out.getvalue()
    assert "amprl run test" in text
    assert "31% of 50,000 env steps" in text  # 15,712 of 50,000
    assert "ETA 19s" in text  # 34,288 steps left at 1,819/s
    assert "15,712 (1,819/s)" in text and "3,336 (454/s)" in text
    assert "150.0" in text  # training return
    assert "240.9 ± 3.0 at v3288" in text and "475 (the run stops there)" in text
    assert len(text.splitlines()) == 2 + 1 + 8  # an 80-column terminal: borders, bar, one row per figure


def test_without_a_terminal_the_display_prints_the_plain_line_once_per_interval():
    out = io.StringIO()
    display = ProgressDisplay(polled_twice(), RunConfig(), interval_s=1.0, file=out)
    assert not display.live
    for elapsed in (0.25, 0.5, 1.0, 1.25, 2.0):
        display.update(elapsed)
    display.close()
    lines = out.getvalue().splitlines()
    assert [line[:9] for line in lines] == ["[   1.0s]", "[   2.0s]"]
    assert "\x1b" not in out.getvalue()


def test_on_a_terminal_the_display_is_redrawn_in_place():
    master, slave = os.openpty()
    with os.fdopen(slave, "w") as tty:
        display = ProgressDisplay(polled_twice(), RunConfig(total_env_steps=50_000), file=tty)
        assert display.live
        display.update(1.0)
        display.update(1.25)
        display.close()
        display.close()  # idempotent
        tty.flush()
        written = os.read(master, 1 << 20).decode(errors="replace")
    os.close(master)
    assert "ETA" in written and "31%" in written
    assert "\x1b[" in written  # cursor movement: the second frame overwrites the first
    assert "env steps    15,712" not in written  # not the plain line


def test_a_service_that_is_not_there_is_reported_down_with_the_reason():
    p = Progress({"replay": f"127.0.0.1:{closed_port()}"}, timeout_s=2.0)
    try:
        p.poll(health=True)
    finally:
        p.close()
    replay = p.services["replay"]
    assert replay.health == "UNAVAILABLE" and replay.info is None
    assert "UNAVAILABLE" in replay.error
    assert p.env_steps == 0 and p.rates() == {}


class Scripted(Progress):
    """A Progress whose polls answer from a script of (learner phase, updates, version)."""

    def __init__(self, script):
        super().__init__({"paramserver": "127.0.0.1:1", "learner": "127.0.0.1:1"})
        self.script = list(script)
        self.polls = 0

    def poll(self, *, health: bool = False) -> None:
        phase, updates, version = self.script[min(self.polls, len(self.script) - 1)]
        self.polls += 1
        self.services["learner"].info = telemetry_pb2.LearnerServiceInfoResponse(updates=updates, run_phase=phase)
        self.services["paramserver"].info = paramserver_pb2.ParameterServiceInfoResponse(version=version)


RUNNING, STOPPING = telemetry_pb2.RUN_PHASE_RUNNING, telemetry_pb2.RUN_PHASE_STOPPING


def test_waiting_for_idle_learners_ends_once_they_stopped_and_their_pushes_landed():
    # a run that ends at its target: the learner still works, then stops with pushes in flight
    p = Scripted([(RUNNING, 90, 80), (RUNNING, 98, 90), (STOPPING, 100, 95), (STOPPING, 100, 100),
                  (STOPPING, 100, 100)])
    assert p.wait_learners_idle(timeout_s=10, interval_s=0)
    assert p.polls == 5 and (p.updates, p.version) == (100, 100)


def test_waiting_for_idle_learners_gives_up_at_the_timeout():
    p = Scripted([(RUNNING, 1, 1)])
    assert not p.wait_learners_idle(timeout_s=0.05, interval_s=0.01)
