"""dqn_loss: n-step targets, double-DQN action selection, IS weights, terminal discounts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from amprl.rl.batch import Batch
from amprl.algos.dqn.losses import dqn_loss, dqn_td_abs, dqn_targets, greedy_actions

ONLINE_Q = [[1.0, 2.0], [3.0, 0.5], [0.0, 4.0]]    # Q_online(s, a) for states s0, s1, s2
TARGET_Q = [[10.0, 20.0], [5.0, 7.0], [6.0, 1.0]]  # Q_target(s, a)


def table(q) -> nn.Module:
    """A Q-network over one-hot states whose values are exactly the table."""
    net = nn.Linear(3, 2, bias=False)
    with torch.no_grad():
        net.weight.copy_(torch.tensor(q).T)
    return net


def onehot(*states):
    return torch.eye(3)[list(states)]


def batch(weights=None):
    # A: s0 --a=1--> ... 3 steps later s1, n-step return 1.5, discount 0.9^3
    # B: s1 --a=0--> terminal within n steps: return 2.0, discount 0, next obs s2 (ignored)
    return Batch(obs=onehot(0, 1), actions=torch.tensor([1, 0]),
                 rewards=torch.tensor([1.5, 2.0]), discounts=torch.tensor([0.9 ** 3, 0.0]),
                 next_obs=onehot(1, 2), weights=weights)


def test_double_dqn_target_takes_online_argmax_and_target_value():
    y = dqn_targets(table(ONLINE_Q), table(TARGET_Q), batch(), double=True)
    # argmax_a Q_online(s1) = 0 (3.0 > 0.5); Q_target(s1, 0) = 5, not max Q_target(s1) = 7
    torch.testing.assert_close(y, torch.tensor([1.5 + 0.729 * 5.0, 2.0]))


def test_plain_dqn_target_takes_target_max():
    y = dqn_targets(table(ONLINE_Q), table(TARGET_Q), batch(), double=False)
    torch.testing.assert_close(y, torch.tensor([1.5 + 0.729 * 7.0, 2.0]))


def test_terminal_discount_zero_ignores_next_state():
    b = batch()
    b.next_obs = onehot(1, 0)  # a different next state for B changes nothing
    y = dqn_targets(table(ONLINE_Q), table(TARGET_Q), b)
    assert y[1].item() == 2.0


def test_loss_and_td_abs_by_hand():
    online, target = table(ONLINE_Q), table(TARGET_Q)
    loss, td = dqn_loss(online, target, batch(), double=True, huber_delta=1.0)
    # A: Q(s0,1) = 2, y = 5.145, |delta| = 3.145 -> huber 3.145 - 0.5; B: Q(s1,0) = 3, y = 2, |delta| = 1 -> 0.5
    torch.testing.assert_close(td, torch.tensor([3.145, 1.0]))
    torch.testing.assert_close(loss, torch.tensor((2.645 + 0.5) / 2))
    info = {}
    dqn_loss(online, target, batch(), info=info)
    torch.testing.assert_close(info["q_mean"], torch.tensor((2.0 + 3.0) / 2))  # Q(s0,1), Q(s1,0)
    torch.testing.assert_close(info["q_max"], torch.tensor(3.0))
    loss.backward()
    assert target.weight.grad is None  # no gradient through the target
    g = online.weight.grad  # [action, state]
    # d/dQ mean huber = clip(delta, -1, 1) / B: only the taken (s, a) cells move
    torch.testing.assert_close(g, torch.tensor([[0.0, 0.5, 0.0], [-0.5, 0.0, 0.0]]))


def test_no_gradient_flows_through_the_bootstrap_target():
    online = table(ONLINE_Q)
    b = Batch(obs=onehot(0), actions=torch.tensor([0]), rewards=torch.tensor([0.0]),
              discounts=torch.tensor([1.0]), next_obs=onehot(0))
    # Online is its own target: y = Q(s0, argmax) = 2 depends on the weights, but only Q(s0, 0) is differentiated.
    loss, _ = dqn_loss(online, online, b, huber_delta=10.0)
    loss.backward()
    # loss = 0.5 (Q(s0,0) - y)^2 = 0.5 (1 - 2)^2; dL/dQ(s0,0) = -1, nothing reaches Q(s0,1)
    torch.testing.assert_close(online.weight.grad, torch.tensor([[-1.0, 0, 0], [0.0, 0, 0]]))


def test_importance_weights_scale_each_sample():
    online, target = table(ONLINE_Q), table(TARGET_Q)
    loss, _ = dqn_loss(online, target, batch(torch.tensor([0.5, 2.0])))
    torch.testing.assert_close(loss, torch.tensor((0.5 * 2.645 + 2.0 * 0.5) / 2))
    loss.backward()
    torch.testing.assert_close(online.weight.grad, torch.tensor([[0.0, 1.0, 0.0], [-0.25, 0.0, 0.0]]))
    ones, _ = dqn_loss(online, target, batch(torch.ones(2)))
    none, _ = dqn_loss(online, target, batch(None))
    torch.testing.assert_close(ones, none)


def test_huber_delta_sets_the_quadratic_zone():
    loss, _ = dqn_loss(table(ONLINE_Q), table(TARGET_Q), batch(), huber_delta=4.0)
    torch.testing.assert_close(loss, torch.tensor((0.5 * 3.145 ** 2 + 0.5) / 2))


def test_td_abs_without_graph_matches_loss():
    online, target = table(ONLINE_Q), table(TARGET_Q)
    _, td = dqn_loss(online, target, batch())
    td2 = dqn_td_abs(online, target, batch())
    assert not td2.requires_grad
    torch.testing.assert_close(td, td2)


def test_greedy_actions_batched_from_numpy_or_tensor():
    online = table(ONLINE_Q)
    torch.testing.assert_close(greedy_actions(online, onehot(0, 1, 2)), torch.tensor([1, 0, 1]))
    torch.testing.assert_close(greedy_actions(online, onehot(2, 1).numpy()), torch.tensor([1, 0]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_loss_is_float32_under_autocast(dtype):
    torch.manual_seed(0)
    online = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2))
    with torch.autocast("cpu", dtype=dtype):
        loss, td = dqn_loss(online, online, batch())
    assert loss.dtype == torch.float32 and td.dtype == torch.float32
    assert torch.isfinite(loss)
    loss.backward()


def test_td_abs_with_one_network_matches_the_loss_path():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2))
    _, td = dqn_loss(net, net, batch())
    torch.testing.assert_close(dqn_td_abs(net, net, batch()), td)
