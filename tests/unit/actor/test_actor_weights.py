"""The actor's weight refreshes against a parameter server stub (no services)."""

from __future__ import annotations

import threading
import time
import types

import torch

from amprl.actor.actor import Actor
from amprl.config import load_config
from amprl.envs.factory import env_spec
from amprl.paramserver.client import Pulled
from amprl.algos import build_model


class StubParameterServer:
    """Serves fixed weights at ``version`` of ``incarnation``; counts pulls that returned
    weights."""

    def __init__(self, weights: dict, version: int = 0, incarnation: int = 11):
        self.weights, self.version, self.pulls_with_weights = weights, version, 0
        self.incarnation = incarnation
        self.pulls = 0

    def info(self, timeout=None):
        return types.SimpleNamespace(version=self.version)

    def pull_versioned(self, have_version=0, have_incarnation=0, *, encoding="fp32", timeout=None):
        self.pulls += 1
        # the server's rule: have_version 0 = "none"; another incarnation's number is moot
        if (have_version == self.version and self.version != 0
                and have_incarnation in (0, self.incarnation)):
            return Pulled(self.version, self.incarnation, None)
        self.pulls_with_weights += 1
        return Pulled(self.version, self.incarnation, {k: v.clone() for k, v in self.weights.items()})


def make_actor(ps, *overrides):
    cfg = load_config(overrides=["algo=dqn", "env.id=CartPole-v1", "actor.envs_per_actor=2",
                                 *overrides])
    return Actor(cfg, env_spec(cfg.env), "actor-w", replay=None, paramserver=ps)


def served_weights():
    cfg = load_config(overrides=["algo=dqn", "env.id=CartPole-v1"])
    torch.manual_seed(123)
    return {k: v.detach().clone() for k, v in build_model(cfg, env_spec(cfg.env)).named_parameters()}


def request_pull_and_wait(actor):
    actor._want_pull.set()
    deadline = time.monotonic() + 5
    while actor._want_pull.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)


def test_version_zero_weights_are_pulled_once_not_on_every_refresh():
    ps = StubParameterServer(served_weights(), version=0)
    actor = make_actor(ps)
    actor.start()
    try:
        for _ in range(3):
            request_pull_and_wait(actor)
        assert ps.pulls_with_weights == 1
        ps.version = 7  # the learner's first update: the next refresh pulls it
        request_pull_and_wait(actor)
        actor._swap_weights()
        assert ps.pulls_with_weights == 2 and actor.version == 7
    finally:
        actor.stop()


def test_version_zero_weights_replace_the_seeded_init_after_a_failed_first_pull():
    weights = served_weights()
    ps = StubParameterServer(weights, version=0)
    actor = make_actor(ps)  # start() not called: acting with the seeded initial weights
    t = threading.Thread(target=actor._pull_loop, daemon=True)
    t.start()
    try:
        request_pull_and_wait(actor)
        actor._swap_weights()
        for name, value in actor.model.named_parameters():
            torch.testing.assert_close(value.detach(), weights[name])
    finally:
        actor._stop.set()
        t.join(timeout=2)


def test_a_restarted_parameter_server_with_lower_versions_is_adopted_at_once():
    ps = StubParameterServer(served_weights(), version=900, incarnation=11)
    actor = make_actor(ps)
    actor.start()
    try:
        assert (actor.version, actor.incarnation) == (900, 11)
        # restarted from a checkpoint 300 versions older: new incarnation, lower number,
        # other weights
        torch.manual_seed(7)
        ps.weights = {k: torch.randn_like(v) for k, v in ps.weights.items()}
        ps.version, ps.incarnation = 600, 12
        request_pull_and_wait(actor)
        actor._swap_weights()
        assert (actor.version, actor.incarnation) == (600, 12)
        for name, value in actor.model.named_parameters():
            torch.testing.assert_close(value.detach(), ps.weights[name])
        # and the same number of the new life is not pulled again
        request_pull_and_wait(actor)
        assert ps.pulls_with_weights == 2
    finally:
        actor.stop()


def test_an_actor_that_takes_no_steps_still_pulls_every_weight_refresh_s():
    """A fleet held back by replay's rate limiter steps slowly: its weights must not age
    with its steps."""
    ps = StubParameterServer(served_weights(), version=5)
    actor = make_actor(ps, "actor.weight_refresh_s=0.3", "actor.weight_refresh_steps=1000000")
    actor.start()  # the env loop never runs
    try:
        assert actor.version == 5 and ps.pulls == 1
        ps.version = 6
        deadline = time.monotonic() + 5
        while ps.pulls_with_weights < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        actor._swap_weights()
        assert actor.version == 6
        time.sleep(1.0)
        assert 3 <= ps.pulls <= 8, ps.pulls  # about one per 0.3 s, not a busy loop
    finally:
        actor.stop()
