"""The process supervisor: how ``amprl run``, the benches and the system and fault tests
start, watch and stop the processes of a run.

Every child runs in a session, hence a process group, of its own, with stdin closed and its
output in a log file. It is stopped through that group: SIGCONT (a stopped process cannot
act on a signal), SIGTERM, then SIGKILL once the grace period is over, so whatever the child
started in its group goes with it, and nothing is ever looked up or stopped by name. A
service reports its port in a port file (``--port-file``); ``wait_for_port`` waits for it
and fails early, with the log's tail, when the process exits first. A service started with
``metrics=True`` also serves ``/metrics`` on a free port, which it writes to its metrics
port file before its port file (``amprl.common.bootstrap``). The CPU priorities of
``deploy.nice`` are set here too (``set_nice``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass
class Service:
    """One child process in its own process group, with its log file and, once read from
    its port file, the port it serves on."""

    name: str
    proc: subprocess.Popen
    log_path: Path
    port_file: Path | None = None
    port: int = 0
    metrics_port_file: Path | None = None
    metrics_port: int = 0
    """Its ``/metrics`` port (0: none, or not read yet)."""

    @property
    def pid(self) -> int:
        """The child's PID, which is also its process group's id."""
        return self.proc.pid

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        """Where Prometheus scrapes it ("" when it serves no ``/metrics``)."""
        return f"http://127.0.0.1:{self.metrics_port}/metrics" if self.metrics_port else ""

    @property
    def returncode(self) -> int | None:
        """The exit status (negative: the signal that ended it); None while it runs."""
        return self.proc.poll()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout_s: float | None = None) -> int:
        """The exit status, once it exits; raises ``subprocess.TimeoutExpired`` after
        ``timeout_s``."""
        return self.proc.wait(timeout=timeout_s)

    def log(self) -> str:
        """Everything it has logged so far ('' before it has written anything)."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 25) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def signal(self, sig: int) -> None:
        """Sends ``sig`` to the process group, SIGCONT first with SIGTERM; nothing once the
        process has exited."""
        if self.alive():
            for s in (signal.SIGCONT, sig) if sig == signal.SIGTERM else (sig,):
                _signal_group(self.pid, s)

    def kill(self) -> int:
        """SIGKILL to the process group (a crash, ``kill -9``); returns the exit status."""
        self.signal(signal.SIGKILL)
        return self.proc.wait(timeout=10)

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM, SIGKILL after ``timeout_s``; returns the exit status."""
        return stop_together([self], timeout_s)[0]


def spawn(name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None, *,
          cwd: Path | None = None, port_file: Path | None = None,
          stdout_path: Path | None = None) -> Service:
    """Starts ``argv`` in a session of its own with stdin closed, appending its stdout and
    stderr to ``log_path`` (its stdout to ``stdout_path`` instead, when given: a child that
    reports its results there). ``env`` is the child's whole environment (None: this
    process's). ``port_file``, where the child will write its port, is removed first, so
    that a stale one is never read."""
    if port_file is not None:
        port_file.unlink(missing_ok=True)
    with open(log_path, "ab") as err, \
            (open(stdout_path, "ab") if stdout_path else contextlib.nullcontext(err)) as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env,
                                cwd=cwd, start_new_session=True)
    return Service(name, proc, log_path, port_file)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, for a service whose address others need before it
    serves (the evaluator's, which workers poll). Another process could take it before the
    service binds it: the service then fails at start, naming the port."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_service(name: str, module: str, args: list[str], log_dir: Path, env: dict | None = None,
                  nice: int = 0, metrics: bool = False) -> Service:
    """Starts the service ``python -m module args --port-file <log_dir>/.<name>.port``
    (``spawn``), logging to ``<log_dir>/<name>.log``, with this process's environment plus
    ``env``, ``nice`` steps below this process's CPU priority (``set_nice``); with
    ``metrics``, serving ``/metrics`` on a free port (``--metrics-port any``), which
    ``wait_for_port`` reads too."""
    port_file = log_dir / f".{name}.port"
    metrics_file = log_dir / f".{name}.metrics-port"
    if metrics:
        metrics_file.unlink(missing_ok=True)
        args = [*args, "--metrics-port", "any", "--metrics-port-file", str(metrics_file)]
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    # Every service sets its own torch thread count; keep NumPy/OpenMP pools from spinning
    # up one thread per core in each of the ~7 processes sharing the machine.
    full_env.setdefault("OMP_NUM_THREADS", "1")
    svc = spawn(name, [sys.executable, "-m", module, *args, "--port-file", str(port_file)],
                log_dir / f"{name}.log", full_env, port_file=port_file)
    set_nice(svc.pid, nice)
    if metrics:
        svc.metrics_port_file = metrics_file
    return svc


def read_port(svc: Service, port_file: Path, timeout_s: float = 120.0) -> int:
    """The port ``svc`` writes to ``port_file`` once it serves; raises RuntimeError (with
    the log's tail) if it exits first, TimeoutError if it takes over ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if port_file.exists():
            text = port_file.read_text().strip()
            if text:
                return int(text)
        if not svc.alive():
            raise RuntimeError(f"{svc.name} exited with code {svc.returncode} before serving:\n{svc.log_tail()}")
        time.sleep(0.05)
    raise TimeoutError(f"{svc.name} did not start serving within {timeout_s:.0f}s:\n{svc.log_tail()}")


def wait_for_port(svc: Service, timeout_s: float = 120.0) -> int:
    """``read_port`` of the service's own port file; also sets ``svc.port`` (and
    ``svc.metrics_port``, written before it, when it serves ``/metrics``)."""
    if svc.port_file is None:
        raise ValueError(f"{svc.name} was started without a port file")
    svc.port = read_port(svc, svc.port_file, timeout_s)
    if svc.metrics_port_file is not None:
        svc.metrics_port = read_port(svc, svc.metrics_port_file, timeout_s)
    return svc.port


def stop_together(services: list[Service], timeout_s: float = 15.0) -> list[int]:
    """Stops them all at once: SIGTERM to every process group, then, for those still
    running ``timeout_s`` later, SIGKILL. Returns the exit statuses, in order."""
    for svc in services:
        svc.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    codes = []
    for svc in services:
        try:
            codes.append(svc.proc.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            _signal_group(svc.pid, signal.SIGKILL)
            codes.append(svc.proc.wait(timeout=5))
    return codes


def stop_services(services: list[Service], timeout_s: float = 15.0) -> list[int]:
    """Stops them one after another, in the order given (clients before the servers they
    talk to), each as ``Service.stop``. Returns the exit statuses, in order."""
    return [svc.stop(timeout_s) for svc in services]


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass  # gone already


AUTOGROUP_SWITCH = Path("/proc/sys/kernel/sched_autogroup_enabled")


def parse_autogroup(text: str) -> int | None:
    """The nice in a ``/proc/<pid>/autogroup`` text ("/autogroup-123 nice 7"); None for the
    empty text the kernel gives a process in the root group (one never moved into a session
    group of its own, e.g. a CI runner's children of PID 1)."""
    fields = text.split()
    return int(fields[-1]) if len(fields) >= 3 and fields[-2] == "nice" else None


def autogroup_nice(pid: int) -> int | None:
    """The autogroup nice of ``pid``'s session; None where the kernel groups no sessions
    or ``pid`` is in the root group."""
    try:
        if not AUTOGROUP_SWITCH.exists() or AUTOGROUP_SWITCH.read_text().strip() != "1":
            return None
        return parse_autogroup(Path(f"/proc/{pid}/autogroup").read_text())
    except OSError:
        return None


def set_nice(pid: int, nice: int) -> None:
    """Lowers the CPU priority of process ``pid`` (started in a session of its own) by
    ``nice`` below this process's own (``deploy.nice``; 0 leaves it as is).

    Where the kernel groups each session's tasks (``autogroup``), the scheduler shares the
    CPU between sessions first, by the group's own nice, so a per-process nice alone would
    not rank one service below another: both are set. Every thread there now is set; the
    threads it starts later inherit the value from the thread that starts them. A kernel
    that refuses (a read-only /proc, say) leaves the priority as it was, with a warning."""
    if nice <= 0:
        return
    try:  # the session's group: only if it is the process's own (never the launcher's)
        if os.getsid(pid) == pid and autogroup_nice(pid) is not None:
            Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except OSError as exc:
        log.warning("could not lower the CPU priority of process %d's session by %d: %s", pid, nice, exc)
    try:
        target = min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice)
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.setpriority(os.PRIO_PROCESS, int(tid), target)
            except ProcessLookupError:
                continue  # the thread ended meanwhile
    except OSError as exc:
        log.warning("could not lower the CPU priority of process %d by %d: %s", pid, nice, exc)
