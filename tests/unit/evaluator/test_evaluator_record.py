"""What an evaluation record says about when its policy existed."""

from __future__ import annotations

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
