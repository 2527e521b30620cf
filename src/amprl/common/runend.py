"""When a run ends, and what it leaves behind: the stop rule and the run's summary.

The rule is the experiment's ``run`` section, judged in this order:

    run.stop_at_target and some evaluation's mean return >= run.target_return -> TARGET_REACHED
    fleet env steps (replay's count) >= run.total_env_steps                    -> STEP_BUDGET
    run.max_wall_seconds > 0 and the run's wall time >= run.max_wall_seconds   -> WALL_LIMIT

One process applies it: the evaluator (``amprl.evaluator.verdict``), which sees all three
figures and keeps its verdict in its run folder. Actors and learners follow the verdict
(``amprl.evaluator.client.RunEndWatch``); ``amprl run``, ``amprl status`` and the chart's
done Job read it from the evaluator. The summary is built here so that the evaluator's
``summary.json`` (a cluster's) and ``amprl run``'s (which adds what only the launcher
sees) have the same fields.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterable, Sequence

from amprl.config import ExperimentConfig, RunConfig
from amprl.v1 import telemetry_pb2

RUNNING = telemetry_pb2.RUN_PHASE_RUNNING
STOPPING = telemetry_pb2.RUN_PHASE_STOPPING
FINISHED = telemetry_pb2.RUN_PHASE_FINISHED

REASONS: dict[int, str] = {
    telemetry_pb2.STOP_REASON_TARGET_REACHED: "target reached",
    telemetry_pb2.STOP_REASON_STEP_BUDGET: "step budget reached",
    telemetry_pb2.STOP_REASON_WALL_LIMIT: "wall-clock limit reached",
}
"""StopReason -> the words summary.json and the launcher use."""


RULE_KEYS = ("total_env_steps", "target_return", "stop_at_target", "max_wall_seconds")
"""The run-section keys the rule reads."""


def rule_of(run: RunConfig) -> dict[str, Any]:
    """The values of ``RULE_KEYS``: a verdict is kept only while they stay the same."""
    values = dataclasses.asdict(run)
    return {k: values[k] for k in RULE_KEYS}


def phase_name(phase: int) -> str:
    """"running", "stopping", "finished" (or "unknown")."""
    names: dict[int, str] = {RUNNING: "running", STOPPING: "stopping", FINISHED: "finished"}
    return names.get(phase, "unknown")


def stop_reason(run: RunConfig, *, env_steps: int | None, returns: Iterable[float],
                wall_seconds: float) -> telemetry_pb2.StopReason.ValueType:
    """The rule (module docstring): a StopReason, STOP_REASON_UNSPECIFIED while the run goes
    on. ``env_steps`` None (not known: no replay to ask) leaves the step budget unjudged."""
    if run.stop_at_target and any(r >= run.target_return for r in returns):
        return telemetry_pb2.STOP_REASON_TARGET_REACHED
    if env_steps is not None and env_steps >= run.total_env_steps:
        return telemetry_pb2.STOP_REASON_STEP_BUDGET
    if run.max_wall_seconds > 0 and wall_seconds >= run.max_wall_seconds:
        return telemetry_pb2.STOP_REASON_WALL_LIMIT
    return telemetry_pb2.STOP_REASON_UNSPECIFIED


def best_record(run_dir: Path | str | None) -> dict[str, Any] | None:
    """The summary's ``best`` entry from ``RUN/best/best.json`` (the evaluator's best weights,
    paths relative to RUN), None when there is none."""
    if not run_dir:
        return None
    try:
        record = json.loads((Path(run_dir) / "best" / "best.json").read_text())
        return {"param_version": record["param_version"], "mean_return": record["mean_return"],
                "weights": f"best/{record['weights']}", "config": "best/config.yaml"}
    except (OSError, ValueError, KeyError):
        return None


def summary(cfg: ExperimentConfig, reason: str, evaluations: Sequence[Any], *, env_steps: int,
            param_version: int, wall_seconds: float, replay_size: int | None = None,
            run_dir: Path | str | None = None) -> dict[str, Any]:
    """The run's summary: ``evaluations`` are Evaluation messages (or anything with their
    fields), oldest first; times are the evaluator's clock (Evaluation.wall_seconds)."""
    first_hit = next((e for e in evaluations if e.mean_return >= cfg.run.target_return), None)
    last = evaluations[-1] if evaluations else None
    out: dict[str, Any] = {
        "name": cfg.name, "algo": cfg.algo, "env_id": cfg.env.id, "stop_reason": reason,
        "solved": first_hit is not None, "target_return": cfg.run.target_return,
        "final_eval_return": last.mean_return if last is not None else None,
        "final_eval_std": last.std_return if last is not None else None,
        "best_eval_return": max((e.mean_return for e in evaluations), default=None),
        "env_steps": int(env_steps), "param_version": int(param_version),
        "wall_seconds": round(wall_seconds, 2),
        "time_to_target_seconds": round(first_hit.wall_seconds, 2) if first_hit is not None else None,
        "steps_to_target": int(first_hit.env_steps) if first_hit is not None else None,
        "evaluations": len(evaluations),
    }
    if replay_size is not None:
        out["replay_size"] = int(replay_size)
    best = best_record(run_dir)
    if best is not None:
        out["best"] = best
    return out
