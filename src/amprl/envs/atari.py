"""Atari through ale-py with the standard DQN preprocessing (Mnih et al. 2015; Machado et
al. 2018 for sticky actions), producing single 84x84 uint8 frames.

Per agent step: the action is repeated ``frame_skip`` (4) emulator frames and the
observation is the pixel-wise max of the last two grayscale screens (Atari sprites
flicker), resized to ``screen_size`` squared by area averaging. At reset, a random number
of no-ops in [1, noop_max] (30) starts the game in a varied state. Sticky actions
(probability 0.25, the v5 default) are the emulator's own ``repeat_action_probability``.

Training only (``training=True``): a lost life ends the episode (the game itself goes on:
the next ``reset`` continues from there with one no-op step; Mnih et al. 2015), and rewards
are clipped to their sign. Evaluation reports the real game score: full games, raw rewards.

Frame stacking is not done here: the actor's n-step chunker, the replay and the evaluator
stack frames themselves, so replay stores each frame once.

The resize averages pixel areas with precomputed weights (what OpenCV's INTER_AREA
computes for a downscale), so preprocessing needs NumPy only, not opencv.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import gymnasium as gym
import numpy as np

if TYPE_CHECKING:
    from ale_py.env import AtariEnv

NTSC_HZ = 60
"""Frames per second of the Atari 2600 (NTSC), which the emulator steps one at a time."""


def area_weights(src: int, dst: int) -> np.ndarray:
    """[dst, src] float32: row i averages the source pixels covered by output pixel i,
    each weighted by the fraction of it inside [i * src/dst, (i + 1) * src/dst)."""
    scale = src / dst
    w = np.zeros((dst, src), dtype=np.float64)
    for i in range(dst):
        lo, hi = i * scale, (i + 1) * scale
        for j in range(int(np.floor(lo)), min(int(np.ceil(hi)), src)):
            w[i, j] = min(hi, j + 1) - max(lo, j)
    w /= w.sum(axis=1, keepdims=True)
    return w.astype(np.float32)


def sparse_weights(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The non-zero entries of [dst, src] weights as ([dst, k] indices, [dst, k] weights),
    k = the most source pixels any output pixel covers (3 for 210 -> 84 and 160 -> 84)."""
    k = int((weights > 0).sum(axis=1).max())
    idx = np.zeros((weights.shape[0], k), dtype=np.intp)
    w = np.zeros((weights.shape[0], k), dtype=np.float32)
    for i, row in enumerate(weights):
        nz = np.flatnonzero(row)
        idx[i, :len(nz)] = nz
        w[i, :len(nz)] = row[nz]
    return idx, w


class AreaResize:
    """uint8 [H, W] -> uint8 [h, w] by area averaging (OpenCV's INTER_AREA for a downscale).

    Gathers the few source rows/columns of each output pixel instead of a dense matrix
    product: no BLAS call, whose thread pool spins badly on a busy machine.
    """

    def __init__(self, src_hw: tuple[int, int], dst_hw: tuple[int, int]):
        self.row_idx, self.row_w = sparse_weights(area_weights(src_hw[0], dst_hw[0]))
        self.col_idx, self.col_w = sparse_weights(area_weights(src_hw[1], dst_hw[1]))
        self._row_w = self.row_w[:, :, None]
        self._col_w = self.col_w[None]

    def __call__(self, frame: np.ndarray) -> np.ndarray:
        rows = np.einsum("hkw,hk->hw", frame[self.row_idx].astype(np.float32), self.row_w)
        out = np.einsum("hwk,wk->hw", rows[:, self.col_idx], self.col_w)
        out += 0.5
        return out.astype(np.uint8)


