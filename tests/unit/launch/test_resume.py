"""amprl run --resume / --init-from: which config a resumed run gets, which weights a new
one starts from, and the whole run's summary (amprl.launch.resume)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from amprl.config import dump_config, load_config
from amprl.errors import ConfigError
from amprl.launch import resume
from amprl.paramserver.checkpoint import CheckpointManager
from amprl.paramserver.service import build_store

DEFAULT = "cartpole-dqn"


def args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("config", nargs="?", default=DEFAULT)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--run-dir", default="")
    resume.add_arguments(p)
    return p.parse_args(list(argv))


@pytest.fixture
def run_dir(tmp_path):
    """A stopped run: its config (budget 5000) and a summary at 3000 env steps."""
    folder = tmp_path / "run"
    folder.mkdir()
    dump_config(load_config(None, ["run.total_env_steps=5000", "learner.batch_size=32"]), folder / "config.yaml")
    (folder / "summary.json").write_text(json.dumps({"env_steps": 3000, "updates": 100, "wall_seconds": 10.0}))
    return folder


def test_a_resumed_run_keeps_its_config_and_takes_only_the_safe_overrides(run_dir):
    a = args("--resume", str(run_dir), "--set", "run.total_env_steps=9000", "--set", "deploy.nice.actor=5",
             "--set", "run.max_wall_seconds=60")
    cfg = resume.run_config(a, DEFAULT)
    assert cfg.learner.batch_size == 32  # the run's own, not the default config's
    assert cfg.run.total_env_steps == 9000 and cfg.deploy.nice.actor == 5 and cfg.run.max_wall_seconds == 60
    assert a.run_dir == str(run_dir)
    assert resume.previous_summary(a)["updates"] == 100


@pytest.mark.parametrize("argv, message", [
    (["--set", "learner.batch_size=64"], "--set learner.batch_size: a resumed run keeps its config"),
    (["--set", "deployx=1"], "--set deployx: a resumed run"),
    (["other.yaml"], "runs with that run's own config"),
    (["--run-dir", "/elsewhere"], "drop --run-dir"),
    (["--init-from", "/somewhere"], "choose one"),
    (["--set", "run.total_env_steps=3000"], "the run has 3000 env steps, no fewer than its budget"),
])
def test_what_a_resumed_run_refuses(run_dir, argv, message):
    with pytest.raises(ConfigError, match=message):
        resume.run_config(args("--resume", str(run_dir), *argv), DEFAULT)


def test_a_run_that_kept_no_checkpoints_is_not_resumed(run_dir):
    dump_config(load_config(None, ["paramserver.checkpoint_interval_s=0"]), run_dir / "config.yaml")
    with pytest.raises(ConfigError, match="kept no checkpoints"):
        resume.run_config(args("--resume", str(run_dir), "--set", "run.total_env_steps=9000"), DEFAULT)


def test_a_run_whose_redis_still_runs_is_not_resumed(run_dir):
    (run_dir / "redis").mkdir()
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "redis-server"])
    try:
        cmdline = Path(f"/proc/{stand_in.pid}/cmdline")
        while b"redis-server" not in cmdline.read_bytes():  # until it has exec'd
            time.sleep(0.01)
        (run_dir / "redis" / "redis-server.pid").write_text(str(stand_in.pid))
        with pytest.raises(ConfigError, match=f"its Redis still runs \\(pid {stand_in.pid}\\)"):
            resume.run_config(args("--resume", str(run_dir), "--set", "run.total_env_steps=9000"), DEFAULT)
    finally:
        stand_in.kill()
        stand_in.wait()
    resume.run_config(args("--resume", str(run_dir), "--set", "run.total_env_steps=9000"), DEFAULT)


def test_init_from_takes_the_best_weights_else_the_newest_checkpoint(tmp_path):
    source = tmp_path / "source"
    store = build_store(load_config(None, []), torch.nn.Linear(2, 2))
    store.version = 40
    CheckpointManager(source / "checkpoints").save(store)
    new = tmp_path / "new"
    flags = resume.paramserver_args(args("--init-from", str(source)), new)
    assert flags == ["--init-weights", str(new / "init" / "weights.amprl")]
    assert json.loads((new / "init" / "init.json").read_text())["kind"] == "checkpoint"

    (source / "best").mkdir()
    torch.save({"weight": torch.zeros(2, 2)}, source / "best" / "weights-v30.pt")
    (source / "best" / "best.json").write_text(json.dumps({"weights": "weights-v30.pt", "param_version": 30}))
    newer = tmp_path / "newer"
    assert resume.paramserver_args(args("--init-from", str(source)), newer) == [
        "--init-weights", str(newer / "init" / "weights.pt")]
    assert json.loads((newer / "init" / "init.json").read_text())["param_version"] == 30
    # resumed later, the run keeps starting from them (its own checkpoints win in the server)
    assert resume.paramserver_args(args("--resume", str(newer)), newer)[1] == str(newer / "init" / "weights.pt")
    assert resume.paramserver_args(args(), tmp_path / "fresh") == []
    with pytest.raises(ConfigError, match="no best/ weights and no checkpoint"):
        resume.paramserver_args(args("--init-from", str(tmp_path / "empty")), tmp_path / "x")


def test_the_summary_of_a_resumed_run_covers_the_whole_run(tmp_path):
    rows = [{"param_version": v, "mean_return": r, "std_return": 1.0, "env_steps": s, "wall_seconds": w}
            for v, r, s, w in [(10, 50.0, 1000, 5.0), (20, 300.0, 2000, 9.0), (40, 200.0, 4000, 14.0)]]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    previous = {"updates": 100, "wall_seconds": 10.0, "solved": False, "target_return": 250.0}
    segment = {"updates": 80, "wall_seconds": 6.0, "evaluations": 1, "solved": False, "env_steps": 4000,
               "time_to_target_seconds": None, "best_eval_return": 200.0}
    out = resume.whole_run(segment, previous, tmp_path, target_return=250.0)
    assert out["segments"] == 2 and out["updates"] == 180 and out["wall_seconds"] == 16.0
    assert out["evaluations"] == 3 and out["best_eval_return"] == 300.0
    assert out["final_eval_return"] == 200.0 and out["env_steps"] == 4000
    assert out["solved"] and out["steps_to_target"] == 2000
    assert out["time_to_target_seconds"] == 9.0  # reached in the first segment: the evaluator's clock
    again = resume.whole_run({**segment, "updates": 1, "wall_seconds": 1.0}, out, tmp_path, 250.0)
    assert again["segments"] == 3 and again["updates"] == 181
