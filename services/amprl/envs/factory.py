"""One factory for the environment suites a config may name.

Classic control comes from gymnasium itself; Atari (ale-py) and MuJoCo suites are added by
their own modules. ``check_env_id`` fails with a clear message before any process starts.
"""

from __future__ import annotations

import gymnasium as gym

from amprl.config import EnvConfig
from amprl.envs.spec import EnvSpec, spec_from_env
from amprl.errors import ConfigError


def check_env_id(cfg: EnvConfig) -> None:
    """Raises ConfigError if ``cfg.id`` is unknown or its suite's package is missing."""
    try:
        gym.spec(cfg.id)
    except Exception as exc:  # gymnasium raises several NameNotFound/VersionNotFound types
        raise ConfigError(f"env.id: unknown environment {cfg.id!r} ({exc})") from None


def make_env(cfg: EnvConfig, seed: int | None = None, *, training: bool = True) -> gym.Env:
    """Builds one (unstacked) environment; ``training`` toggles training-only wrappers."""
    check_env_id(cfg)
    kwargs = {}
    if cfg.max_episode_steps:
        kwargs["max_episode_steps"] = cfg.max_episode_steps
    env = gym.make(cfg.id, **kwargs)
    if seed is not None:
        env.reset(seed=seed)
        env.action_space.seed(seed)
    return env


def env_spec(cfg: EnvConfig) -> EnvSpec:
    """The EnvSpec of the configured environment (builds one env and closes it)."""
    env = make_env(cfg)
    try:
        return spec_from_env(env, cfg.frame_stack)
    finally:
        env.close()
