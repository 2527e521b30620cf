"""The evaluator's greedy policy: the actors' fast paths give the replica's own greedy actions."""

import numpy as np
import pytest
import torch

from amprl.algos import build_model, builder
from amprl.config import load_config
from amprl.envs.factory import env_spec


@pytest.mark.parametrize("overrides", [
    ["algo=dqn", "env.id=CartPole-v1"],
    ["algo=dqn", "env.id=CartPole-v1", "network.dueling=false"],
    ["algo=td3", "env.id=Pendulum-v1"],
])
def test_greedy_actions_equal_the_models_after_weight_changes(overrides):
    cfg = load_config(overrides=overrides)
    spec = env_spec(cfg.env)
    model = build_model(cfg, spec).eval()
    policy = builder(cfg.algo).make_greedy_policy(model)
    obs = np.random.default_rng(0).standard_normal((64, *spec.obs_shape)).astype(np.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    policy.sync()
    with torch.no_grad():
        x = torch.from_numpy(obs)
        if spec.discrete:
            q = model(x).numpy()
            want = q.argmax(axis=1)
            got = policy(obs)
            # ties within float rounding aside, the same action
            top2 = np.sort(q, axis=1)[:, -2:]
            clear = top2[:, 1] - top2[:, 0] > 1e-4
            assert clear.sum() > 50
            np.testing.assert_array_equal(got[clear], want[clear])
            assert got.dtype == np.int64 and got.shape == (64,)
        else:
            want = model.actor(x).numpy()
            got = policy(obs)
            assert got.shape == (64, spec.action_dim)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
