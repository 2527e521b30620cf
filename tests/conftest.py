"""Shared by every test: the test-support package (``testing/amprl_testing``, on pytest's
path through ``pythonpath`` in pyproject.toml) reaches the processes the tests start too,
and its network-namespace fixtures are loaded."""

import os
from pathlib import Path

TESTING = str(Path(__file__).resolve().parent.parent / "testing")
os.environ["PYTHONPATH"] = os.pathsep.join(
    [TESTING] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != TESTING])

pytest_plugins = ["amprl_testing.netsim.pytest_plugin"]
