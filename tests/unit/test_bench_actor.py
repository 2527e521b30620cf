"""bench/actor.py's ActionLog: replaying what one of the actor's envs received, from its
seed, retraces the env's trajectory (so the replay's cost is the simulator's in those states)."""

import importlib.util
import time
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
    cursor, steps = 0, 0
    while (cursor := bench_actor.replay_step(fresh, log.events, cursor)) >= 0:
        steps += 1
    assert steps == 300
    np.testing.assert_array_equal(np.array(fresh.seen), np.array(log.env.seen))

    # a new seeded reset starts a new log
    log.reset(seed=7)
    assert log.seed == 7 and log.events == []


def test_replayed_rate_steps_every_log_in_lockstep_until_the_shortest_ends():
    cfg = EnvConfig(id="CartPole-v1")
    logs = []
    for seed, n in ((1, 50), (2, 80)):
        log = bench_actor.ActionLog(make_env(cfg))
        log.reset(seed=seed)
        for _ in range(n):
            _, _, terminated, truncated, _ = log.step(0)
            if terminated or truncated:
                log.reset()
        logs.append(log)
    envs = [make_env(cfg) for _ in logs]
    for env, log in zip(envs, logs):
        env.reset(seed=log.seed)
    deadline = time.perf_counter() + 60.0
    assert bench_actor.replay_lockstep(envs, logs, deadline) == 2 * 50  # 50 rounds, then log 0 ends
    assert time.perf_counter() < deadline
