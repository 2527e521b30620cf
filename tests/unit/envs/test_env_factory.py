"""The env factory: suites, specs, and clear errors before any process starts."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from amprl.config import EnvConfig, load_config
from amprl.envs.factory import check_env_id, env_spec, make_env, suite
from amprl.errors import ConfigError
from amprl.algos import build_model
from amprl.algos.td3.networks import TD3Model


def test_unknown_ids_are_config_errors_naming_the_id():
    for env_id in ["NoSuchEnv-v9", "ALE/NoSuchGame-v5"]:
        with pytest.raises(ConfigError, match=env_id.replace("/", ".")):
            check_env_id(EnvConfig(id=env_id))


def test_suites_are_told_apart():
    assert suite("ALE/Pong-v5") == "atari"
    assert suite("HalfCheetah-v5") == "mujoco"
    assert suite("Pendulum-v1") == "gymnasium"


def test_a_missing_atari_package_is_a_config_error_with_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "ale_py", None)  # import ale_py -> ImportError
    with pytest.raises(ConfigError, match="ale-py"):
        check_env_id(EnvConfig(id="ALE/Pong-v5"))


def test_a_missing_mujoco_package_is_a_config_error_with_the_install_hint(monkeypatch):
    for name in [m for m in sys.modules if m.startswith("gymnasium.envs.mujoco")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "mujoco", None)
    with pytest.raises(ConfigError, match="mujoco"):
        check_env_id(EnvConfig(id="HalfCheetah-v5"))


def test_pendulum_spec_is_a_continuous_vector_env():
    spec = env_spec(EnvConfig(id="Pendulum-v1"))
    assert spec.frame_shape == (3,) and spec.frame_dtype == np.float32 and spec.frame_stack == 1
    assert not spec.discrete and spec.action_dim == 1
    assert spec.action_low == (-2.0,) and spec.action_high == (2.0,)


@pytest.mark.parametrize("env_id, obs_dim, action_dim", [("HalfCheetah-v5", 17, 6), ("Ant-v5", 105, 8)])
def test_mujoco_v5_tasks_build_with_their_td3_model(env_id, obs_dim, action_dim, tmp_path, monkeypatch):
    pytest.importorskip("mujoco")
    monkeypatch.chdir(tmp_path)  # MuJoCo writes MUJOCO_LOG.TXT into the working directory
    cfg = EnvConfig(id=env_id)
    spec = env_spec(cfg)
    assert spec.frame_shape == (obs_dim,) and spec.frame_dtype == np.float32
    assert not spec.discrete and spec.action_dim == action_dim
    assert spec.action_low == (-1.0,) * action_dim and spec.action_high == (1.0,) * action_dim
    env = make_env(cfg, seed=0)
    obs, _ = env.reset(seed=0)
    obs2, reward, terminated, truncated, _ = env.step(np.zeros(action_dim, dtype=np.float32))
    assert obs2.shape == (obs_dim,) and np.isfinite(reward)
    assert obs.dtype == obs2.dtype == np.float32  # MuJoCo's float64, cast as the spec says
    env.close()
    model = build_model(load_config(None, ["algo=td3", f"env.id={env_id}"]), spec)
    assert isinstance(model, TD3Model)


@pytest.mark.parametrize("path", ["configs/pendulum-td3.yaml", "configs/halfcheetah-td3.yaml",
                                  "configs/ant-td3.yaml", "configs/pong-apex.yaml",
                                  "configs/breakout-apex.yaml"])
def test_shipped_configs_load_and_name_a_buildable_env(path):
    from pathlib import Path
    root = Path(__file__).resolve().parents[3]
    cfg = load_config(root / path)
    if "mujoco" == suite(cfg.env.id):
        pytest.importorskip("mujoco")
    check_env_id(cfg.env)
    spec = env_spec(cfg.env)
    build_model(cfg, spec)
    assert spec.discrete == (cfg.algo == "dqn")


CORRIDOR = '''
import gymnasium as gym
import numpy as np


class Corridor(gym.Env):
    """Walk right (action 1) ten times; reward 1 per step."""
    observation_space = gym.spaces.Box(0.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.pos = 0
        return np.array([0.0, 1.0], np.float32), {}

    def step(self, action):
        self.pos += int(action)
        return np.array([self.pos / 10, 1.0], np.float32), 1.0, self.pos >= 10, False, {}


gym.register("Corridor-v0", entry_point=Corridor, max_episode_steps=40)
'''


def test_your_own_environment_is_module_colon_id(tmp_path, monkeypatch):
    """``env.id: module:EnvId`` imports the module, which registers the env; the spec and
    the env come out as for a built-in one."""
    (tmp_path / "amprl_corridor_env.py").write_text(CORRIDOR)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(None, ["env.id=amprl_corridor_env:Corridor-v0"]).env
    spec = env_spec(cfg)
    assert spec.discrete and spec.num_actions == 2 and spec.frame_shape == (2,)
    env = make_env(cfg, seed=0)
    try:
        obs, _ = env.reset(seed=0)
        assert obs.dtype == np.float32 and env.spec.max_episode_steps == 40
    finally:
        env.close()


def test_an_own_environment_whose_module_is_missing_is_a_clear_error():
    cfg = load_config(None, ["env.id=no_such_amprl_module:Thing-v0"]).env
    with pytest.raises(ConfigError, match="cannot import 'no_such_amprl_module'.*PYTHONPATH"):
        check_env_id(cfg)


ENV_MODULE = '''
import gymnasium as gym
import numpy as np

class Countdown(gym.Env):
    """Ends after ``length`` steps; observes the steps left."""
    def __init__(self, length=100):
        self.length = length
        self.observation_space = gym.spaces.Box(0, 1e6, (1,), np.float32)
        self.action_space = gym.spaces.Discrete(2)
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.left = self.length
        return np.array([self.left], np.float32), {}
    def step(self, action):
        self.left -= 1
        return np.array([self.left], np.float32), 1.0, False, self.left <= 0, {}

gym.register("{env_id}", entry_point=Countdown)
'''


def write_env_module(tmp_path, monkeypatch, module: str, env_id: str) -> None:
    """A module of the user's own on sys.path that registers ``env_id`` when imported."""
    (tmp_path / f"{module}.py").write_text(ENV_MODULE.replace("{env_id}", env_id))
    monkeypatch.syspath_prepend(str(tmp_path))


