"""Greedy episodes played side by side: what the evaluator measures and ``amprl enjoy``
shows, one batched forward pass per step over every env still running."""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import numpy as np

from amprl.config import EnvConfig
from amprl.envs.factory import make_env
from amprl.envs.spec import EnvSpec
from amprl.envs.stacking import FrameStacks
from amprl.envs.video import RecordMp4


def run_episodes(policy, spec: EnvSpec, envs: list, seeds: list[int], epsilon: float,
                 rng: np.random.Generator) -> list[float]:
    """Plays one episode in each env (batched inference: ``policy`` maps observations
    [B, *obs_shape] to actions, an ``amprl.core.Policy``) and returns the undiscounted returns."""
    n = len(envs)
    stacks = FrameStacks(n, spec)
    for k, env in enumerate(envs):
        frame, _ = env.reset(seed=seeds[k])
        stacks.reset(k, frame)
    returns = np.zeros(n)
    live = np.ones(n, dtype=bool)
    while live.any():
        idx = np.flatnonzero(live)
        actions = policy(stacks.observations(idx))
        if epsilon > 0 and spec.discrete:
            explore = rng.random(len(idx)) < epsilon
            actions = np.where(explore, rng.integers(spec.num_actions, size=len(idx)), actions)
        for j, i in enumerate(idx.tolist()):
            frame, reward, terminated, truncated, _ = envs[i].step(actions[j])
            returns[i] += float(reward)
            if terminated or truncated:
                live[i] = False
            else:
                stacks.push(i, frame)
    return returns.tolist()


def play(policy, spec: EnvSpec, env_cfg: EnvConfig, episodes: int, seed: int, *,
         human: bool = False, video: str | Path | None = None) -> list[float]:
    """``episodes`` greedy episodes in fresh evaluation envs (seeds ``seed``, ``seed + 1``,
    ...), closed afterwards; their returns.

    ``human``: each episode in a window, one after another (gymnasium's "human" render mode,
    paced at the env's frame rate). ``video``: the first episode is also written there as an
    MP4 (``amprl.envs.video``); the others play beside it unrendered.
    """
    rng = np.random.default_rng(seed)
    if human:
        returns: list[float] = []
        for i in range(episodes):
            env = make_env(env_cfg, training=False, render_mode="human")
            try:
                returns += run_episodes(policy, spec, [env], [seed + i], 0.0, rng)
            finally:
                env.close()
        return returns
    envs: list[gym.Env] = []
    try:
        for i in range(episodes):
            if i == 0 and video is not None:
                envs.append(RecordMp4(make_env(env_cfg, training=False, render_mode="rgb_array"), video))
            else:
                envs.append(make_env(env_cfg, training=False))
        return run_episodes(policy, spec, envs, [seed + i for i in range(episodes)], 0.0, rng)
    finally:
        for env in envs:
            env.close()
