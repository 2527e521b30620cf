"""Smoke: `amprl run configs/pong-apex.yaml` with a tiny budget starts every service on real
preprocessed Pong frames, inserts into replay, updates, and evaluates the real score."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ale_py")


@pytest.mark.slow
def test_pong_apex_starts_inserts_and_updates(tmp_path, amprl_run):
    run_dir = tmp_path / "run"
    overrides = ["run.total_env_steps=1500", "replay.min_size_to_sample=200",
                 "replay.samples_per_insert=0", "learner.batch_size=16", "learner.precision=fp32",
                 "actor.num_actors=1", "actor.envs_per_actor=4", "env.max_episode_steps=200",
                 "evaluator.episodes=1", "evaluator.interval_s=2", "run.max_wall_seconds=200"]
    args = ["configs/pong-apex.yaml", "--run-dir", str(run_dir), "--progress-interval", "10"]
    for o in overrides:
        args += ["--set", o]
    code, out = amprl_run(args, timeout_s=420)
    assert code == 0, out[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["env_id"] == "ALE/Pong-v5"
    assert summary["env_steps"] >= 1500
    assert summary["updates"] >= 1 and summary["param_version"] >= 1
    assert summary["evaluations"] >= 1
    # Pong's real score is an integer in [-21, 21]
    assert -21 <= summary["final_eval_return"] <= 21
    assert float(summary["final_eval_return"]).is_integer()
