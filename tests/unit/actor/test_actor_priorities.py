"""The actor's Ape-X initial priorities: one forward pass over distinct observations gives
exactly |δ| of double DQN with the actor's network as online and target."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from amprl.actor.actor import Actor
from amprl.config import load_config
from amprl.envs.factory import env_spec
from amprl.rl import dqn
from amprl.rl.batch import Batch


def chunks_of(actor: Actor, env_steps: int):
    actor.run(threading.Event(), max_steps=env_steps)
    items = []
    while not actor._outbox.empty():
        items.append(actor._outbox.get_nowait())
    assert items
    return items


@pytest.mark.parametrize("overrides", [
    ["env.id=CartPole-v1", "env.max_episode_steps=20"],  # vectors, episode ends inside chunks
    ["env.id=ALE/Pong-v5", "env.frame_stack=4", "env.max_episode_steps=30", "actor.envs_per_actor=2"],
])
def test_priorities_equal_double_dqn_td_error_of_the_actors_network(overrides):
    if "ALE" in overrides[0]:
        pytest.importorskip("ale_py")
    cfg = load_config(overrides=["algo=dqn", "actor.chunk_transitions=32", "dqn.n_step=3", *overrides])
    spec = env_spec(cfg.env)
    actor = Actor(cfg, spec, "actor-prio", replay=None, paramserver=None)
    for chunk, prios, _ in chunks_of(actor, 60 * cfg.actor.envs_per_actor)[:3]:
        batch = Batch.from_chunk(chunk, frame_stack=spec.frame_stack)
        with torch.no_grad():
            expected = dqn.dqn_td_abs(actor.model, actor.model, batch, double=True).numpy()
        np.testing.assert_allclose(prios, expected + cfg.replay.priority_epsilon, rtol=1e-4, atol=1e-5)
