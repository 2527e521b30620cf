"""What a learner records over time (``amprl.common.telemetry``): its ``LearnerStats``,
against the parameter version its weights are at. Not against its own update count: that
starts again from 0 when the learner restarts (a pod restart, ``amprl run --resume``), and
TensorBoard would draw the new points over the old ones; the version goes on."""

from __future__ import annotations

from amprl.common.telemetry import Kind, Series, Telemetry
from amprl.learner.learner import LOG_WINDOW, Learner

G, C, T = Kind.GAUGE, Kind.COUNTER, Kind.THROUGHPUT


def _windowed(lr: Learner, value: float) -> float | None:
    """A figure averaged over a logging window: none before the first window is full."""
    return value if lr.stats.updates >= LOG_WINDOW else None


def telemetry(learner: Learner) -> Telemetry[Learner]:
    s = lambda lr: lr.stats  # noqa: E731 - the figures below read LearnerStats
    return Telemetry("learner", snapshot=lambda: learner, step=lambda lr: lr.version, series=[
        Series("updates", "Optimizer updates computed and pushed (skipped steps not included).",
               T, lambda lr: s(lr).updates),
        Series("loss", f"Mean loss over the last {LOG_WINDOW} updates.", G, lambda lr: _windowed(lr, s(lr).loss)),
        Series("q_mean", f"Mean Q(s, a) of the batches of the last {LOG_WINDOW} updates.",
               G, lambda lr: _windowed(lr, s(lr).q_mean)),
        Series("q_max", f"Largest Q(s, a) in the batches of the last {LOG_WINDOW} updates.",
               G, lambda lr: _windowed(lr, s(lr).q_max)),
        Series("grad_norm", "Global gradient L2 norm of the last update, before clipping.",
               G, lambda lr: s(lr).grad_norm),
        Series("loss_scale", "fp16 GradScaler scale (0 without a scaler: fp32, bf16).",
               G, lambda lr: lr.precision.scale),
        Series("skipped_nonfinite", "Updates skipped because the gradient was not finite (never pushed).",
               C, lambda lr: s(lr).skipped_nonfinite),
        Series("pushes_applied", "Pushes the parameter server applied.", T, lambda lr: s(lr).pushes_applied),
        Series("push_stale_rejections", "Pushes the parameter server rejected as too stale.",
               C, lambda lr: s(lr).stale_rejections),
        Series("push_errors", "Pushes that failed (deadline, connection, refused).",
               C, lambda lr: s(lr).push_errors),
        Series("push_staleness", "Moving average of the staleness (versions) of applied pushes.",
               G, lambda lr: s(lr).staleness),
        Series("push_rtt_seconds", "Moving average of a push's round trip (seconds).",
               G, lambda lr: s(lr).push_rtt_ms / 1000.0),
        Series("resyncs", "Full-weight pulls after a rejected or failed push.", C, lambda lr: s(lr).resyncs),
        Series("param_version", "Parameter version the learner's weights are at.", G, lambda lr: lr.version),
        Series("prefetch_queue", "Sampled batches waiting in the prefetch queue.", G, lambda lr: lr.queue_size),
    ])
