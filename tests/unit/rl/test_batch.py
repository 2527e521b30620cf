"""Batch: stacks rebuilt from chunk frames on the target device; actor-side priorities."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from amprl.actor.nstep import NStepChunker
from amprl.rl.transitions import stacked
from amprl.config import load_config
from amprl.envs.spec import EnvSpec
from amprl.algos import build_model
from amprl.algos.dqn.losses import dqn_loss, dqn_td_abs
from amprl.algos.td3.losses import td3_actor_loss, td3_critic_loss, td3_td_abs
from amprl.rl.batch import Batch
from amprl.rl.targets import make_target, soft_update

ATARI = EnvSpec((84, 84), np.dtype(np.uint8), 4, True, num_actions=6)
CHEETAH = EnvSpec((17,), np.dtype(np.float32), 1, False, action_dim=6,
                  action_low=(-1.0,) * 6, action_high=(1.0,) * 6)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def atari_chunk(T=16):
    rng = np.random.default_rng(0)
    ch = NStepChunker(2, 3, 0.99, 4, T)
    ch.reset(rng.integers(0, 255, (2, 84, 84), dtype=np.uint8))
    while True:
        out = ch.step(rng.integers(0, 6, 2), rng.normal(size=2), [False, False], [False, False],
                      rng.integers(0, 255, (2, 84, 84), dtype=np.uint8))
        if out:
            return out[0]


def cheetah_chunk(T=32):
    rng = np.random.default_rng(0)
    ch = NStepChunker(4, 1, 0.99, 1, T)
    ch.reset(rng.normal(size=(4, 17)).astype(np.float32))
    while True:
        out = ch.step(rng.uniform(-1, 1, (4, 6)).astype(np.float32), rng.normal(size=4),
                      [False] * 4, [False] * 4, rng.normal(size=(4, 17)).astype(np.float32))
        if out:
            return out[0]


@pytest.mark.parametrize("device", DEVICES)
def test_atari_chunk_to_batch_keeps_uint8_and_scores_priorities(device):
    c = atari_chunk()
    b = Batch.from_chunk(c, frame_stack=4, device=device)
    assert b.obs.dtype == torch.uint8 and b.obs.shape == (16, 4, 84, 84)
    assert b.obs.device.type == device
    np.testing.assert_array_equal(b.next_obs.cpu().numpy(), stacked(c.frames, c.next_obs_idx))
    torch.manual_seed(0)
    model = build_model(load_config(), ATARI).to(device)
    td = dqn_td_abs(model, model, b)
    assert td.shape == (16,) and torch.isfinite(td).all()
    loss, td2 = dqn_loss(model, make_target(model), b)
    torch.testing.assert_close(td, td2)


@pytest.mark.parametrize("device", DEVICES)
def test_td3_batch_from_vector_chunk(device):
    c = cheetah_chunk()
    b = Batch.from_chunk(c, frame_stack=1, device=device,
                         weights=np.linspace(0.1, 1, 32, dtype=np.float32))
    assert b.obs.shape == (32, 17) and b.actions.dtype == torch.float32
    torch.manual_seed(0)
    model = build_model(load_config(overrides=["algo=td3"]), CHEETAH).to(device)
    target = make_target(model)
    c_loss, td = td3_critic_loss(model, target, b)
    (c_loss + td3_actor_loss(model, b.obs)).backward()
    assert td.shape == (32,) and td3_td_abs(model, target, b).shape == (32,)
    soft_update(target, model, 0.005)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_losses_under_autocast(device, dtype):
    torch.manual_seed(0)
    model = build_model(load_config(), ATARI).to(device)
    b = Batch.from_chunk(atari_chunk(), frame_stack=4, device=device)
    with torch.autocast(device, dtype=dtype):
        loss, td = dqn_loss(model, make_target(model), b)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    td3 = build_model(load_config(overrides=["algo=td3"]), CHEETAH).to(device)
    bt = Batch.from_chunk(cheetah_chunk(), frame_stack=1, device=device)
    with torch.autocast(device, dtype=dtype):
        c_loss, _ = td3_critic_loss(td3, make_target(td3), bt)
        a_loss = td3_actor_loss(td3, bt.obs)
    assert c_loss.dtype == torch.float32 and torch.isfinite(c_loss + a_loss)
    (c_loss + a_loss).backward()
