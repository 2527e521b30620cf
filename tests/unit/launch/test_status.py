"""`amprl status`: where the addresses and the certificate come from, the figures of each
service, the screen and the exit status (a running system: tests/e2e/test_status.py)."""

from __future__ import annotations

import json

import pytest

from amprl import errors
from amprl.cli import main as amprl
from amprl.launch.progress import Progress
from amprl.launch.status import operator_cert_dir, screen, service_addresses, snapshot
from amprl.v1 import replay_pb2, telemetry_pb2

from test_progress import NAMES, answered, closed_port, polled_twice


def services_json(folder, names=NAMES):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "services.json").write_text(json.dumps(
        {n: {"pid": 1, "address": f"127.0.0.1:{5000 + i}", "log": f"logs/{n}.log"} for i, n in enumerate(names)}))
    return folder


def serving(progress: Progress) -> Progress:
    for s in progress.services.values():
        s.health = "SERVING"
    return progress


def test_addresses_come_from_services_json_and_the_role_flags(tmp_path):
    run_dir = services_json(tmp_path / "run", ["replay", "paramserver"])
    found = service_addresses(run_dir, {"replay": [], "actor": ["h:1,h:2"], "learner": ["h:3"]})
    assert found == {"replay": "127.0.0.1:5000", "paramserver": "127.0.0.1:5001",
                     "actor-0": "h:1", "actor-1": "h:2", "learner": "h:3"}
    assert service_addresses(None, {"replay": ["a:1", "b:2"]}) == {"replay-0": "a:1", "replay-1": "b:2"}


def test_a_folder_without_services_json_is_a_usage_error_that_says_so(tmp_path):
    with pytest.raises(errors.ConfigError, match="services.json: not found"):
        service_addresses(tmp_path, {})
    with pytest.raises(errors.ConfigError, match="no services"):
        service_addresses(None, {"replay": []})
    assert amprl(["status", str(tmp_path)]) == 2


def test_the_certificate_is_certs_operator_else_the_runs_own_else_the_environment(tmp_path):
    run_dir = tmp_path / "run"
    assert operator_cert_dir(run_dir, None) is None
    (run_dir / "tls" / "operator").mkdir(parents=True)
    (run_dir / "tls" / "operator" / "tls.crt").write_text("x")
    assert operator_cert_dir(run_dir, None) == run_dir / "tls" / "operator"
    assert operator_cert_dir(run_dir, tmp_path / "certs") == tmp_path / "certs" / "operator"


def test_every_service_serving_is_ok_with_each_ones_figures():
    p = serving(polled_twice())
    p.services["replay"].info.rate_limiter.CopyFrom(replay_pb2.RateLimiterInfo(waiting_samples=1))
    snap = snapshot(p, interval_s=2.0)
    assert snap["ok"] and snap["down"] == []
    s = snap["services"]
    assert s["replay"]["details"]["inserts_per_s"] == pytest.approx(1_819)
    assert s["replay"]["details"]["waiting_samples"] == 1
    assert s["learner"]["details"]["lag_versions"] == 40 and s["learner"]["version"] == 3_295
    assert s["learner"]["details"]["updates_per_s"] == 454
    assert s["paramserver"]["version"] == 3_335
    assert s["actor-1"]["details"]["recent_return"] == 100.0
    assert s["evaluator"]["version"] == 3_288 and s["evaluator"]["details"]["evaluations"] == 1
    assert snap["fleet"]["env_steps_per_s"] == pytest.approx(1_819) and snap["fleet"]["recent_return"] == 150.0
    json.dumps(snap)  # what --json prints

    text = screen(snap)
    lines = text.splitlines()
    assert lines[0] == "amprl status (rates over 2 s)"
    assert lines[1].split() == ["SERVICE", "ADDRESS", "HEALTH", "VERSION", "FIGURES"]
    replay = next(line for line in lines if line.startswith("replay "))
    assert "SERVING" in replay and "15,616 / 100,000 transitions" in replay and "1,819 inserts/s" in replay
    learner = next(line for line in lines if line.startswith("learner "))
    assert "3,336 updates (454/s)" in learner and "40 versions behind" in learner
    assert "last 240.9 ± 3.0 at 14,000 env steps" in text
    assert "training return 150.0" in text and text.endswith("all 6 services SERVING")


