"""The run's verdict as the evaluator keeps it: it only moves forward, it outlives the
evaluator's restarts (RUN/end.json), and it is dropped when the run section changes."""

from __future__ import annotations

import json

from amprl.common import runend
from amprl.config import load_config
from amprl.evaluator.verdict import Verdict
from amprl.v1 import telemetry_pb2


def run_section(*overrides):
    return load_config(None, ["run.total_env_steps=1000", *overrides]).run


def test_the_phase_moves_forward_only_and_keeps_the_first_reason(tmp_path):
    v = Verdict(run_section("run.max_wall_seconds=60"), tmp_path)
    assert v.phase == runend.RUNNING and not (tmp_path / "end.json").exists()
    assert not v.judge(env_steps=10, returns=[], wall_seconds=1.0)
    assert v.state().env_steps == 10
    assert v.judge(env_steps=1000, returns=[], wall_seconds=2.0)
    assert v.phase == runend.STOPPING and v.reason == telemetry_pb2.STOP_REASON_STEP_BUDGET
    assert not v.judge(env_steps=2000, returns=[], wall_seconds=70.0)  # decided already
    assert v.reason == telemetry_pb2.STOP_REASON_STEP_BUDGET and v.state().env_steps == 1000
    v.finish({"stop_reason": "step budget reached", "env_steps": 1100})
    assert v.phase == runend.FINISHED and v.state().env_steps == 1100
    assert json.loads((tmp_path / "summary.json").read_text())["env_steps"] == 1100
    assert json.loads(v.summary_json())["stop_reason"] == "step budget reached"


def test_a_restarted_evaluator_answers_with_the_verdict_it_kept(tmp_path):
    first = Verdict(run_section(), tmp_path)
    first.judge(env_steps=1000, returns=[], wall_seconds=5.0)
    stopping = Verdict(run_section(), tmp_path)  # restarted before the summary
    assert stopping.phase == runend.STOPPING and stopping.summary is None
    stopping.finish({"stop_reason": "step budget reached"})
    again = Verdict(run_section(), tmp_path)
    state = again.state()
    assert state.phase == runend.FINISHED and state.stop_reason == telemetry_pb2.STOP_REASON_STEP_BUDGET
    assert state.wall_seconds == 5.0 and state.ended_unix_time > 0
    assert again.summary == {"stop_reason": "step budget reached"}
    # a restart never moves it back, whatever the figures say now
    assert not again.judge(env_steps=0, returns=[], wall_seconds=0.0) and again.phase == runend.FINISHED


def test_a_changed_run_section_lets_a_finished_run_go_on(tmp_path):
    first = Verdict(run_section(), tmp_path)
    first.judge(env_steps=1000, returns=[], wall_seconds=5.0)
    first.finish({"stop_reason": "step budget reached"})
    raised = Verdict(run_section("run.total_env_steps=5000"), tmp_path)  # helm upgrade --set ...
    assert raised.phase == runend.RUNNING
    assert not raised.judge(env_steps=1000, returns=[], wall_seconds=6.0)
    assert raised.judge(env_steps=5000, returns=[], wall_seconds=9.0)
    assert json.loads((tmp_path / "end.json").read_text())["rule"]["total_env_steps"] == 5000


def test_an_unreadable_record_is_judged_again(tmp_path):
    (tmp_path / "end.json").write_text("{not json")
    assert Verdict(run_section(), tmp_path).phase == runend.RUNNING


def test_without_a_run_folder_the_verdict_lives_in_memory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    v = Verdict(run_section())
    assert v.judge(env_steps=1000, returns=[], wall_seconds=1.0)
    v.finish({"stop_reason": "step budget reached"})
    assert v.phase == runend.FINISHED and not list(tmp_path.iterdir())
