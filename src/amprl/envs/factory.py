"""One factory for the environment suites a config may name.

Classic control and MuJoCo come from gymnasium (MuJoCo needs the ``mujoco`` package),
Atari from ale-py (``ALE/<Game>-v5``, preprocessed by ``amprl.envs.atari``). Your own
environment is registered by a module of yours (``gymnasium.register``), which every
process that builds the env imports first: one named in ``env.import``, or the ``module`` of
``module:EnvId`` (gymnasium's own notation); it must be importable there (installed, or on
PYTHONPATH). ``env.kwargs`` go to ``gymnasium.make``. ``check_env_id`` fails with a clear
message before any process starts.
"""

from __future__ import annotations

import importlib
from typing import Any

import gymnasium as gym
import numpy as np

from amprl.config import EnvConfig
from amprl.envs.spec import EnvSpec, spec_from_env
from amprl.errors import ConfigError

_INSTALL_HINT = {
    "atari": "pip install ale-py==0.12.1",
    "mujoco": "pip install mujoco==3.3.7 imageio==2.38.2",
}


def registered_id(env_id: str) -> str:
    """The id gymnasium registered: ``module:EnvId`` imports the module (which registers
    ``EnvId``) and gives ``EnvId``; any other id is itself."""
    if ":" not in env_id:
        return env_id
    module, name = env_id.split(":", 1)
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"env.id: {env_id!r}: cannot import {module!r} ({exc}); the module that "
                          f"registers {name!r} must be importable in every process (installed, "
                          f"or on PYTHONPATH)") from None
    return name


def import_env_modules(cfg: EnvConfig) -> None:
    """Imports the modules of ``env.import`` (each registers environments as it is
    imported); ConfigError naming the one that fails."""
    for module in cfg.import_:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"env.import: cannot import {module!r} ({exc}); it must be "
                              f"importable in every process (installed, or on PYTHONPATH)") from None
        except Exception as exc:  # noqa: BLE001 - the module's own error, named; --debug shows it
            raise ConfigError(f"env.import: importing {module!r} failed: "
                              f"{type(exc).__name__}: {exc}") from exc


def suite(env_id: str) -> str:
    """"atari" for ALE ids, "mujoco" for gymnasium's MuJoCo tasks, else "gymnasium"."""
    if env_id.startswith("ALE/"):
        return "atari"
    try:
        entry = gym.spec(registered_id(env_id)).entry_point
    except Exception:  # noqa: BLE001 - unknown ids are reported by check_env_id
        return "gymnasium"
    return "mujoco" if isinstance(entry, str) and ".mujoco" in entry else "gymnasium"


def check_env_id(cfg: EnvConfig) -> None:
    """Raises ConfigError if ``cfg.id`` is unknown or its suite's package is missing (after
    importing the modules of ``cfg.import_``)."""
    import_env_modules(cfg)
    kind = suite(cfg.id)
    if kind == "atari":
        try:
            import ale_py
        except ImportError:
            raise ConfigError(f"env.id: {cfg.id!r} is an Atari game and needs ale-py "
                              f"({_INSTALL_HINT['atari']})") from None
        gym.register_envs(ale_py)
    try:
        spec = gym.spec(registered_id(cfg.id))
    except ConfigError:
        raise
    except Exception as exc:  # gymnasium raises several NameNotFound/VersionNotFound types
        raise ConfigError(f"env.id: unknown environment {cfg.id!r} ({exc})") from None
    if isinstance(spec.entry_point, str):
        # importing the entry point imports the suite's package (mujoco, ...)
        try:
            gym.envs.registration.load_env_creator(spec.entry_point)
        except (ImportError, gym.error.DependencyNotInstalled) as exc:
            hint = _INSTALL_HINT.get(kind, "install the package it names")
            raise ConfigError(f"env.id: {cfg.id!r} needs a package that is not installed "
                              f"({exc}; {hint})") from None


def make_env(cfg: EnvConfig, seed: int | None = None, *, training: bool = True,
             render_mode: str | None = None) -> gym.Env:
    """Builds one (unstacked) environment; ``training`` toggles training-only wrappers
    (Atari: life-loss terminals and reward clipping, per ``cfg.atari_*``). ``render_mode`` is
    gymnasium's: None (the services), "rgb_array" (``env.render()`` returns the raw frame,
    whatever the preprocessing feeds the network) or "human" (a window)."""
    check_env_id(cfg)
    if suite(cfg.id) == "atari":
        from amprl.envs.atari import make_atari
        env = make_atari(cfg.id, noop_max=cfg.atari_noop_max, frame_skip=cfg.atari_frame_skip,
                         screen_size=cfg.atari_screen_size,
                         terminal_on_life_loss=training and cfg.atari_terminal_on_life_loss,
                         clip_rewards=training and cfg.atari_clip_rewards,
                         sticky_action_prob=cfg.atari_sticky_action_prob,
                         max_episode_steps=cfg.max_episode_steps, render_mode=render_mode,
                         **cfg.kwargs)
    else:
        kwargs: dict[str, Any] = dict(cfg.kwargs)
        if render_mode is not None:  # only then: an env of your own may not take the argument
            kwargs["render_mode"] = render_mode
        if cfg.max_episode_steps:
            kwargs["max_episode_steps"] = cfg.max_episode_steps
        try:
            env = gym.make(registered_id(cfg.id), **kwargs)
        except TypeError as exc:  # an argument the environment does not take
            if not cfg.kwargs:
                raise
            # gymnasium appends the id and the kwargs, which the message names already
            problem = str(exc).split(" was raised from the environment creator")[0]
            raise ConfigError(f"env.kwargs: {cfg.id!r} refused {cfg.kwargs}: {problem}") from exc
        space = env.observation_space
        if isinstance(space, gym.spaces.Box) and space.dtype == np.float64:
            # MuJoCo observes float64; every service agrees on float32 frames (EnvSpec)
            env = gym.wrappers.DtypeObservation(env, np.float32)
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
