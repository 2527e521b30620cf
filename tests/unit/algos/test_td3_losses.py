"""TD3: clipped target smoothing, min of twin critics, actor loss, policy delay."""

from __future__ import annotations

import numpy as np
import torch

from amprl.config import load_config
from amprl.envs.spec import EnvSpec
from amprl.rl.batch import Batch
from amprl.algos import build_model
from amprl.algos.td3.losses import (policy_update_due, smoothed_target_actions, td3_actor_loss,
                          td3_critic_loss, td3_targets, td3_td_abs)

SPEC = EnvSpec((3,), np.dtype(np.float32), 1, False, action_dim=2,
               action_low=(-2.0, -2.0), action_high=(2.0, 2.0))


def model(seed=0):
    torch.manual_seed(seed)
    return build_model(load_config(overrides=["algo=td3", "td3.hidden_sizes=[16, 16]"]), SPEC)


def set_constant(critic, value):
    """Makes a critic output ``value`` for every input."""
    with torch.no_grad():
        critic.net[-1].weight.zero_()
        critic.net[-1].bias.fill_(value)


def set_actor_constant(m, pre_tanh):
    with torch.no_grad():
        m.actor.net[-1].weight.zero_()
        m.actor.net[-1].bias.fill_(pre_tanh)


def make_batch(b=6, weights=None):
    g = torch.Generator().manual_seed(1)
    return Batch(obs=torch.randn(b, 3, generator=g), actions=torch.rand(b, 2, generator=g) * 4 - 2,
                 rewards=torch.randn(b, generator=g),
                 discounts=torch.tensor([0.99 ** 3, 0.0, 0.99 ** 2, 0.99 ** 3, 0.99, 0.0])[:b],
                 next_obs=torch.randn(b, 3, generator=g), weights=weights)


def test_smoothing_noise_is_clipped_in_half_range_units():
    target = model()
    set_actor_constant(target, 0.0)  # pi'(s') = 0
    obs = torch.randn(4000, 3)
    a = smoothed_target_actions(target, obs, noise=1e6, noise_clip=0.5,
                                generator=torch.Generator().manual_seed(0))
    # the noise saturates at +-clip * half_range = +-0.5 * 2 = +-1
    torch.testing.assert_close(a.abs(), torch.ones_like(a))
    assert 0.45 < (a > 0).float().mean() < 0.55
    b = smoothed_target_actions(target, obs, noise=0.2, noise_clip=0.5,
                                generator=torch.Generator().manual_seed(0))
    assert b.abs().max() <= 1.0 and 0.3 < b.std() < 0.45  # std ~ 0.2 * 2, slightly clipped
    torch.testing.assert_close(smoothed_target_actions(target, obs, noise=0.0, noise_clip=0.5),
                               torch.zeros_like(a))


def test_smoothed_actions_stay_within_action_bounds():
    target = model()
    set_actor_constant(target, 10.0)  # pi'(s') ~ +2, the upper bound
    a = smoothed_target_actions(target, torch.randn(1000, 3), noise=0.5, noise_clip=0.5)
    assert a.max() <= 2.0 and a.min() >= 1.0 - 1e-5


def test_target_takes_min_of_twin_target_critics():
    target = model()
    b = make_batch()
    for c1, c2 in ((3.0, 5.0), (5.0, -1.0)):
        set_constant(target.critic1, c1)
        set_constant(target.critic2, c2)
        y = td3_targets(target, b, noise=0.2, noise_clip=0.5)
        torch.testing.assert_close(y, b.rewards + b.discounts * min(c1, c2))


def test_critic_loss_by_hand_with_is_weights_and_priority_from_critic1():
    online, target = model(0), model(1)
    set_constant(target.critic1, 4.0)
    set_constant(target.critic2, 2.0)
    set_constant(online.critic1, 1.0)
    set_constant(online.critic2, -1.0)
    w = torch.tensor([1.0, 0.5, 2.0, 1.0, 0.25, 1.0])
    b = make_batch(weights=w)
    y = b.rewards + b.discounts * 2.0
    loss, td = td3_critic_loss(online, target, b)
    want = (w * (1.0 - y) ** 2).mean() + (w * (-1.0 - y) ** 2).mean()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(td, (1.0 - y).abs())
    torch.testing.assert_close(td3_td_abs(online, target, b), (1.0 - y).abs())
    info = {}
    td3_critic_loss(online, target, b, info=info)
    torch.testing.assert_close(info["q_mean"], torch.tensor(1.0))  # critic 1's, not critic 2's -1
    torch.testing.assert_close(info["q_max"], torch.tensor(1.0))
    loss.backward()
    assert all(p.grad is None for p in online.actor.parameters())
    assert all(p.grad is None for p in target.parameters())
    assert online.critic2.net[-1].bias.grad is not None


def test_actor_loss_reaches_only_the_actor():
    m = model()
    obs = torch.randn(8, 3)
    loss = td3_actor_loss(m, obs)
    torch.testing.assert_close(loss, -m.critic1(obs, m(obs)).mean())
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.actor.parameters())
    assert all(p.grad is None for p in m.critic1.parameters())
    assert all(p.grad is None for p in m.critic2.parameters())


def test_combined_backward_gives_each_part_its_own_gradient():
    online, target = model(0), model(1)
    b = make_batch()
    c_loss, _ = td3_critic_loss(online, target, b, noise=0.0)
    c_loss.backward()
    critic_grads = [p.grad.clone() for p in online.critic1.parameters()]
    online.zero_grad(set_to_none=True)
    c_loss, _ = td3_critic_loss(online, target, b, noise=0.0)
    (c_loss + td3_actor_loss(online, b.obs)).backward()
    for g, p in zip(critic_grads, online.critic1.parameters()):
        torch.testing.assert_close(p.grad, g)


def test_policy_update_every_d_critic_updates():
    assert [policy_update_due(k, 2) for k in range(0, 7)] == [False, False, True, False, True, False, True]
    assert all(policy_update_due(k, 1) for k in range(1, 5))
