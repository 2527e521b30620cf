"""The actor's Ape-X initial priorities: |δ| of double DQN with the actor's network as online
and target, from the Q-values of its acting passes, checked against a direct forward pass of
the network over each chunk's transitions."""

from __future__ import annotations

import copy
import threading

import numpy as np
import pytest
import torch

from amprl.actor.actor import Actor
from amprl.algos import build_model
from amprl.algos.dqn import losses
from amprl.algos.dqn.acting import ActingQNetwork
from amprl.config import load_config
from amprl.envs.factory import env_spec
from amprl.rl.acting import native_bf16
from amprl.rl.batch import Batch


def chunks_of(actor: Actor, env_steps: int):
    actor.run(threading.Event(), max_steps=env_steps)
    items = []
    while not actor._outbox.empty():
        items.append(actor._outbox.get_nowait()[:3])
    assert items
    return items


def reference_td_abs(model, chunk, spec) -> np.ndarray:
    batch = Batch.from_chunk(chunk, frame_stack=spec.frame_stack)
    with torch.no_grad():
        return losses.dqn_td_abs(model, model, batch, double=True).float().numpy()


@pytest.mark.parametrize("overrides", [
    ["env.id=CartPole-v1", "env.max_episode_steps=20"],  # vectors, truncations inside chunks
    ["env.id=CartPole-v1", "env.max_episode_steps=20", "network.dueling=false", "env.frame_stack=2"],
    ["env.id=ALE/Pong-v5", "env.frame_stack=4", "env.max_episode_steps=30", "actor.envs_per_actor=2"],
])
def test_priorities_equal_double_dqn_td_error_of_the_actors_network(overrides):
    if "ALE" in overrides[0]:
        pytest.importorskip("ale_py")
    cfg = load_config(overrides=["algo=dqn", "actor.chunk_transitions=32", "dqn.n_step=3",
                                 "learner.precision=fp32", *overrides])
    spec = env_spec(cfg.env)
    actor = Actor(cfg, spec, "actor-prio", replay=None, paramserver=None)
    items = chunks_of(actor, 60 * cfg.actor.envs_per_actor)
    assert any((c.discounts > 0).any() and (c.discounts < cfg.gamma ** 3).any() for c, _, _ in items) \
        or "ALE" in overrides[0]  # CartPole: truncated windows bootstrap from final observations
    for chunk, prios, _ in items[:4]:
        expected = reference_td_abs(actor.model, chunk, spec)
        np.testing.assert_allclose(prios, expected + cfg.replay.priority_epsilon, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not native_bf16(), reason="this CPU has no native bf16")
def test_bf16_runs_act_and_score_with_a_bf16_copy_close_to_fp32():
    pytest.importorskip("ale_py")
    cfg = load_config(overrides=["algo=dqn", "actor.chunk_transitions=32", "dqn.n_step=3",
                                 "learner.precision=bf16", "env.id=ALE/Pong-v5", "env.frame_stack=4",
                                 "env.max_episode_steps=30", "actor.envs_per_actor=2"])
    spec = env_spec(cfg.env)
    actor = Actor(cfg, spec, "actor-prio", replay=None, paramserver=None)
    assert actor.behaviour.q_net.dtype == torch.bfloat16
    items = chunks_of(actor, 60 * cfg.actor.envs_per_actor)
    bf16 = copy.deepcopy(actor.model).to(torch.bfloat16)
    for chunk, prios, _ in items[:3]:
        td = prios - cfg.replay.priority_epsilon
        batch = Batch.from_chunk(chunk, frame_stack=spec.frame_stack)
        with torch.no_grad():  # an independent bf16 forward pass (frames scaled in fp32)
            q = lambda x: bf16(x.float().div(255).to(torch.bfloat16)).float()  # noqa: E731
            q_sa = q(batch.obs).gather(1, batch.actions.reshape(-1, 1)).squeeze(1)
            want = (q_sa - batch.rewards - batch.discounts * q(batch.next_obs).max(dim=1).values).abs()
            q_scale = float(q(batch.obs).abs().max())
        np.testing.assert_allclose(td, want.numpy(), atol=0.01 * q_scale)
        np.testing.assert_allclose(td, reference_td_abs(actor.model, chunk, spec), atol=0.02 * q_scale)


PONG = ["env.id=ALE/Pong-v5", "env.frame_stack=4"]


@pytest.mark.parametrize("overrides", [[], ["network.dueling=false"], ["env.frame_stack=3"],
                                       PONG, [*PONG, "network.dueling=false"]])
def test_acting_q_network_equals_the_models_forward_after_weight_changes(overrides):
    if overrides[:1] == PONG[:1]:
        pytest.importorskip("ale_py")
    cfg = load_config(overrides=["algo=dqn", "env.id=CartPole-v1", *overrides])
    spec = env_spec(cfg.env)
    model = build_model(cfg, spec).eval()
    acting = ActingQNetwork(model)
    rng = np.random.default_rng(0)
    if spec.frame_dtype == np.uint8:  # Atari: frames, through the convolutions' own path
        assert acting._convs is not None
        obs = rng.integers(0, 256, (5, *spec.obs_shape), dtype=np.uint8)
    else:
        obs = rng.standard_normal((5, *spec.obs_shape)).astype(np.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.5)
    acting.sync()
    with torch.no_grad():
        want = model(torch.from_numpy(obs)).numpy()
    got = acting(obs)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(want).max())))


@pytest.mark.skipif(not native_bf16(), reason="this CPU has no native bf16")
@pytest.mark.parametrize("dueling", [True, False])
def test_bf16_acting_q_network_of_the_nature_cnn_is_close_to_fp32(dueling):
    pytest.importorskip("ale_py")
    cfg = load_config(overrides=["algo=dqn", *PONG, f"network.dueling={str(dueling).lower()}"])
    spec = env_spec(cfg.env)
    model = build_model(cfg, spec).eval()
    acting = ActingQNetwork(model, torch.bfloat16)
    obs = np.random.default_rng(1).integers(0, 256, (8, *spec.obs_shape), dtype=np.uint8)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.0)
        want = model(torch.from_numpy(obs)).numpy()
    acting.sync()
    np.testing.assert_allclose(acting(obs), want, atol=0.02 * float(np.abs(want).max()))
