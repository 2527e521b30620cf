"""The run's verdict: whether it goes on, and why it ended, as the evaluator decides it.

The evaluator judges the stop rule (``amprl.common.runend.stop_reason``) with the fleet's
env steps (replay's Info), its evaluations and the run's wall time, and keeps the result
here. The phase only moves forward:

    RUNNING   --a stop condition is met-->  STOPPING  --final evaluation, summary-->  FINISHED

In STOPPING, actors and learners (which poll GetRunState) stop and idle, and the evaluator
evaluates the weights once they have settled (``Evaluator.finish``). With a run folder the
verdict is kept in ``RUN/end.json`` (written atomically at each change) and the summary in
``RUN/summary.json``; on a cluster the folder is the evaluator's volume, so a restarted
evaluator answers with the same verdict from its first call on, and a restarted worker,
which asks before it starts working, idles at once.

A verdict is kept for the run section it was judged under: after a change of that section
(a ``helm upgrade`` that raises ``run.total_env_steps``, ``amprl run --resume`` with a new
budget) the recorded verdict is dropped and the rule judges again, so a finished run can
be given more to do.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from amprl.common import runend
from amprl.config import RunConfig
from amprl.v1 import telemetry_pb2

log = logging.getLogger(__name__)

class Verdict:
    """The run's state (a RunState message) and its record in ``run_dir`` (module
    docstring); thread-safe."""

    def __init__(self, run: RunConfig, run_dir: str | Path = ""):
        self.run = run
        self.path = Path(run_dir) / "end.json" if run_dir else None
        self.summary_path = Path(run_dir) / "summary.json" if run_dir else None
        self._lock = threading.Lock()
        self._state = telemetry_pb2.RunState(phase=runend.RUNNING)
        self._decided_at = 0.0  # time.monotonic() of the decision
        self.summary: dict[str, Any] | None = None
        self._load()

    def _load(self) -> None:
        if self.path is None:
            return
        try:
            record = json.loads(self.path.read_text())
            state = telemetry_pb2.RunState(
                phase=telemetry_pb2.RunPhase.Value(record["phase"]),
                stop_reason=telemetry_pb2.StopReason.Value(record["stop_reason"]),
                env_steps=int(record["env_steps"]), wall_seconds=float(record["wall_seconds"]),
                ended_unix_time=float(record["ended_unix_time"]))
            rule = record["rule"]
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("%s is unreadable (%s): judging the run again", self.path, exc)
            return
        if rule != runend.rule_of(self.run):
            log.info("the run section changed since the run ended (%s, now %s): it goes on",
                     rule, runend.rule_of(self.run))
            return
        self._state = state
        self._decided_at = time.monotonic()
        if state.phase == runend.FINISHED and self.summary_path is not None:
            try:
                self.summary = json.loads(self.summary_path.read_text())
            except (OSError, ValueError):
                self.summary = None
        log.info("the run has ended (%s, %s): kept from %s", runend.REASONS.get(state.stop_reason, "?"),
                 runend.phase_name(state.phase), self.path)

    # -- reading ---------------------------------------------------------------------------

    def state(self) -> telemetry_pb2.RunState:
        """A copy of the current state."""
        with self._lock:
            out = telemetry_pb2.RunState()
            out.CopyFrom(self._state)
            return out

    @property
    def phase(self) -> int:
        with self._lock:
            return self._state.phase

    @property
    def reason(self) -> int:
        with self._lock:
            return self._state.stop_reason

    @property
    def seconds_since_decision(self) -> float:
        """Seconds since the stop condition was met (in this process's life)."""
        with self._lock:
            return time.monotonic() - self._decided_at

    def summary_json(self) -> str:
        with self._lock:
            return json.dumps(self.summary) if self.summary is not None else ""

    # -- changing --------------------------------------------------------------------------

    def judge(self, *, env_steps: int | None, returns: list[float], wall_seconds: float) -> bool:
        """Applies the rule while RUNNING (and records the figures); True when the run has
        just ended (the phase is now STOPPING)."""
        with self._lock:
            if self._state.phase != runend.RUNNING:
                return False
            if env_steps is not None:
                self._state.env_steps = env_steps
            self._state.wall_seconds = wall_seconds
            reason = runend.stop_reason(self.run, env_steps=env_steps, returns=returns,
                                        wall_seconds=wall_seconds)
            if reason == telemetry_pb2.STOP_REASON_UNSPECIFIED:
                return False
            self._state.phase = runend.STOPPING
            self._state.stop_reason = reason
            self._state.ended_unix_time = time.time()
            self._decided_at = time.monotonic()
            self._write()
        log.info("the run ends: %s (env steps %s, wall time %.0f s)", runend.REASONS[reason],
                 env_steps, wall_seconds)
        return True

    def finish(self, summary: dict[str, Any]) -> None:
        """STOPPING -> FINISHED with ``summary``, written to ``summary.json`` first."""
        if self.summary_path is not None:
            _write_json(self.summary_path, summary)
        with self._lock:
            self.summary = summary
            self._state.phase = runend.FINISHED
            self._state.env_steps = int(summary.get("env_steps", self._state.env_steps))
            self._write()
        log.info("the run has finished (%s): %s", summary.get("stop_reason"), self.summary_path or "no run folder")

    def _write(self) -> None:
        """Records the state in end.json (under the lock)."""
        if self.path is None:
            return
        s = self._state
        _write_json(self.path, {
            "phase": telemetry_pb2.RunPhase.Name(s.phase),
            "stop_reason": telemetry_pb2.StopReason.Name(s.stop_reason),
            "reason": runend.REASONS.get(s.stop_reason, ""), "env_steps": s.env_steps,
            "wall_seconds": round(s.wall_seconds, 3), "ended_unix_time": s.ended_unix_time,
            "rule": runend.rule_of(self.run)})


def _write_json(path: Path, value: dict[str, Any]) -> None:
    """Writes ``value`` to ``path`` atomically (write, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(json.dumps(value, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
