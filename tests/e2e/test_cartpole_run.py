"""End to end: `amprl run` on CartPole with every real process, real Redis and real gRPC."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _run(args, tmp_path, timeout):
    proc = subprocess.Popen([sys.executable, "-m", "amprl.cli", "run", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"amprl run did not finish in {timeout}s:\n{out[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out


@pytest.mark.slow
def test_cartpole_learns_through_the_distributed_system(tmp_path):
    run_dir = tmp_path / "run"
    code, out = _run(["configs/cartpole-dqn.yaml", "--run-dir", str(run_dir),
                      "--set", "run.target_return=200", "--set", "run.max_wall_seconds=150",
                      "--progress-interval", "5"], tmp_path, timeout=300)
    assert code == 0, out[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["solved"], out[-4000:]
    assert summary["best_eval_return"] >= 200
    assert summary["param_version"] > 100
    assert summary["updates"] > 100
    assert summary["env_steps"] > 1000
    # the run folder is complete
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["run"]["target_return"] == 200
    for name in ["replay", "paramserver", "learner", "actor-0", "actor-1", "evaluator"]:
        assert (run_dir / "logs" / f"{name}.log").exists(), name
    assert list((run_dir / "checkpoints").iterdir()), "no final checkpoint"
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert evals and evals[-1]["mean_return"] == summary["final_eval_return"]


def test_unknown_config_key_fails_before_any_process_starts(tmp_path):
    code, out = _run(["configs/cartpole-dqn.yaml", "--run-dir", str(tmp_path / "r"),
                      "--set", "learner.batchsize=3"], tmp_path, timeout=60)
    assert code == 2
    assert "learner.batchsize" in out
    assert not (tmp_path / "r" / "logs").exists()


def test_unknown_env_id_fails_before_any_process_starts(tmp_path):
    code, out = _run(["configs/cartpole-dqn.yaml", "--run-dir", str(tmp_path / "r"),
                      "--set", "env.id=NoSuchEnv-v9"], tmp_path, timeout=60)
    assert code == 2
    assert "NoSuchEnv-v9" in out


@pytest.mark.slow
def test_a_dying_service_stops_the_run_and_its_error_is_shown(tmp_path):
    import time
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "amprl.cli", "run", "configs/cartpole-dqn.yaml",
                             "--run-dir", str(run_dir), "--set", "run.max_wall_seconds=120"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "services.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "run never got all services up"
            time.sleep(0.2)
        pids = json.loads((run_dir / "services.json").read_text())
        os.kill(pids["learner"]["pid"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 1, out[-3000:]
    assert "service learner died" in out
    # every other service was stopped
    for name, info in pids.items():
        with pytest.raises(ProcessLookupError):
            os.kill(info["pid"], 0)
