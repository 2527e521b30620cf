"""What a service records over time, declared once; two sinks read it.

Each service lists its figures as ``Series`` of a ``Telemetry``, next to the stats it
already keeps (``<service>/telemetry.py``): a name, a help line, a ``Kind`` and a function
that reads the value from one snapshot of those stats. Nothing else is kept: the sinks read
the stats when they need them.

    Telemetry("learner", snapshot=lambda: learner, step=lambda lr: lr.stats.updates, series=[
        Series("loss", "Mean loss over the last 50 updates.", Kind.GAUGE, lambda lr: lr.stats.loss),
        Series("updates", "Optimizer updates made.", Kind.THROUGHPUT, lambda lr: lr.stats.updates),
    ])

The sinks (started and stopped with the process by ``bootstrap.ServiceProcess``):

- Prometheus (``amprl.common.metrics``): ``/metrics`` serves ``amprl_<service>_<name>``, a
  gauge, or a counter (``..._total``) for COUNTER and THROUGHPUT, read at each scrape.
- TensorBoard (``amprl.common.tensorboard``): every few seconds, ``<service>/<name>`` at
  the service's step (learner: updates, actor: env steps, replay: inserted transitions,
  parameter server: version, evaluator: env steps of its last evaluation), and for
  THROUGHPUT the per-second rate between two writes, ``<service>/<name>_per_s``.

A series whose ``read`` answers a mapping is labelled: each key is a value of its
``label`` (bytes on the wire by ``encoding``); TensorBoard tags it ``<service>/<name>/<key>``.
"""

from __future__ import annotations

import enum
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Generic, Mapping, Sequence, TypeVar

S = TypeVar("S")

Value = float | Mapping[str, float] | None

NAME = re.compile(r"[a-z][a-z0-9_]*")
"""Series, service and label names: Prometheus-safe snake case (units as suffixes:
``_seconds``, ``_bytes``)."""


class Kind(enum.Enum):
    """How a series behaves over time, hence how each sink shows it."""

    GAUGE = "gauge"
    """A level, read as it is now (loss, replay size, version): a Prometheus gauge and the
    same value in TensorBoard."""
    COUNTER = "counter"
    """A running total of events (non-finite steps skipped, pushes rejected): a Prometheus
    counter (``rate()`` in PromQL) and the total in TensorBoard."""
    THROUGHPUT = "throughput"
    """A running total of work (updates, env steps, inserts): a Prometheus counter, and in
    TensorBoard its per-second rate between two writes (tag ``<name>_per_s``)."""

    @property
    def counts(self) -> bool:
        """A running total (a Prometheus counter)."""
        return self is not Kind.GAUGE


@dataclass(frozen=True)
class Series(Generic[S]):
    """One figure of a service (module docstring)."""

    name: str
    """snake_case, units as suffixes; ``amprl_<service>_<name>`` in Prometheus (plus
    ``_total`` for counters), ``<service>/<name>`` in TensorBoard."""
    help: str
    """One sentence: what it is, its unit."""
    kind: Kind
    read: Callable[[S], Value]
    """The value from a snapshot of the service's stats; a mapping for a labelled series;
    None while there is none yet (a mean over episodes before the first has ended)."""
    label: str = ""
    """The label a mapping's keys are values of ("encoding"); "" for a plain number."""

    def __post_init__(self) -> None:
        for what, value in (("series name", self.name), ("label", self.label or "x")):
            if not NAME.fullmatch(value):
                raise ValueError(f"{what} {value!r}: lowercase letters, digits and _, starting with a letter")
        if self.name.endswith("_total"):
            raise ValueError(f"series {self.name!r}: a counter's _total is added by the Prometheus sink")


@dataclass(frozen=True)
class Reading:
    """One snapshot read through every series of a ``Telemetry``."""

    step: int
    revision: int
    """The step, or ``Telemetry.revision``'s answer: a new point when it grows."""
    walltime: float
    """Unix time of the figures (now, or the moment the snapshot describes)."""
    values: list[tuple[Series, dict[str, float]]]
    """Each series with its values by label value ({"": v} for a plain number); a series
    without a value yet, or whose read failed, is left out."""


@dataclass(frozen=True)
class Telemetry(Generic[S]):
    """A service's series (module docstring)."""

    service: str
    """"learner", "actor", "replay", "paramserver", "evaluator": the name's prefix."""
    snapshot: Callable[[], S]
    """The stats every series reads, taken once per reading (so they agree with each other)."""
    step: Callable[[S], int]
    """TensorBoard's step axis."""
    series: Sequence[Series[S]]
    walltime: Callable[[S], float] | None = None
    """Unix time the snapshot describes (the evaluator: when its weights were pulled);
    None: the time of the reading."""
    revision: Callable[[S], int] | None = None
    """What changes when the snapshot holds a new point for TensorBoard (the evaluator: its
    number of evaluations, as two may share a step); None: the step."""
    errors: list[str] = field(default_factory=list, compare=False)
    """Series whose read failed at the last reading (``name: error``), for the sinks' logs."""

    def __post_init__(self) -> None:
        if not NAME.fullmatch(self.service):
            raise ValueError(f"service name {self.service!r}: lowercase letters, digits and _")
        names = [s.name for s in self.series]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.service}: series named twice: "
                             f"{sorted({n for n in names if names.count(n) > 1})}")

    def read(self) -> Reading:
        """Takes one snapshot and reads every series from it. A series whose read raises
        is left out of this reading (named in ``errors``); a failing snapshot raises."""
        snap = self.snapshot()
        values: list[tuple[Series, dict[str, float]]] = []
        failed = []
        for s in self.series:
            try:
                raw = s.read(snap)
                if raw is None:
                    continue
                values.append((s, {str(k): float(v) for k, v in raw.items()} if isinstance(raw, Mapping)
                               else {"": float(raw)}))
            except Exception as exc:  # noqa: BLE001 - one bad figure never hides the others
                failed.append(f"{s.name}: {exc!r}")
        self.errors[:] = failed
        step = int(self.step(snap))
        return Reading(step, int(self.revision(snap)) if self.revision else step,
                       float(self.walltime(snap)) if self.walltime else time.time(), values)


def prometheus_name(service: str, series: Series) -> str:
    """``amprl_<service>_<name>``, the family name (prometheus_client adds a counter's _total)."""
    return f"amprl_{service}_{series.name}"


def tensorboard_tag(service: str, series: Series, key: str = "", *, rate: bool = False) -> str:
    """``<service>/<name>[_per_s][/<label value>]``."""
    tag = f"{service}/{series.name}{'_per_s' if rate else ''}"
    return f"{tag}/{key}" if key else tag
