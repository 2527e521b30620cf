"""DQNAlgo: its target network follows the ``dqn`` section, and with
``learner.overlap_targets`` the bootstrap targets come from a second thread, under the update
thread's autocast, with the loss, TD errors and gradients of the one-thread path."""

from __future__ import annotations

import threading

import pytest
import torch

from amprl import errors
from amprl.algos import build_model
from amprl.algos.dqn import losses
from amprl.algos.dqn.learning import DQNAlgo
from amprl.config import load_config
from amprl.envs.factory import env_spec
from amprl.rl.batch import Batch


def make_batch(spec, size: int = 32, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    shape = (size, *spec.obs_shape)
    return Batch(obs=torch.randn(shape, generator=g), actions=torch.randint(0, spec.num_actions, (size,), generator=g),
                 rewards=torch.randn(size, generator=g), discounts=torch.full((size,), 0.97),
                 next_obs=torch.randn(shape, generator=g), weights=torch.rand(size, generator=g) + 0.5)


def loss_and_grads(algo: DQNAlgo, batch: Batch, autocast: torch.dtype | None):
    algo.model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        loss, td_abs = algo.loss(batch, 0)
    loss.backward()
    return loss.detach(), td_abs, {n: p.grad.clone() for n, p in algo.model.named_parameters()}


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_overlapped_targets_equal_the_one_thread_path(autocast, monkeypatch):
    cfg = load_config(None, ["network.hidden_sizes=[32, 32]"])
    spec = env_spec(cfg.env)
    torch.manual_seed(0)
    model = build_model(cfg, spec)
    plain = DQNAlgo(cfg, model, torch.device("cpu"))
    overlapped = DQNAlgo(load_config(None, ["network.hidden_sizes=[32, 32]", "learner.overlap_targets=true"]),
                         model, torch.device("cpu"))
    # a target net that differs from the online one, so double DQN's two nets both matter
    for algo in (plain, overlapped):
        with torch.no_grad():
            for p in algo.target.module.parameters():
                p.mul_(0.5)
    threads = []
    original = losses.dqn_targets

    def recording(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return original(*args, **kwargs)

    monkeypatch.setattr(losses, "dqn_targets", recording)
    try:
        for seed in range(2):
            batch = make_batch(spec, seed=seed)
            want = loss_and_grads(plain, batch, autocast)
            got = loss_and_grads(overlapped, batch, autocast)
            # bit for bit: the same ops in the same dtype (bf16 only if autocast reached the thread)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            assert all(torch.equal(got[2][n], want[2][n]) for n in want[2])
    finally:
        overlapped.close()
    assert threads[0::2] == ["MainThread"] * 2
    assert all(name.startswith("learner-targets") for name in threads[1::2])


def test_overlap_targets_is_dqn_only():
    with pytest.raises(errors.ConfigError, match="learner.overlap_targets"):
        load_config("configs/pendulum-td3.yaml", ["learner.overlap_targets=true"])


@pytest.mark.parametrize("overrides", [["dqn.target_update_period=3"], ["dqn.tau=0.01"]])
def test_the_target_network_follows_the_dqn_section(overrides):
    cfg = load_config(None, ["network.hidden_sizes=[8]", *overrides])
    algo = DQNAlgo(cfg, build_model(cfg, env_spec(cfg.env)), torch.device("cpu"))
    assert (algo.target.tau, algo.target.period) == (cfg.dqn.tau, cfg.dqn.target_update_period)
