"""The actor's TD3 path on real Pendulum envs (no services: replay and PS are not called)."""

from __future__ import annotations

import threading

import numpy as np
import torch

from amprl.actor.actor import Actor
from amprl.algos.td3.losses import td3_td_abs
from amprl.config import load_config
from amprl.envs.factory import env_spec
from amprl.rl.batch import Batch


def make_actor(**overrides):
    cfg = load_config(overrides=["algo=td3", "env.id=Pendulum-v1", "td3.hidden_sizes=[16, 16]",
                                 "actor.envs_per_actor=4", "actor.chunk_transitions=8",
                                 *[f"{k}={v}" for k, v in overrides.items()]])
    return Actor(cfg, env_spec(cfg.env), "actor-test", replay=None, paramserver=None)


def test_uniform_random_actions_during_the_first_random_steps():
    actor = make_actor(**{"td3.random_steps": 100})
    obs = np.zeros((4, 3), dtype=np.float32)
    acts = np.concatenate([actor.act(obs) for _ in range(200)])
    assert acts.dtype == np.float32 and acts.shape == (800, 1)
    assert acts.min() >= -2 and acts.max() <= 2
    assert acts.min() < -1.8 and acts.max() > 1.8  # the whole range, not policy + noise


def test_policy_plus_gaussian_noise_clipped_to_the_bounds_afterwards():
    actor = make_actor(**{"td3.random_steps": 0, "td3.exploration_noise": 0.1})
    obs = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    with torch.no_grad():
        greedy = actor.model.actor(torch.from_numpy(obs)).numpy()
    acts = np.stack([actor.act(obs) for _ in range(500)])  # [500, 4, 1]
    assert acts.dtype == np.float32 and acts.min() >= -2 and acts.max() <= 2
    np.testing.assert_allclose(acts.mean(axis=0), greedy, atol=0.05)
    np.testing.assert_allclose(acts.std(axis=0), 0.1 * 2.0, rtol=0.2)  # 0.1 half-ranges


def test_chunks_carry_float_actions_and_critic_priorities():
    actor = make_actor(**{"td3.random_steps": 8})
    actor.run(threading.Event(), max_steps=4 * 10)
    items = []
    while not actor._outbox.empty():
        items.append(actor._outbox.get_nowait()[:3])
    assert items, "no chunk was built"
    chunk, prios, _ = items[0]
    assert chunk.actions.dtype == np.float32 and chunk.actions.shape == (8, 1)
    assert prios.shape == (8,) and np.isfinite(prios).all() and (prios > 0).all()
    assert actor.epsilon == actor.cfg.td3.exploration_noise


def test_acting_policy_equals_the_models_actor_after_weight_changes():
    actor = make_actor(**{"td3.random_steps": 0})
    obs = np.random.default_rng(1).standard_normal((5, 3)).astype(np.float32)
    with torch.no_grad():
        for p in actor.model.actor.parameters():
            p.mul_(-1.5)
    actor.behaviour.policy.sync()
    with torch.no_grad():
        want = actor.model.actor(torch.from_numpy(obs)).numpy()
    np.testing.assert_allclose(actor.behaviour.policy(obs), want, rtol=1e-5, atol=1e-6)


def test_priorities_equal_the_td3_td_error_of_the_actors_networks_over_each_chunk():
    """Scored from the acting passes (Q1 of the action taken, min(Q1, Q2)(s', pi(s')) carried
    through the n-step window, truncated episodes' final observations scored apart), the
    priorities equal |Q1(s, a) - y| of the TD3 target without smoothing noise, computed over
    each chunk with the actor's networks as model and target."""
    actor = make_actor(**{"td3.random_steps": 40, "td3.n_step": 3, "env.max_episode_steps": 20,
                          "td3.hidden_sizes": "[32, 32]"})
    actor.run(threading.Event(), max_steps=4 * 60)  # random then policy actions, 12 truncations
    items = []
    while not actor._outbox.empty():
        items.append(actor._outbox.get_nowait()[:3])
    assert len(items) >= 20
    chunks = [chunk for chunk, _, _ in items]
    disc = np.concatenate([c.discounts for c in chunks])
    gamma = actor.cfg.gamma
    assert (np.isclose(disc, gamma ** 3).any() and (disc > gamma ** 3 + 1e-6).any()), \
        "expected full windows and windows cut short by truncation"
    for chunk, prios, _ in items:
        batch = Batch.from_chunk(chunk, frame_stack=1)
        with torch.no_grad():
            expected = td3_td_abs(actor.model, actor.model, batch, noise=0.0).numpy()
        np.testing.assert_allclose(prios, expected + actor.cfg.replay.priority_epsilon, rtol=1e-4, atol=1e-4)
