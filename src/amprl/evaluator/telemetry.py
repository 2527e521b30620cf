"""What the evaluator records over time (``amprl.common.telemetry``): each evaluation,
against the fleet's env steps when its weights were made, at the wall time they were
pulled (TensorBoard's "relative" and "wall" axes show return against time)."""

from __future__ import annotations

from typing import NamedTuple

from amprl.common.telemetry import Kind, Series, Telemetry
from amprl.evaluator.evaluator import Evaluator
from amprl.v1 import telemetry_pb2

G, C = Kind.GAUGE, Kind.COUNTER


class Latest(NamedTuple):
    evaluations: int
    last: telemetry_pb2.Evaluation | None
    best: telemetry_pb2.Evaluation | None


def _latest(evaluator: Evaluator) -> Latest:
    with evaluator._lock:
        evals = evaluator.evaluations
        return Latest(len(evals), evals[-1] if evals else None, evaluator.best)


def telemetry(evaluator: Evaluator) -> Telemetry[Latest]:
    def last(field: str):
        return lambda s: getattr(s.last, field) if s.last is not None else None

    return Telemetry(
        "evaluator", snapshot=lambda: _latest(evaluator),
        step=lambda s: s.last.env_steps if s.last is not None else 0,
        walltime=lambda s: s.last.unix_time if s.last is not None else 0.0,
        revision=lambda s: s.evaluations,
        series=[
            Series("return_mean", "Mean undiscounted return of the last greedy evaluation.", G,
                   last("mean_return")),
            Series("return_std", "Standard deviation of the returns of the last evaluation.", G,
                   last("std_return")),
            Series("best_return_mean", "Best mean return of any evaluation so far (with a run "
                   "folder: the weights in RUN/best).", G,
                   lambda s: s.best.mean_return if s.best is not None else None),
            Series("param_version", "Parameter version of the last evaluation.", G, last("param_version")),
            Series("env_steps", "Fleet env steps when the last evaluated weights were pulled.", G,
                   last("env_steps")),
            Series("wall_seconds", "Seconds since the evaluator started when the last evaluated "
                   "weights were pulled.", G, last("wall_seconds")),
            Series("evaluations", "Evaluations made.", C, lambda s: s.evaluations),
        ])
