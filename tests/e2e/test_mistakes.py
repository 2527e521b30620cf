"""A person's mistakes through the real entry point: one line on stderr naming the
problem, exit status 2, no traceback (``amprl.cli``); ``--debug`` shows the traceback.

Each case fails before any service starts; a service that fails at start is in
test_your_own_run.py (``--init-from`` a run of another network).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from amprl.config import dump_config, load_config

ROOT = Path(__file__).resolve().parents[2]


def amprl(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "amprl.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def one_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.fixture
def files(tmp_path) -> Path:
    (tmp_path / "broken.yaml").write_text("run:\n  total_env_steps: [1000\n")
    (tmp_path / "r").mkdir()  # a stopped run's folder
    dump_config(load_config(None, []), tmp_path / "r" / "config.yaml")
    return tmp_path


@pytest.mark.parametrize("args, names", [
    (["run", "{tmp}/missing.yaml"], ["missing.yaml: no such file"]),
    (["run", "{tmp}/broken.yaml"], ["broken.yaml: YAML syntax error at line 3, column 1"]),
    (["run", "--set", "env.id=Pendulum-v1"], ["algo: dqn needs a discrete action space",
                                               "'Pendulum-v1' has continuous actions", "use algo: td3"]),
    (["run", "--set", "env.id=NoSuchEnv-v9"], ["env.id: unknown environment 'NoSuchEnv-v9'"]),
    (["run", "--set", "env.import=[no_such_module]"], ["env.import: cannot import 'no_such_module'"]),
    (["run", "--set", "env.kwargs.colour=blue"], ["env.kwargs: 'CartPole-v1' refused {'colour': 'blue'}",
                                                   "unexpected keyword argument 'colour'"]),
    (["run", "--resume", "{tmp}/r", "--set", "learner.batch_size=64"],
     ["--set learner.batch_size: a resumed run keeps its config", "run.total_env_steps"]),
    (["run", "--resume", "{tmp}/nothing"], ["--resume", "not a run folder"]),
    (["learner", "--config", "{tmp}/missing.yaml"], ["config file", "missing.yaml: No such file"]),
], ids=["missing-file", "yaml-syntax", "dqn-continuous", "unknown-env", "env-import", "env-kwargs",
        "resume-set", "resume-not-a-run", "service-missing-file"])
def test_a_mistake_is_one_line_naming_it_and_exit_status_2(files, args, names):
    line = one_line(amprl(*[a.format(tmp=files) for a in args]))
    for name in names:
        assert name in line, line


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback(files, where):
    args = ["run", str(files / "missing.yaml")]
    proc = amprl(*(["--debug", *args] if where == "before" else [*args, "--debug"]))
    assert proc.returncode == 1 and "Traceback" in proc.stderr
    assert "ConfigError" in proc.stderr.splitlines()[-1]
