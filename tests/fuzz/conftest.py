"""The outcomes the fuzz tests saw, per RPC and strategy, at the end of the run."""

from __future__ import annotations

from .harness import TALLY


def pytest_terminal_summary(terminalreporter):
    if not TALLY:
        return
    terminalreporter.section("fuzz outcomes (RPC, strategy: examples by status)")
    for key in sorted(TALLY):
        counts = ", ".join(f"{code} {n}" for code, n in TALLY[key].most_common())
        terminalreporter.write_line(f"{key}: {sum(TALLY[key].values())} ({counts})")
