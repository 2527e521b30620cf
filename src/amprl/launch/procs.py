"""Child processes of the launcher: one OS process (and process group) per service."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass
class Service:
    name: str
    proc: subprocess.Popen
    log_path: Path
    port_file: Path | None = None
    port: int = 0
    stopping: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])


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
    ``nice`` below this process's own (``run.nice``; 0 leaves it as is).

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


def start_service(name: str, module: str, args: list[str], log_dir: Path, env: dict | None = None,
                  nice: int = 0) -> Service:
    """Starts ``python -m module args`` in its own session (process group), logging to a
    file, ``nice`` steps below this process's CPU priority (``set_nice``)."""
    log_path = log_dir / f"{name}.log"
    port_file = log_dir / f".{name}.port"
    port_file.unlink(missing_ok=True)
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    # Every service sets its own torch thread count; keep NumPy/OpenMP pools from spinning
    # up one thread per core in each of the ~7 processes sharing the machine.
    full_env.setdefault("OMP_NUM_THREADS", "1")
    log = open(log_path, "ab")
    proc = subprocess.Popen([sys.executable, "-m", module, *args, "--port-file", str(port_file)],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=full_env, start_new_session=True)
    log.close()
    set_nice(proc.pid, nice)
    return Service(name, proc, log_path, port_file)


def wait_for_port(svc: Service, timeout_s: float = 120.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if svc.port_file and svc.port_file.exists():
            text = svc.port_file.read_text().strip()
            if text:
                svc.port = int(text)
                return svc.port
        if not svc.alive():
            raise RuntimeError(f"{svc.name} exited with code {svc.proc.returncode} before serving:\n{svc.log_tail()}")
        time.sleep(0.05)
    raise TimeoutError(f"{svc.name} did not start serving within {timeout_s:.0f}s:\n{svc.log_tail()}")


def stop_services(services: list[Service], timeout_s: float = 15.0) -> None:
    """SIGTERM each service's process group in order, then SIGKILL what remains."""
    for svc in services:
        svc.stopping = True
        if svc.alive():
            try:
                os.killpg(svc.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        try:
            svc.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(svc.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            svc.proc.wait(timeout=5)
