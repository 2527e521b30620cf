"""End to end: `amprl status` on a running CartPole `amprl run` (plaintext and mutual TLS),
then on the same run folder once the run has stopped."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SERVICES = ["replay", "paramserver", "learner", "actor-0", "actor-1", "evaluator"]


def status(*args: str) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "amprl.cli", "status", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "tls"])
def test_status_shows_every_service_serving_then_names_them_down_once_the_run_stops(tmp_path, amprl_run, tls):
    run_dir = tmp_path / "run"
    run = amprl_run.start(["configs/cartpole-dqn.yaml", "--run-dir", str(run_dir), *(["--tls"] if tls else []),
                           "--set", "run.total_env_steps=10000000", "--set", "run.max_wall_seconds=120"])
    deadline = time.monotonic() + 120
    while not (run_dir / "services.json").exists():
        assert run.alive() and time.monotonic() < deadline, f"run never got all services up:\n{run.log()[-3000:]}"
        time.sleep(0.2)

    # until the learner has pushed and actors have filled replay (seconds after start-up)
    while True:
        code, out = status(str(run_dir), "--json")
        assert code == 0, out
        snap = json.loads(out)
        if snap["fleet"]["version"] > 0 and snap["fleet"]["replay_size"] > 0:
            break
        assert time.monotonic() < deadline, out
        time.sleep(1.0)
    assert snap["ok"] and list(snap["services"]) == SERVICES, out
    if tls:  # status dialed with the run's operator certificate (plaintext is refused)
        assert (run_dir / "tls" / "operator" / "tls.crt").exists()
    assert all(s["health"] == "SERVING" and not s["error"] for s in snap["services"].values()), out
    replay = snap["services"]["replay"]["details"]
    assert replay["size"] > 0 and replay["inserts_per_s"] > 0 and replay["actors_live"] == 2, out
    learner = snap["services"]["learner"]["details"]
    assert learner["updates"] > 0 and learner["lag_versions"] is not None, out
    assert snap["services"]["actor-0"]["details"]["env_steps"] > 0, out
    assert snap["fleet"]["env_steps_per_s"] > 0 and snap["fleet"]["total_env_steps"] == 10_000_000, out

    code, text = status(str(run_dir))
    assert code == 0, text
    assert text.rstrip().endswith("all 6 services SERVING"), text
    for name in SERVICES:
        assert any(line.startswith(f"{name} ") and " SERVING " in line for line in text.splitlines()), text

    run.stop(timeout_s=60)  # what Ctrl-C does: every service stops
    code, text = status(str(run_dir), "--interval", "0")
    assert code == 1, text
    assert "not serving: 6 of 6" in text
    for name in SERVICES:
        assert f"  {name}: UNAVAILABLE" in text, text
