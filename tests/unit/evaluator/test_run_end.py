"""The evaluator ends the run: at the step budget it waits for the weights to settle,
evaluates them once more and writes the summary; at the target it ends on the evaluation
that reached it; restarted, it takes up its history and its verdict and evaluates no more."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from amprl.algos import build_model
from amprl.common import runend
from amprl.config import load_config
from amprl.core import Pulled
from amprl.envs.factory import env_spec
from amprl.evaluator import evaluator as evaluator_mod
from amprl.evaluator.evaluator import Evaluator
from amprl.evaluator.service import EvaluatorServicer
from amprl.v1 import replay_pb2, telemetry_pb2


class MovingPS:
    """A new version at every pull while a learner 'pushes'."""

    def __init__(self, weights):
        self.weights = weights
        self.version = 1
        self.pushing = True
        self.pulls = 0

    def pull_versioned(self, have_version=0, have_incarnation=0, *, encoding="fp32", timeout=None):
        self.pulls += 1
        if self.pushing:
            self.version += 1
        if have_version == self.version:
            return Pulled(self.version, 1, None)
        return Pulled(self.version, 1, {k: v.clone() for k, v in self.weights.items()})


class Replay:
    def __init__(self):
        self.env_steps = 0

    def info(self, timeout=None):
        return replay_pb2.ReplayServiceInfoResponse(env_steps_total=self.env_steps, size=min(self.env_steps, 500))


def wait_for(predicate, what, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(evaluator_mod, "JUDGE_INTERVAL_S", 0.05)
    monkeypatch.setattr(evaluator_mod, "SETTLE_S", 0.3)
    monkeypatch.setattr(evaluator_mod, "STILL_S", 0.2)
    scores = iter(range(1000))
    monkeypatch.setattr(evaluator_mod, "run_episodes", lambda *a, **k: [float(next(scores))] * 2)


def make(tmp_path, *overrides):
    cfg = load_config(None, ["network.hidden_sizes=[8]", "evaluator.episodes=2", "evaluator.interval_s=0.1",
                             "run.total_env_steps=1000", "run.target_return=500", *overrides])
    spec = env_spec(cfg.env)
    torch.manual_seed(0)
    weights = {n: p.detach().clone() for n, p in build_model(cfg, spec).named_parameters()}
    ps, replay = MovingPS(weights), Replay()
    return Evaluator(cfg, spec, ps, replay, run_dir=str(tmp_path)), ps, replay


def running(ev):
    stop = threading.Event()
    thread = threading.Thread(target=ev.run, args=(stop,), daemon=True)
    thread.start()
    return stop, thread


def test_at_the_step_budget_the_settled_weights_are_evaluated_once_more_and_the_summary_written(tmp_path, quick):
    ev, ps, replay = make(tmp_path)
    stop, thread = running(ev)
    wait_for(lambda: len(ev.evaluations) >= 2, "evaluations")
    replay.env_steps = 1000
    wait_for(lambda: ev.verdict.phase == runend.STOPPING, "the end")
    time.sleep(0.1)
    ps.pushing = False  # the learner heard it and stopped
    frozen = ps.version
    wait_for(lambda: ev.verdict.phase == runend.FINISHED, "finished")
    assert ev.verdict.seconds_since_decision >= evaluator_mod.SETTLE_S
    assert ev.evaluations[-1].param_version == frozen  # the final weights, evaluated
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stop_reason"] == "step budget reached" and summary["param_version"] == frozen
    assert summary["env_steps"] == 1000 and summary["replay_size"] == 500
    assert summary["evaluations"] == len(ev.evaluations)
    assert summary["best"]["weights"].startswith("best/weights-v")
    # finished, it evaluates no more but serves on
    evaluations, pulls = len(ev.evaluations), ps.pulls
    time.sleep(0.4)
    assert thread.is_alive() and len(ev.evaluations) == evaluations and ps.pulls == pulls
    info = EvaluatorServicer(ev).Info(telemetry_pb2.EvaluatorServiceInfoRequest(), None)
    assert info.run_state.phase == telemetry_pb2.RUN_PHASE_FINISHED
    assert json.loads(info.summary_json) == summary
    stop.set()
    thread.join(5)
    assert not thread.is_alive()

    # restarted (a new pod on the same volume): the history and the verdict, no new work
    again, ps2, _ = make(tmp_path)
    assert [e.param_version for e in again.evaluations] == [e.param_version for e in ev.evaluations]
    assert again.wall_seconds >= ev.evaluations[-1].wall_seconds
    assert again.verdict.phase == runend.FINISHED and json.loads(again.verdict.summary_json()) == summary
    stop2, thread2 = running(again)
    time.sleep(0.3)
    assert ps2.pulls == 0 and thread2.is_alive()
    stop2.set()
    thread2.join(5)


def test_at_the_target_the_run_ends_on_the_evaluation_that_reached_it(tmp_path, quick, monkeypatch):
    ev, ps, _ = make(tmp_path, "run.stop_at_target=true", "run.target_return=3")
    stop, thread = running(ev)
    wait_for(lambda: ev.verdict.phase == runend.FINISHED, "finished")
    stop.set()
    thread.join(5)
    assert [e.mean_return for e in ev.evaluations] == [0.0, 1.0, 2.0, 3.0]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stop_reason"] == "target reached" and summary["solved"]
    assert summary["final_eval_return"] == 3.0 and summary["steps_to_target"] == 0


def test_at_the_wall_limit_the_run_ends_too_and_without_replay_the_budget_waits(tmp_path, quick):
    ev, ps, _ = make(tmp_path, "run.max_wall_seconds=0.5", "run.total_env_steps=1")
    ev.replay = None  # no replay to ask: the budget of 1 env step is not judged
    stop, thread = running(ev)
    ps.pushing = False
    wait_for(lambda: ev.verdict.phase == runend.FINISHED, "finished")
    stop.set()
    thread.join(5)
    assert json.loads((tmp_path / "end.json").read_text())["reason"] == "wall-clock limit reached"
