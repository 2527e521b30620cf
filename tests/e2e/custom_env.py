"""A tiny environment of the tests' own, registered when imported (``env.import``).

``Signal-v0``: each step shows a sign s in {-1, +1} (the observation [s, 1]) and pays 1 for
the action that matches it (1 for +1, 0 for -1); an episode is ``length`` steps, so a
greedy policy that has learned scores ``length`` and a random one about half of it.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np


class Signal(gym.Env):
    def __init__(self, length: int = 100):
        self.length = length
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self._t = 0
        self._sign = 1.0

    def _obs(self) -> np.ndarray:
        self._sign = float(self.np_random.choice([-1.0, 1.0]))
        return np.array([self._sign, 1.0], np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._t = 0
        return self._obs(), {}

    def step(self, action):
        reward = float(int(action) == (self._sign > 0))
        self._t += 1
        return self._obs(), reward, False, self._t >= self.length, {}


gym.register("Signal-v0", entry_point=Signal)
