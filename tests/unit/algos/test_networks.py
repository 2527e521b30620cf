"""build_model: shapes, dueling identity, uint8 frames end to end, stable parameter names."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from amprl.config import load_config
from amprl.envs.spec import EnvSpec
from amprl.algos import build_model
from amprl.algos.dqn.networks import QNetwork
from amprl.algos.td3.networks import TD3Model

CARTPOLE = EnvSpec((4,), np.dtype(np.float32), 1, True, num_actions=2)
ATARI = EnvSpec((84, 84), np.dtype(np.uint8), 4, True, num_actions=6)
CHEETAH = EnvSpec((17,), np.dtype(np.float32), 1, False, action_dim=6,
                  action_low=(-1.0,) * 6, action_high=(1.0,) * 6)
PENDULUM = EnvSpec((3,), np.dtype(np.float32), 1, False, action_dim=1,
                   action_low=(-2.0,), action_high=(2.0,))


def cfg(*overrides):
    return load_config(overrides=list(overrides))


def test_mlp_q_network_shapes_and_names():
    model = build_model(cfg("network.hidden_sizes=[32, 16]"), CARTPOLE)
    assert isinstance(model, QNetwork)
    assert model(torch.zeros(5, 4)).shape == (5, 2)
    assert list(model.state_dict()) == [
        "trunk.layers.0.weight", "trunk.layers.0.bias", "trunk.layers.2.weight", "trunk.layers.2.bias",
        "value.0.weight", "value.0.bias", "advantage.0.weight", "advantage.0.bias"]
    plain = build_model(cfg("network.dueling=false"), CARTPOLE)
    assert [k for k in plain.state_dict() if not k.startswith("trunk.")] == ["q.0.weight", "q.0.bias"]


def test_state_dict_holds_exactly_the_parameters():
    for spec, algo in ((CARTPOLE, "dqn"), (ATARI, "dqn"), (CHEETAH, "td3")):
        model = build_model(cfg(f"algo={algo}"), spec)
        assert list(model.state_dict()) == [n for n, _ in model.named_parameters()]


def test_same_seed_same_weights_and_names():
    def make():
        torch.manual_seed(3)
        return build_model(cfg(), CARTPOLE).state_dict()
    a, b = make(), make()
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_dueling_head_is_value_plus_centered_advantage():
    torch.manual_seed(0)
    model = build_model(cfg(), CARTPOLE)
    x = torch.randn(7, 4)
    h = model.trunk(x)
    v, a = model.value(h), model.advantage(h)
    q = model(x)
    torch.testing.assert_close(q, v + a - a.mean(1, keepdim=True))
    # the mean of Q over actions is V: the advantage stream carries no offset
    torch.testing.assert_close(q.mean(1, keepdim=True), v)


def test_nature_cnn_takes_uint8_stacks_and_scales_inside():
    torch.manual_seed(0)
    model = build_model(cfg(), ATARI)
    names = list(model.state_dict())
    assert names[:6] == ["trunk.convs.0.weight", "trunk.convs.0.bias", "trunk.convs.2.weight",
                         "trunk.convs.2.bias", "trunk.convs.4.weight", "trunk.convs.4.bias"]
    assert model.trunk.convs[0].weight.shape == (32, 4, 8, 8)
    assert model.trunk.out_features == 64 * 7 * 7
    assert model.value[0].weight.shape == (512, 3136) and model.advantage[2].weight.shape == (6, 512)
    frames = torch.randint(0, 256, (3, 4, 84, 84), dtype=torch.uint8)
    q_u8 = model(frames)
    assert q_u8.shape == (3, 6) and q_u8.dtype == torch.float32
    torch.testing.assert_close(q_u8, model(frames.float() / 255.0))


def test_nature_cnn_rejects_frames_too_small():
    with pytest.raises(ValueError, match="too small"):
        build_model(cfg(), EnvSpec((20, 20), np.dtype(np.uint8), 4, True, num_actions=2))


def test_td3_model_actor_within_bounds_and_twin_critics():
    torch.manual_seed(0)
    model = build_model(cfg("algo=td3"), PENDULUM)
    assert isinstance(model, TD3Model)
    names = list(model.state_dict())
    assert names == [f"{m}.net.{i}.{p}" for m in ("actor", "critic1", "critic2")
                     for i in (0, 2, 4) for p in ("weight", "bias")]
    assert model.actor.net[0].weight.shape == (256, 3)   # td3.hidden_sizes default 256x256
    assert model.critic1.net[0].weight.shape == (256, 4)
    obs = torch.randn(64, 3) * 100  # saturate the tanh
    a = model(obs)
    assert a.shape == (64, 1) and a.abs().max() <= 2.0 + 1e-6 and a.abs().max() > 1.9
    q1, q2 = model.q(obs, a)
    assert q1.shape == q2.shape == (64,)
    assert not torch.equal(q1, q2)  # independently initialised


def test_td3_hidden_sizes_follow_config():
    model = build_model(cfg("algo=td3", "td3.hidden_sizes=[64]"), CHEETAH)
    assert model.actor.net[0].weight.shape == (64, 17)
    assert model.critic2.net[0].weight.shape == (64, 23)


def test_td3_asymmetric_bounds_map_tanh_range():
    spec = EnvSpec((2,), np.dtype(np.float32), 1, False, action_dim=2,
                   action_low=(0.0, -3.0), action_high=(1.0, 1.0))
    model = build_model(cfg("algo=td3"), spec)
    torch.testing.assert_close(model.action_scale, torch.tensor([0.5, 2.0]))
    a = model(torch.randn(256, 2) * 50)
    assert (a >= model.action_low - 1e-6).all() and (a <= model.action_high + 1e-6).all()


def test_wrong_algo_for_action_space_is_a_clear_error():
    with pytest.raises(ValueError, match="discrete"):
        build_model(cfg(), CHEETAH)
    with pytest.raises(ValueError, match="continuous"):
        build_model(cfg("algo=td3"), CARTPOLE)


def test_buffers_follow_the_module_but_stay_out_of_the_state_dict():
    model = build_model(cfg("algo=td3"), PENDULUM).to(torch.float64)
    assert "action_low" not in model.state_dict()
    assert model.action_low.dtype == torch.float64


def test_narrow_layers_stay_fp32_under_cpu_autocast_and_wide_ones_do_not():
    torch.manual_seed(0)
    model = build_model(cfg("network.hidden_sizes=[256, 256]"), CARTPOLE)
    inp, mid = model.trunk.layers[0], model.trunk.layers[2]
    adv = model.advantage[0]
    assert inp.narrow and adv.narrow and not mid.narrow  # 4->256, 256->2; 256->256
    obs = torch.randn(32, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h_in = inp(obs)
        h_mid = mid(h_in.relu())
        q = model(obs)
    assert h_in.dtype == torch.float32 and q.dtype == torch.float32
    assert h_mid.dtype == torch.bfloat16
    # the narrow layer computes exactly what it computes without autocast
    torch.testing.assert_close(h_in, inp(obs), rtol=0, atol=0)
    # gradients reach every parameter in fp32
    loss = q.sum()
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
