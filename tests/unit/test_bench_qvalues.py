"""bench/qvalues.py: the Q-values of a run folder's newest checkpoint over its greedy states."""

import importlib.util
from pathlib import Path

import pytest
import torch

from amprl.config import dump_config, load_config
from amprl.envs.factory import env_spec
from amprl.paramserver.checkpoint import CheckpointManager
from amprl.paramserver.store import build_store
from amprl.algos import build_model

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_qvalues", ROOT / "bench" / "qvalues.py")
qvalues = importlib.util.module_from_spec(spec)
spec.loader.exec_module(qvalues)


def write_run(run_dir: Path, value: float, advantages: tuple[float, float], version: int) -> None:
    """A run folder whose checkpoint holds a dueling CartPole network with every weight 0:
    Q(s) = value + A - mean(A) in every state, whatever the observation."""
    cfg = load_config(str(ROOT / "configs" / "cartpole-dqn.yaml"), ["network.hidden_sizes=[8]"])
    run_dir.mkdir()
    dump_config(cfg, run_dir / "config.yaml")
    model = build_model(cfg, env_spec(cfg.env))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.value[0].bias.fill_(value)
        model.advantage[0].bias.copy_(torch.tensor(advantages))
    store = build_store(cfg, model)
    store.version = version
    CheckpointManager(run_dir / "checkpoints").save(store, force=True)


def test_reports_the_q_values_and_gap_of_the_newest_checkpoint(tmp_path):
    write_run(tmp_path / "run", value=100.0, advantages=(0.0, 3.0), version=7)
    report = qvalues.q_report(tmp_path / "run", episodes=3, seed=5)
    # A = (0, 3) - 1.5: Q = (98.5, 101.5); always action 1, so CartPole falls within ~10 steps
    assert report["checkpoint_version"] == 7
    assert report["mean_max_q"] == pytest.approx(101.5)
    assert report["largest_max_q"] == pytest.approx(101.5)
    assert report["median_action_gap"] == pytest.approx(3.0)
    assert 5 <= report["greedy_mean_return"] <= 30
    # one greedy decision per step taken, reward 1 per step
    assert report["states"] == pytest.approx(3 * report["greedy_mean_return"], abs=0.2)


def test_a_run_without_checkpoints_is_a_clear_error(tmp_path):
    write_run(tmp_path / "run", value=0.0, advantages=(0.0, 0.0), version=1)
    for f in (tmp_path / "run" / "checkpoints").iterdir():
        f.unlink()
    with pytest.raises(SystemExit, match="no checkpoint"):
        qvalues.q_report(tmp_path / "run", episodes=1, seed=0)