def episode_length(env) -> int:
    env.reset(seed=0)
    steps, done = 0, False
    while not done:
        _, _, terminated, truncated, _ = env.step(0)
        steps, done = steps + 1, terminated or truncated
    return steps


def test_env_import_registers_the_id_and_env_kwargs_reach_the_env(tmp_path, monkeypatch):
    write_env_module(tmp_path, monkeypatch, "user_envs_a", "CountdownA-v0")
    cfg = EnvConfig(id="CountdownA-v0", import_=["user_envs_a"], kwargs={"length": 3})
    check_env_id(cfg)
    assert env_spec(cfg).num_actions == 2
    assert episode_length(make_env(cfg)) == 3
    assert episode_length(make_env(EnvConfig(id="CountdownA-v0", import_=["user_envs_a"]))) == 100


def test_a_module_colon_id_imports_its_module(tmp_path, monkeypatch):
    write_env_module(tmp_path, monkeypatch, "user_envs_b", "CountdownB-v0")
    cfg = EnvConfig(id="user_envs_b:CountdownB-v0", kwargs={"length": 5})
    assert episode_length(make_env(cfg)) == 5


def test_env_import_and_kwargs_mistakes_are_config_errors_naming_them(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="env.import: cannot import 'no_such_module_xyz'"):
        check_env_id(EnvConfig(id="CartPole-v1", import_=["no_such_module_xyz"]))
    (tmp_path / "broken_envs.py").write_text("raise RuntimeError('no licence for the simulator')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="importing 'broken_envs' failed: RuntimeError: no licence"):
        check_env_id(EnvConfig(id="CartPole-v1", import_=["broken_envs"]))
    with pytest.raises(ConfigError, match=r"env.kwargs: 'CartPole-v1' refused \{'colour': 'red'\}"):
        make_env(EnvConfig(id="CartPole-v1", kwargs={"colour": "red"}))