class AtariPreprocessing(gym.Wrapper):
    """The DQN preprocessing over an ale-py ``AtariEnv`` created with ``frameskip=1``.

    Drives the emulator (``ale``) directly for the skipped frames: the per-frame Python
    cost of ``env.step`` would be a large part of the agent step otherwise.
    """

    def __init__(self, env: gym.Env, *, noop_max: int = 30, frame_skip: int = 4,
                 screen_size: int = 84, terminal_on_life_loss: bool = False,
                 clip_rewards: bool = False):
        super().__init__(env)
        if frame_skip < 1:
            raise ValueError(f"frame_skip ({frame_skip}) must be >= 1")
        if noop_max < 0:
            raise ValueError(f"noop_max ({noop_max}) must be >= 0")
        base = cast("AtariEnv", env.unwrapped)
        if getattr(base, "_frameskip", 1) != 1:
            raise ValueError("AtariPreprocessing needs the ALE env created with frameskip=1")
        self.ale = base.ale
        self._action_set = list(base._action_set)
        self.noop_max = noop_max
        self.frame_skip = frame_skip
        self.screen_size = screen_size
        self.terminal_on_life_loss = terminal_on_life_loss
        self.clip_rewards = clip_rewards
        h, w = self.ale.getScreenDims()
        self._screens = np.zeros((2, h, w), dtype=np.uint8)
        self._resize = AreaResize((h, w), (screen_size, screen_size))
        self.observation_space = gym.spaces.Box(0, 255, (screen_size, screen_size), np.uint8)
        self._lives = 0
        self._game_over = True
        self._rng = np.random.default_rng()
        # one rendered frame per agent step: at the console's 60 Hz (NTSC; ale-py declares
        # 30) a video of them plays at the game's own speed
        self.metadata = {**env.metadata, "render_fps": NTSC_HZ / frame_skip}

    def _frame(self) -> np.ndarray:
        s = self._screens
        np.maximum(s[0], s[1], out=s[0])
        return self._resize(s[0])

    def _info(self) -> dict:
        return {"lives": self._lives, "game_over": self._game_over}

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        if self._game_over or not self.terminal_on_life_loss or seed is not None:
            self.env.reset(seed=seed, options=options)
            noops = int(self._rng.integers(1, self.noop_max + 1)) if self.noop_max > 0 else 0
            noop = self._action_set[0]
            for _ in range(noops):
                self.ale.act(noop)
                if self.ale.game_over():
                    self.env.reset()
            self.ale.getScreenGrayscale(self._screens[0])
            self._screens[1] = self._screens[0]
            self._game_over = False
            self._lives = self.ale.lives()
            return self._frame(), self._info()
        # after a life loss in training: the game goes on, with one no-op agent step
        frame, _, terminated, truncated, info = self.step(0)
        if self._game_over:  # the no-op step itself ended the game
            return self.reset()
        return frame, info

    def step(self, action):
        a = self._action_set[int(action)]
        ale = self.ale
        reward = 0.0
        last = self.frame_skip - 1
        screens = self._screens
        grabbed_first = False
        for t in range(self.frame_skip):
            reward += ale.act(a)
            done = ale.game_over()  # terminal or truncated (max frames per episode)
            if t == last or done:
                ale.getScreenGrayscale(screens[1])
                if not grabbed_first:
                    screens[0] = screens[1]
                break
            if t == last - 1:
                ale.getScreenGrayscale(screens[0])
                grabbed_first = True
        terminated = ale.game_over(with_truncation=False)
        truncated = ale.game_truncated() and not terminated
        self._game_over = terminated or truncated
        lives = ale.lives()
        if self.terminal_on_life_loss and 0 < lives < self._lives:
            terminated = True
        self._lives = lives
        if self.clip_rewards:
            reward = float(np.sign(reward))
        return self._frame(), float(reward), bool(terminated), bool(truncated), self._info()


def make_atari(env_id: str, *, noop_max: int = 30, frame_skip: int = 4, screen_size: int = 84,
               terminal_on_life_loss: bool = False, clip_rewards: bool = False,
               sticky_action_prob: float = 0.25, max_episode_steps: int = 0,
               render_mode: str | None = None, **kwargs: Any) -> gym.Env:
    """An ALE v5 game (``"ALE/Pong-v5"``) with the DQN preprocessing; see the module doc.
    ``kwargs`` go to ``gymnasium.make`` (``env.kwargs``: ``mode``, ``difficulty``, ...).

    ``max_episode_steps`` counts agent steps (0 = the v5 limit of 108,000 frames, 30 min).
    ``render_mode`` "rgb_array" renders the emulator's colour screen (210x160), not the
    84x84 grayscale observation; "human" shows it in a window.
    """
    import ale_py

    gym.register_envs(ale_py)
    max_frames = max_episode_steps * frame_skip if max_episode_steps else 108_000
    env = gym.make(env_id, frameskip=1, repeat_action_probability=sticky_action_prob,
                   obs_type="grayscale", full_action_space=False,
                   max_num_frames_per_episode=max_frames, disable_env_checker=True,
                   render_mode=render_mode, **kwargs)
    return AtariPreprocessing(env, noop_max=noop_max, frame_skip=frame_skip,
                              screen_size=screen_size,
                              terminal_on_life_loss=terminal_on_life_loss,
                              clip_rewards=clip_rewards)
