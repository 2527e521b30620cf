"""End to end: `amprl run` on CartPole with every real process, real Redis and real gRPC."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import yaml


@pytest.mark.slow
def test_cartpole_learns_through_the_distributed_system(tmp_path, amprl_run):
    run_dir = tmp_path / "run"
    code, out = amprl_run(["configs/cartpole-dqn.yaml", "--run-dir", str(run_dir),
                           "--set", "run.target_return=200", "--set", "run.max_wall_seconds=150",
                           "--progress-interval", "5"], timeout_s=300)
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
    # the best-scoring weights are kept, with the config that rebuilds their network
    best = summary["best"]
    assert best["mean_return"] == summary["best_eval_return"]
    assert (run_dir / best["weights"]).exists() and (run_dir / best["config"]).exists()


def test_unknown_config_key_fails_before_any_process_starts(tmp_path, amprl_run):
    code, out = amprl_run(["configs/cartpole-dqn.yaml", "--run-dir", str(tmp_path / "r"),
                           "--set", "learner.batchsize=3"], timeout_s=60)
    assert code == 2
    assert "learner.batchsize" in out
    assert not (tmp_path / "r" / "logs").exists()


def test_unknown_env_id_fails_before_any_process_starts(tmp_path, amprl_run):
    code, out = amprl_run(["configs/cartpole-dqn.yaml", "--run-dir", str(tmp_path / "r"),
                           "--set", "env.id=NoSuchEnv-v9"], timeout_s=60)
    assert code == 2
    assert "NoSuchEnv-v9" in out


@pytest.mark.slow
def test_a_dying_service_stops_the_run_and_its_error_is_shown(tmp_path, amprl_run):
    run_dir = tmp_path / "run"
    run = amprl_run.start(["configs/cartpole-dqn.yaml", "--run-dir", str(run_dir),
                           "--set", "run.max_wall_seconds=120"])
    deadline = time.monotonic() + 120
    while not (run_dir / "services.json").exists():
        assert run.alive() and time.monotonic() < deadline, "run never got all services up"
        time.sleep(0.2)
    pids = json.loads((run_dir / "services.json").read_text())
    os.kill(pids["learner"]["pid"], signal.SIGKILL)  # the fault under test: one service crashes
    code, out = amprl_run.finish(run, timeout_s=90)
    assert code == 1, out[-3000:]
    assert "service learner died" in out
    # every other service was stopped
    for name, info in pids.items():
        with pytest.raises(ProcessLookupError):
            os.kill(info["pid"], 0)


@pytest.mark.slow
def test_amprl_run_with_tls_trains_with_one_certificate_per_service_role(tmp_path, amprl_run):
    run_dir = tmp_path / "run"
    code, out = amprl_run(["configs/cartpole-dqn.yaml", "--tls", "--run-dir", str(run_dir),
                           "--set", "run.total_env_steps=3000", "--set", "run.max_wall_seconds=90",
                           "--set", "evaluator.interval_s=2", "--progress-interval", "5"],
                          timeout_s=240)
    assert code == 0, out[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    # every service spoke mutual TLS: actors inserted, the learner sampled and pushed, the
    # evaluator pulled, and the launcher read every Info with the operator certificate
    assert summary["env_steps"] >= 3000 and summary["updates"] > 0, summary
    assert summary["param_version"] > 0 and summary["evaluations"] > 0, summary
    for role in ("replay", "paramserver", "learner", "actor", "evaluator", "operator"):
        assert (run_dir / "tls" / role / "tls.crt").exists(), role
    for log in (run_dir / "logs").iterdir():
        assert "PERMISSION_DENIED" not in log.read_text(), log.name
