"""What an evaluation record says about when its policy existed."""

from __future__ import annotations

import json
import time

import torch

from amprl.config import load_config
from amprl.envs.factory import env_spec
from amprl.evaluator import evaluator as evaluator_mod
from amprl.evaluator.evaluator import Evaluator
from amprl.algos import build_model
from amprl.paramserver.client import Pulled


class OnePullPS:
    """Serves version 5 once, then "unchanged"."""

    def __init__(self, weights):
        self.weights = weights
        self.served = False

    def pull_versioned(self, have_version=0, have_incarnation=0, *, encoding="fp32", timeout=None):
        if self.served:
            return Pulled(5, 3, None)
        self.served = True
        return Pulled(5, 3, {k: v.clone() for k, v in self.weights.items()})


def test_the_record_carries_the_time_its_weights_were_pulled_not_when_its_episodes_ended(monkeypatch):
    cfg = load_config(None, ["network.hidden_sizes=[8]", "evaluator.episodes=2"])
    spec = env_spec(cfg.env)
    weights = {n: p.detach().clone() for n, p in build_model(cfg, spec).named_parameters()}
    ev = Evaluator(cfg, spec, OnePullPS(weights), replay=None)

    def slow_episodes(*args, **kwargs):
        time.sleep(0.5)
        return [10.0, 12.0]
    monkeypatch.setattr(evaluator_mod, "run_episodes", slow_episodes)
    before = time.time()
    record = ev.evaluate_once()
    assert record.param_version == 5 and record.mean_return == 11.0
    assert record.unix_time - before < 0.3  # taken at the pull, before the 0.5 s of episodes
    assert ev.evaluate_once() is None  # nothing new: no record
    assert torch.equal(ev._params[next(iter(weights))], next(iter(weights.values())))


class TwoVersionsPS:
    """Serves versions 1, 2, 3 in turn, each with its own weights."""

    def __init__(self, weights_by_version):
        self.weights_by_version = weights_by_version

    def pull_versioned(self, have_version=0, have_incarnation=0, *, encoding="fp32", timeout=None):
        version = have_version + 1
        return Pulled(version, 1, {k: v.clone() for k, v in self.weights_by_version[version].items()})


def test_the_best_scoring_weights_are_kept_with_what_rebuilds_their_network(tmp_path, monkeypatch):
    cfg = load_config(None, ["network.hidden_sizes=[8]", "evaluator.episodes=2"])
    spec = env_spec(cfg.env)
    by_version = {}
    for version in (1, 2, 3):
        torch.manual_seed(version)
        by_version[version] = {n: p.detach().clone() for n, p in build_model(cfg, spec).named_parameters()}
    ev = Evaluator(cfg, spec, TwoVersionsPS(by_version), replay=None, run_dir=str(tmp_path))
    scores = iter([[10.0, 12.0], [50.0, 70.0], [20.0, 20.0]])  # version 2 scores best
    monkeypatch.setattr(evaluator_mod, "run_episodes", lambda *a, **k: next(scores))
    for _ in range(3):
        ev.evaluate_once()
    best = json.loads((tmp_path / "best" / "best.json").read_text())
    assert best["param_version"] == 2 and best["mean_return"] == 60.0
    assert sorted(p.name for p in (tmp_path / "best").glob("weights-v*.pt")) == ["weights-v2.pt"]
    state = torch.load(tmp_path / "best" / best["weights"], weights_only=True)
    model = build_model(load_config(tmp_path / "best" / best["config"]), spec)
    model.load_state_dict(state)  # the config rebuilds the network the weights fit
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), by_version[2][name])


def test_without_a_run_folder_nothing_is_written(tmp_path, monkeypatch):
    cfg = load_config(None, ["network.hidden_sizes=[8]", "evaluator.episodes=2"])
    spec = env_spec(cfg.env)
    weights = {n: p.detach().clone() for n, p in build_model(cfg, spec).named_parameters()}
    ev = Evaluator(cfg, spec, OnePullPS(weights), replay=None)
    monkeypatch.setattr(evaluator_mod, "run_episodes", lambda *a, **k: [1.0, 1.0])
    monkeypatch.chdir(tmp_path)
    ev.evaluate_once()
    assert ev.best_dir is None and not list(tmp_path.iterdir())


def test_on_a_folder_with_history_it_goes_on_with_its_clock_and_its_best(tmp_path, monkeypatch):
    """amprl run --resume: the wall time goes on from the last record, and the best is
    replaced only by a better evaluation."""
    cfg = load_config(None, ["network.hidden_sizes=[8]", "evaluator.episodes=2"])
    spec = env_spec(cfg.env)
    by_version = {v: {n: p.detach().clone() for n, p in build_model(cfg, spec).named_parameters()}
                  for v in (1, 2, 3)}
    first = Evaluator(cfg, spec, TwoVersionsPS(by_version), replay=None, run_dir=str(tmp_path))
    monkeypatch.setattr(evaluator_mod, "run_episodes", lambda *a, **k: [50.0, 50.0])
    first.evaluate_once()
    history = (tmp_path / "eval.jsonl").read_text().splitlines()
    (tmp_path / "eval.jsonl").write_text(  # as if the first life had lasted 100 s
        json.dumps({**json.loads(history[0]), "wall_seconds": 100.0}) + "\n")

    again = Evaluator(cfg, spec, TwoVersionsPS(by_version), replay=None, run_dir=str(tmp_path))
    scores = iter([[10.0, 10.0], [70.0, 70.0]])
    monkeypatch.setattr(evaluator_mod, "run_episodes", lambda *a, **k: next(scores))
    worse = again.evaluate_once()
    assert worse.wall_seconds >= 100.0
    assert json.loads((tmp_path / "best" / "best.json").read_text())["mean_return"] == 50.0
    again.evaluate_once()
    assert json.loads((tmp_path / "best" / "best.json").read_text())["mean_return"] == 70.0
    assert len((tmp_path / "eval.jsonl").read_text().splitlines()) == 3
