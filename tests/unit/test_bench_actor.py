"""bench/actor.py's ActionLog: replaying what one of the actor's envs received, from its
seed, retraces the env's trajectory (so the replay's cost is the simulator's in those states)."""

import importlib.util
from pathlib import Path

import gymnasium as gym
import numpy as np

from amprl.config import EnvConfig
from amprl.envs.factory import make_env

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_actor", ROOT / "bench" / "actor.py")
bench_actor = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_actor)


class Observations(gym.Wrapper):
    def __init__(self, env):
        super().__init__(env)
        self.seen = []

    def step(self, action):
        out = self.env.step(action)
        self.seen.append(out[0].copy())
        return out


def test_replaying_an_action_log_retraces_the_trajectory_resets_included():
    cfg = EnvConfig(id="CartPole-v1")
    log = bench_actor.ActionLog(Observations(make_env(cfg)))
    log.reset(seed=123)
    rng = np.random.default_rng(0)
    episodes = 0
    for _ in range(300):  # random CartPole episodes end after ~20 steps: several resets
        _, _, terminated, truncated, _ = log.step(int(rng.integers(2)))
        if terminated or truncated:
            log.reset()
            episodes += 1
    assert episodes >= 3 and log.seed == 123
    assert sum(e is None for e in log.events) == episodes

    fresh = Observations(make_env(cfg))
    fresh.reset(seed=log.seed)
    assert bench_actor.replay_actions(fresh, log.events) == 300
    np.testing.assert_array_equal(np.array(fresh.seen), np.array(log.env.seen))

    # a new seeded reset starts a new log
    log.reset(seed=7)
    assert log.seed == 7 and log.events == []
