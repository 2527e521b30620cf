"""What the package carries for a user outside this repository: the experiment files by
name, the licence, its version."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from amprl import errors
from amprl.config import load_config, packaged_configs, resolve_config

ROOT = Path(__file__).resolve().parents[2]


def test_a_packaged_experiment_is_found_by_name_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert {"cartpole-dqn", "pong-apex", "halfcheetah-td3"} <= set(packaged_configs())
    for name in ("pong-apex", "pong-apex.yaml"):
        assert load_config(resolve_config(name)).env.id.startswith("ALE/Pong")
    own = tmp_path / "pong-apex.yaml"  # a file of the user's wins over the packaged one
    own.write_text("name: mine\n")
    assert resolve_config("pong-apex.yaml").resolve() == own
    with pytest.raises(errors.ConfigError, match="packaged: .*cartpole-dqn"):
        resolve_config("no-such-experiment")


def test_amprl_version_is_the_package_version():
    out = subprocess.run([sys.executable, "-m", "amprl.cli", "--version"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert out.strip() == f"amprl {version}"


@pytest.mark.slow
def test_the_wheel_carries_the_experiments_and_the_licence(tmp_path):
    # built from a copy of what the package is made of, so no build/ lands in the checkout
    source = tmp_path / "source"
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path), str(source)], check=True, timeout=300, capture_output=True)
    wheel = next(tmp_path.glob("amprl-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert {f"amprl/configs/{n}.yaml" for n in packaged_configs()} <= set(names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata
