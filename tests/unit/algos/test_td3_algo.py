"""TD3Algo: which parameters an update trains, where its gradients go, and the target clock."""

from __future__ import annotations

import numpy as np
import torch

from amprl.algos import build_model, builder
from amprl.algos.td3.learning import TD3Algo
from amprl.algos.td3.losses import td3_critic_loss
from amprl.config import load_config
from amprl.envs.spec import EnvSpec
from amprl.rl.batch import Batch

SPEC = EnvSpec((3,), np.dtype(np.float32), 1, False, action_dim=1, action_low=(-2.0,), action_high=(2.0,))


def setup(**overrides):
    cfg = load_config(overrides=["algo=td3", "td3.hidden_sizes=[16, 16]",
                                 *[f"td3.{k}={v}" for k, v in overrides.items()]])
    torch.manual_seed(0)
    model = build_model(cfg, SPEC)
    return cfg, model, builder("td3").make_learner(cfg, model, torch.device("cpu"))


def batch(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return Batch(torch.randn(n, 3, generator=g), torch.rand(n, 1, generator=g) * 4 - 2,
                 torch.randn(n, generator=g), torch.full((n,), 0.99), torch.randn(n, 3, generator=g),
                 torch.rand(n, generator=g) + 0.5)


def test_critic_only_updates_between_policy_updates():
    cfg, model, algo = setup(policy_delay=2)
    assert isinstance(algo, TD3Algo)
    critic = algo.trainable_names(0)
    everything = algo.trainable_names(1)
    assert critic and all(n.startswith(("critic1.", "critic2.")) for n in critic)
    assert set(everything) == {n for n, _ in model.named_parameters()}
    assert [algo.trainable_names(i) == everything for i in range(6)] == [False, True] * 3
    _, _, algo3 = setup(policy_delay=3)
    assert [algo3.policy_step(i) for i in range(6)] == [False, False, True] * 2


def test_a_critic_step_leaves_the_actor_without_gradients():
    _, model, algo = setup()
    loss, td = algo.loss(batch(), 0)
    loss.backward()
    assert all(p.grad is None for p in model.actor.parameters())
    assert all(p.grad is not None for p in model.critic1.parameters())
    assert td.shape == (32,) and (td >= 0).all()


def test_a_policy_step_gives_each_part_only_its_own_gradient():
    _, model, algo = setup()
    b = batch()
    torch.manual_seed(1)  # same target smoothing noise in both losses
    loss, _ = algo.loss(b, 1)
    loss.backward()
    combined = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert all(combined[n].abs().sum() > 0 for n, _ in model.actor.named_parameters(prefix="actor"))
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    critic_only, _ = td3_critic_loss(model, algo.target.module, b, noise=0.2, noise_clip=0.5)
    critic_only.backward()
    for n, p in model.named_parameters():
        if n.startswith("critic"):  # the actor loss did not leak into the critics
            torch.testing.assert_close(combined[n], p.grad)


def test_targets_move_by_tau_per_policy_update_on_the_version_clock():
    _, model, algo = setup(tau=0.1, policy_delay=2)
    algo.on_weights(0, initial=True)
    t0 = [p.clone() for p in algo.target.module.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    algo.on_weights(1)  # half a policy update: the targets stay
    for a, b in zip(t0, algo.target.module.parameters()):
        torch.testing.assert_close(a, b)
    algo.on_weights(2)  # one policy update: theta' <- 0.9 theta' + 0.1 theta
    for a, b, o in zip(t0, algo.target.module.parameters(), model.parameters()):
        torch.testing.assert_close(b, 0.9 * a + 0.1 * o)
    algo.on_weights(6)  # a jump of two policy updates: tau_eff = 1 - 0.9^2
    for a, b, o in zip(t0, algo.target.module.parameters(), model.parameters()):
        torch.testing.assert_close(b, o + (a - o) * 0.9 ** 3, rtol=1e-5, atol=1e-5)
