"""Background threads that cannot die silently.

A service's helper threads (a learner's prefetch, an actor's sender) retry what they expect
to fail (a server away, a deadline); anything else is a bug or a state they cannot mend. A
thread started by a ``Supervisor`` that ends with an exception is logged with its
traceback and remembered, and the service's main loop calls ``check()``, which raises
``ThreadDied``: the process ends with a non-zero status and Kubernetes restarts it, instead
of a process that reports itself healthy while it no longer trains or acts.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger(__name__)


class ThreadDied(RuntimeError):
    """A supervised thread ended with an exception (chained as the cause)."""


class Supervisor:
    """Starts the background threads of ``owner`` and reports the first that died."""

    def __init__(self, owner: str):
        self.owner = owner
        self.threads: list[threading.Thread] = []
        self._failure: tuple[str, BaseException] | None = None
        self._lock = threading.Lock()

    def start(self, target: Callable[[], None], name: str) -> threading.Thread:
        """Runs ``target`` on a daemon thread named ``<owner>-<name>``."""
        def run() -> None:
            try:
                target()
            except BaseException as exc:  # noqa: BLE001 - recorded, re-raised by check()
                log.exception("%s: the %s thread died", self.owner, name)
                with self._lock:
                    if self._failure is None:
                        self._failure = (name, exc)

        thread = threading.Thread(target=run, name=f"{self.owner}-{name}", daemon=True)
        thread.start()
        self.threads.append(thread)
        return thread

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def check(self) -> None:
        """Raises ThreadDied if a supervised thread has died."""
        failure = self._failure
        if failure is not None:
            name, exc = failure
            raise ThreadDied(f"{self.owner}: the {name} thread died: "
                             f"{type(exc).__name__}: {exc}") from exc

    def join(self, timeout_s: float = 5.0) -> None:
        for thread in self.threads:
            thread.join(timeout=timeout_s)