def test_without_rates_the_screen_says_so_and_shows_dashes():
    snap = snapshot(serving(answered(Progress({n: "127.0.0.1:1" for n in NAMES}))), interval_s=0)
    assert snap["rate_seconds"] is None and snap["fleet"]["updates_per_s"] is None
    text = screen(snap)
    assert "(no rates)" in text and "3,336 updates (-/s)" in text


def test_a_service_not_serving_fails_the_status_and_is_named_with_the_reason(tmp_path):
    p = serving(polled_twice())
    p.services["learner"].health = "NOT_SERVING"
    p.services["actor-1"].health, p.services["actor-1"].error = "UNAVAILABLE", "info: UNAVAILABLE: refused"
    p.services["actor-1"].info = None
    (tmp_path / "summary.json").write_text(json.dumps({"stop_reason": "step budget reached"}))
    snap = snapshot(p, interval_s=1.0, run_dir=tmp_path)
    assert not snap["ok"] and snap["down"] == ["learner", "actor-1"]
    text = screen(snap)
    assert "not serving: 2 of 6" in text
    assert "  learner: NOT_SERVING" in text and "  actor-1: UNAVAILABLE (info: UNAVAILABLE: refused)" in text
    assert "the run has finished (step budget reached" in text


def test_status_of_a_run_whose_services_are_gone_exits_1_naming_them(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "services.json").write_text(json.dumps(
        {n: {"pid": 1, "address": f"127.0.0.1:{closed_port()}"} for n in ("replay", "actor-0")}))
    assert amprl(["status", str(run_dir), "--interval", "0"]) == 1
    out = capsys.readouterr().out
    assert "  replay: UNAVAILABLE" in out and "  actor-0: UNAVAILABLE" in out
    assert amprl(["status", str(run_dir), "--json", "--interval", "0"]) == 1
    snap = json.loads(capsys.readouterr().out)
    assert snap["down"] == ["replay", "actor-0"] and snap["services"]["replay"]["details"] == {}


def test_an_evaluator_without_evaluations_says_so():
    p = serving(Progress({"evaluator": "127.0.0.1:1"}))
    p.services["evaluator"].info = telemetry_pb2.EvaluatorServiceInfoResponse()
    snap = snapshot(p, interval_s=0)
    assert snap["services"]["evaluator"]["version"] is None
    assert "no evaluation yet" in screen(snap)


def test_the_evaluators_verdict_is_shown_with_the_summary_once_the_run_has_finished():
    p = serving(Progress({"evaluator": "127.0.0.1:1"}))
    state = telemetry_pb2.RunState(phase=telemetry_pb2.RUN_PHASE_RUNNING, env_steps=500, wall_seconds=12.0)
    p.services["evaluator"].info = telemetry_pb2.EvaluatorServiceInfoResponse(run_state=state)
    snap = snapshot(p, interval_s=0)
    assert snap["run"] == {"phase": "running", "stop_reason": "", "env_steps": 500, "wall_seconds": 12.0,
                           "summary": None}
    assert "the run" not in screen(snap)
    state.phase, state.stop_reason = telemetry_pb2.RUN_PHASE_FINISHED, telemetry_pb2.STOP_REASON_STEP_BUDGET
    summary = {"stop_reason": "step budget reached", "final_eval_return": 180.0, "best_eval_return": 212.5,
               "solved": False}
    p.services["evaluator"].info = telemetry_pb2.EvaluatorServiceInfoResponse(
        run_state=state, summary_json=json.dumps(summary))
    snap = snapshot(p, interval_s=0)
    assert snap["run"]["phase"] == "finished" and snap["run"]["summary"] == summary
    text = screen(snap)
    assert "the run has finished (step budget reached, the evaluator's verdict at 500 env steps, 12 s)" in text
    assert "final eval 180.0, best 212.5, solved: no" in text


def test_wait_needs_the_evaluator_which_decides_the_end(capsys):
    assert amprl(["status", "--replay", f"127.0.0.1:{closed_port()}", "--wait"]) == 2
    assert "--wait needs the evaluator's address" in capsys.readouterr().err
