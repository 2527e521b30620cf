"""TensorBoard event files of a service's series (``amprl.common.telemetry``), written from
a thread of its own every ``WRITE_EVERY_S`` into ``RUN_DIR/tb/<service id>/`` (with
``--tensorboard on``, the default, and a ``--run-dir``), so that

    tensorboard --logdir runs/

shows every run, one curve per service process, each against its own step axis.

A point is written only when the step has moved since the last one (a learner waiting for
replay adds nothing; ``Telemetry.revision`` for the evaluator: a new evaluation), so a step
carries one value; a THROUGHPUT series' rate is its growth between two written points over
the seconds between them. ``write`` also writes at
once, from any thread: the evaluator calls it after each evaluation, so that no evaluation
falls between two periodic writes.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable

from amprl.common.telemetry import Kind, Reading, Telemetry, tensorboard_tag

log = logging.getLogger(__name__)

WRITE_EVERY_S = 5.0
"""Seconds between two periodic writes: a few points a minute per curve."""

FLUSH_EVERY_S = 10.0
"""How often the event file is flushed to disk (SummaryWriter's flush_secs)."""


def run_folder(run_dir: str | Path, instance: str) -> Path:
    """Where a service process's event files go: ``RUN_DIR/tb/<instance>``, or, when an
    earlier process of that instance wrote there (a restart, ``amprl run --resume``),
    ``RUN_DIR/tb/<instance>/restart-<n>``: a counter that starts again from 0 (an actor's
    env steps) would otherwise be drawn over the earlier points, which TensorBoard then
    drops as orphaned."""
    folder = Path(run_dir) / "tb" / instance
    if not any(folder.glob("events.out.tfevents.*")):
        return folder
    n = 1
    while any((folder / f"restart-{n}").glob("events.out.tfevents.*")):
        n += 1
    return folder / f"restart-{n}"


class TensorBoardWriter:
    """Writes one service's series to its folder (module docstring)."""

    def __init__(self, telemetry: Telemetry, folder: Path, *, every_s: float = WRITE_EVERY_S,
                 clock: Callable[[], float] = time.monotonic):
        from torch.utils.tensorboard import SummaryWriter  # tensorboard's import is slow: only when used

        self.telemetry = telemetry
        self.folder = folder
        self.every_s = every_s
        self._clock = clock  # what the rates divide by
        self._writer = SummaryWriter(str(folder), flush_secs=int(FLUSH_EVERY_S))
        self._lock = threading.Lock()
        self._last: tuple[Reading, float] | None = None  # the last point written, monotonic time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    def start(self) -> "TensorBoardWriter":
        self._thread = threading.Thread(target=self._loop, name="tensorboard", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        self.write()  # the first point at once: the next one has a rate
        while not self._stop.wait(self.every_s):
            self.write()

    def write(self) -> bool:
        """Reads the series and writes a point if there is a new one; True if it wrote.
        Never raises: a failing read is logged once and tried again at the next write."""
        try:
            reading = self.telemetry.read()
        except Exception:  # noqa: BLE001 - the service goes on without its curves
            if not self._failing:
                log.exception("tensorboard: reading the %s series failed", self.telemetry.service)
            self._failing = True
            return False
        self._failing = False
        now = self._clock()
        with self._lock:
            if not reading.values or (self._last is not None
                                      and reading.revision <= self._last[0].revision):
                return False
            self._add(reading, now)
            self._last = (reading, now)
        return True

    def _add(self, reading: Reading, now: float) -> None:
        service = self.telemetry.service
        before: dict[str, dict[str, float]] = {}
        elapsed = 0.0
        if self._last is not None:
            before = {s.name: v for s, v in self._last[0].values}
            elapsed = now - self._last[1]
        for s, values in reading.values:
            for key, value in values.items():
                if s.kind is Kind.THROUGHPUT:
                    if elapsed > 0 and key in before.get(s.name, {}):
                        rate = (value - before[s.name][key]) / elapsed
                        self._writer.add_scalar(tensorboard_tag(service, s, key, rate=True), rate,
                                                reading.step, walltime=reading.walltime)
                    continue
                self._writer.add_scalar(tensorboard_tag(service, s, key), value, reading.step,
                                        walltime=reading.walltime)

    def close(self) -> None:
        """Stops the thread, writes a last point (if the step moved) and closes the file."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.write()
        self._writer.close()
