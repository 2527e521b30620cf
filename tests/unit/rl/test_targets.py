"""Target networks: Polyak averaging, hard copies every K versions, version jumps."""

from __future__ import annotations

import torch
from torch import nn

from amprl.rl.targets import TargetNetwork, hard_update, make_target, soft_update


def net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def params(m):
    return [p.detach().clone() for p in m.parameters()]


def test_soft_update_is_polyak_average():
    target, online = net(0), net(1)
    t0, o0 = params(target), params(online)
    soft_update(target, online, 0.005)
    for t, a, b in zip(target.parameters(), t0, o0):
        torch.testing.assert_close(t, 0.995 * a + 0.005 * b)
    assert all(torch.equal(p, q) for p, q in zip(online.parameters(), o0))  # online untouched


def test_hard_update_copies():
    target, online = net(0), net(1)
    hard_update(target, online)
    assert all(torch.equal(a, b) for a, b in zip(target.parameters(), online.parameters()))


def test_make_target_is_frozen_copy():
    online = net(0)
    target = make_target(online)
    assert all(not p.requires_grad for p in target.parameters())
    with torch.no_grad():
        online[0].weight.add_(1.0)
    assert not torch.equal(target[0].weight, online[0].weight)


def test_hard_copy_every_period_versions():
    online = net(0)
    tn = TargetNetwork(online, period=3)
    copied = []
    for v in range(1, 8):
        with torch.no_grad():
            online[0].bias.fill_(float(v))
        copied.append(tn.maybe_update(online, v))
    assert copied == [False, False, True, False, False, True, False]
    assert torch.equal(tn.module[0].bias, torch.full((4,), 6.0))


def test_hard_copy_when_versions_jump_past_the_period():
    online = net(0)
    tn = TargetNetwork(online, period=10)
    assert not tn.maybe_update(online, 9)
    assert tn.maybe_update(online, 25) and tn.version == 25
    assert not tn.maybe_update(online, 25)


def test_polyak_per_version_elapsed_equals_repeated_updates():
    online, ref = net(1), make_target(net(0))
    tn = TargetNetwork(net(0), tau=0.1)
    for _ in range(3):
        soft_update(ref, online, 0.1)
    assert tn.maybe_update(online, 3)
    for a, b in zip(tn.module.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)


def test_version_going_back_resyncs():
    online = net(0)
    tn = TargetNetwork(online, period=100, version=50)
    with torch.no_grad():
        online[2].bias.fill_(7.0)
    assert tn.maybe_update(online, 10)  # server restored an older checkpoint
    assert torch.equal(tn.module[2].bias, online[2].bias)


def test_calling_the_target_runs_its_module():
    tn = TargetNetwork(net(0), tau=0.005)
    assert tn(torch.zeros(1, 3)).shape == (1, 2)
