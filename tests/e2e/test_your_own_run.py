"""End to end: your own environment (``env.import``, ``env.kwargs``) trains through every
service, a stopped run goes on with ``amprl run --resume``, and a new run starts from
another's weights with ``--init-from``.

The environment is the tests' own (``custom_env.py`` beside this file, on PYTHONPATH as a
user's module would be): a sign to match each step, ``length`` steps an episode, learnt in
about a thousand env steps, so a run reaches its target in seconds.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
import yaml

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent

SIGNAL_CONFIG = """\
name: signal-dqn
algo: dqn
env:
  id: Signal-v0
  import: [custom_env]     # registers Signal-v0 as it is imported
  kwargs: {length: 10}     # Signal(length=10): the best return is 10 (100 without)
network: {hidden_sizes: [64]}
dqn: {gamma: 0.9, n_step: 1}
replay: {min_size_to_sample: 200, samples_per_insert: 8.0}
learner: {batch_size: 64}
paramserver: {lr: 0.001}
actor: {num_actors: 1, envs_per_actor: 8, epsilon_warmup_steps: 0}
evaluator: {interval_s: 1.0, episodes: 10}
run: {total_env_steps: 30000, target_return: 9.5, max_wall_seconds: 90}  # ~2 s of training here
"""


def evals(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def signal_config(tmp_path_factory):
    """The experiment file, with custom_env.py importable by every process of the runs."""
    path = tmp_path_factory.mktemp("signal") / "signal.yaml"
    path.write_text(SIGNAL_CONFIG)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
        yield path


@pytest.fixture(scope="module")
def signal_run(signal_config, amprl_run_module, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("signal-run") / "run"
    code, out = amprl_run_module([str(signal_config), "--run-dir", str(run_dir)], timeout_s=120)
    assert code == 0, out[-4000:]
    return run_dir


def test_your_own_env_trains_from_env_import_with_env_kwargs(signal_run):
    done = summary(signal_run)
    assert done["solved"] and done["stop_reason"] == "target reached", done
    # every evaluation played the env made with kwargs {length: 10}: never above 10
    assert all(0 <= e["mean_return"] <= 10 for e in evals(signal_run))
    cfg = yaml.safe_load((signal_run / "config.yaml").read_text())
    assert cfg["env"]["import"] == ["custom_env"] and cfg["env"]["kwargs"] == {"length": 10}


def test_init_from_starts_a_new_run_from_the_best_weights(signal_config, signal_run, amprl_run, tmp_path):
    run_dir = tmp_path / "warm"
    # lr 1e-9: the new run learns nothing, so whatever it scores its weights brought
    code, out = amprl_run([str(signal_config), "--run-dir", str(run_dir), "--init-from", str(signal_run),
                           "--set", "paramserver.lr=1e-9", "--set", "run.max_wall_seconds=20"],
                          timeout_s=120)
    assert code == 0, out[-4000:]
    record = json.loads((run_dir / "init" / "init.json").read_text())
    assert record["kind"] == "best" and record["from"] == str(signal_run)
    first = evals(run_dir)[0]
    assert first["mean_return"] >= 9.5, first  # a fresh network scores about 5
    # the weights are the source's best (moved by at most the tiny lr's steps) ...
    source = torch.load(signal_run / "best" / Path(record["weights"]).name, weights_only=True)
    from amprl.paramserver.checkpoint import CheckpointManager
    ckpts = CheckpointManager(run_dir / "checkpoints").files()
    state = CheckpointManager.read(ckpts[0][1])
    for name, tensor in source.items():
        assert torch.allclose(state["params"][name], tensor, atol=1e-5), name
    # ... with a new optimizer from version 0 and an empty replay
    ps_log = (run_dir / "logs" / "paramserver.log").read_text()
    assert "initial weights from" in ps_log and "starting from version 0" in ps_log
    assert "rebuilt from Redis" not in (run_dir / "logs" / "replay.log").read_text()
    assert summary(run_dir)["env_steps"] < 10_000


def test_init_from_a_run_of_another_network_fails_at_start_in_one_line(signal_config, signal_run, tmp_path):
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "amprl.cli", "run", str(signal_config),
                           "--run-dir", str(tmp_path / "r"), "--init-from", str(signal_run),
                           "--set", "network.hidden_sizes=[32]"],
                          capture_output=True, text=True, timeout=120, cwd=HERE.parents[1])
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("amprl run: service paramserver failed at start"), line
    assert "--init-weights" in line and "not this config's network" in line, line


def wait_for(predicate, timeout_s: float, what: str, run) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert run.alive(), f"amprl run ended before {what}:\n{run.log()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.2)


def test_resume_goes_on_with_weights_optimizer_replay_and_counters(amprl_run, tmp_path):
    run_dir = tmp_path / "run"
    first = amprl_run.start(["cartpole-dqn", "--run-dir", str(run_dir), "--set", "evaluator.interval_s=1",
                             "--set", "run.max_wall_seconds=120", "--progress-interval", "5"])
    wait_for(lambda: (run_dir / "eval.jsonl").exists() and len(evals(run_dir)) >= 3, 120,
             "three evaluations", first)
    os.killpg(first.pid, signal.SIGINT)  # Ctrl-C
    code, out = amprl_run.finish(first, timeout_s=90)
    assert code == 130, out[-3000:]
    before = summary(run_dir)
    history = (run_dir / "eval.jsonl").read_text()
    stopped_at = int(re.findall(r"stopped at version (\d+)", (run_dir / "logs" / "paramserver.log").read_text())[-1])
    assert stopped_at >= before["param_version"] > 0 and before["replay_size"] > 0

    budget = before["env_steps"] + 3000
    code, out = amprl_run(["--resume", str(run_dir), "--set", f"run.total_env_steps={budget}",
                           "--progress-interval", "5"], timeout_s=180)
    assert code == 0, out[-4000:]
    after = summary(run_dir)
    # weights and optimizer: the parameter server took up its final checkpoint
    ps_log = (run_dir / "logs" / "paramserver.log").read_text()
    assert re.search(rf"resumed from \S+ckpt-{stopped_at:012d}\.amprl \(version {stopped_at}\)", ps_log)
    assert after["param_version"] > stopped_at
    # replay: Redis kept every transition (actors inserted a little after the last poll)
    rebuilt = re.search(r"rebuilt from Redis: (\d+) transitions", (run_dir / "logs" / "replay.log").read_text())
    assert rebuilt and int(rebuilt.group(1)) >= before["replay_size"]
    # counters: env steps go on to the whole run's budget; the history grows
    assert after["env_steps"] >= budget and after["stop_reason"] == "step budget reached"
    now = (run_dir / "eval.jsonl").read_text()
    assert now.startswith(history) and len(now) > len(history)
    rows = evals(run_dir)
    resumed = rows[len(history.splitlines()):]
    assert resumed[0]["param_version"] >= stopped_at and resumed[0]["env_steps"] >= before["env_steps"]
    assert resumed[0]["wall_seconds"] >= rows[len(history.splitlines()) - 1]["wall_seconds"]
    # the summary covers the whole run
    assert after["segments"] == 2 and after["evaluations"] == len(rows)
    assert after["updates"] > before["updates"]
    assert after["wall_seconds"] > before["wall_seconds"]
    assert after["best_eval_return"] == max(r["mean_return"] for r in rows)
    # the config is the run's own, with the new budget
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["run"]["total_env_steps"] == budget and cfg["evaluator"]["interval_s"] == 1
