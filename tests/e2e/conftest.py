"""The end-to-end tests run ``amprl run`` itself as a child process, under the supervisor
``amprl run`` uses for its own services (``amprl.launch.procs``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from amprl.launch.procs import Service, spawn

ROOT = Path(__file__).resolve().parents[2]


class AmprlRun:
    """Starts ``amprl run ARGS`` from the repository root (its output, stdout and stderr
    together, in a log file) and stops what is still running when the test ends."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.started: list[Service] = []

    def start(self, args: list[str]) -> Service:
        name = f"amprl-run-{len(self.started)}"
        run = spawn(name, [sys.executable, "-m", "amprl.cli", "run", *args],
                    self.log_dir / f"{name}.log", cwd=ROOT)
        self.started.append(run)
        return run

    def finish(self, run: Service, timeout_s: float) -> tuple[int, str]:
        """Waits for the run to end: its exit status and output. A run still going after
        ``timeout_s`` is stopped as Ctrl-C would (it stops its services) and fails the test."""
        try:
            code = run.wait(timeout_s)
        except subprocess.TimeoutExpired:
            run.stop(timeout_s=60)
            pytest.fail(f"amprl run did not finish in {timeout_s}s:\n{run.log()[-4000:]}")
        return code, run.log()

    def __call__(self, args: list[str], timeout_s: float) -> tuple[int, str]:
        """``start`` then ``finish``."""
        return self.finish(self.start(args), timeout_s)


@pytest.fixture
def amprl_run(tmp_path):
    runs = AmprlRun(tmp_path)
    yield runs
    for run in runs.started:
        run.stop(timeout_s=60)


@pytest.fixture(scope="module")
def amprl_run_module(tmp_path_factory):
    """``amprl_run`` shared by a module's tests: one run folder that several tests read."""
    runs = AmprlRun(tmp_path_factory.mktemp("amprl-run"))
    yield runs
    for run in runs.started:
        run.stop(timeout_s=60)
