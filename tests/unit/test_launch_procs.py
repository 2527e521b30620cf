"""The process supervisor: how it starts, watches and stops a child and its process group,
and how it reads a process's scheduler group (``/proc/<pid>/autogroup``)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from amprl.launch.procs import autogroup_nice, parse_autogroup, spawn, stop_together, wait_for_port


def sh(tmp_path: Path, script: str, **kwargs):
    return spawn("sh", ["sh", "-c", script], tmp_path / "sh.log", cwd=tmp_path, **kwargs)


def wait_for_file(path: Path, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and path.read_text().strip()):
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.01)
    return path.read_text().strip()


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody has reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_stopping_a_child_stops_what_it_started_in_its_group(tmp_path):
    svc = sh(tmp_path, "sleep 60 & echo $! > grandchild; wait")
    grandchild = int(wait_for_file(tmp_path / "grandchild"))
    assert os.getpgid(grandchild) == svc.pid  # the child leads a group of its own
    assert svc.stop(timeout_s=5) == -15
    deadline = time.monotonic() + 5
    while not gone(grandchild):
        assert time.monotonic() < deadline, "the grandchild outlived its group's SIGTERM"
        time.sleep(0.01)


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path):
    svc = sh(tmp_path, "trap '' TERM; echo ready > ready; sleep 60")
    wait_for_file(tmp_path / "ready")
    assert svc.stop(timeout_s=0.3) == -9
    assert not svc.alive() and svc.returncode == -9


def test_a_stopped_child_is_continued_so_that_it_can_act_on_sigterm(tmp_path):
    script = "trap 'exit 3' TERM; echo ready > {name}; while :; do sleep 0.05; done"
    a, b = (spawn(n, ["sh", "-c", script.format(name=n)], tmp_path / f"{n}.log", cwd=tmp_path)
            for n in ("a", "b"))
    for n in ("a", "b"):
        wait_for_file(tmp_path / n)
    a.signal(signal.SIGSTOP)  # as a CPU limiter leaves a process between its slots
    assert stop_together([a, b], timeout_s=5) == [3, 3]


def test_the_port_comes_from_the_port_file(tmp_path):
    svc = sh(tmp_path, "echo 4242 > port; sleep 60", port_file=tmp_path / "port")
    try:
        assert wait_for_port(svc, timeout_s=10) == 4242
        assert svc.address == "127.0.0.1:4242"
    finally:
        svc.stop(timeout_s=5)


def test_a_child_that_exits_before_serving_fails_the_wait_with_its_log(tmp_path):
    (tmp_path / "port").write_text("1")  # stale, from an earlier run: removed at the start
    svc = sh(tmp_path, "echo no redis here; exit 3", port_file=tmp_path / "port")
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 3 before serving.*no redis here"):
        wait_for_port(svc, timeout_s=10)


def test_stdout_can_go_to_a_file_of_its_own(tmp_path):
    svc = sh(tmp_path, "echo result; echo diagnostics >&2", stdout_path=tmp_path / "out")
    assert svc.wait(10) == 0
    assert (tmp_path / "out").read_text() == "result\n"
    assert svc.log() == "diagnostics\n"


def test_a_session_group_gives_its_nice():
    assert parse_autogroup("/autogroup-4244 nice 0\n") == 0
    assert parse_autogroup("/autogroup-12 nice 19\n") == 19
    assert parse_autogroup("/autogroup-7 nice -5\n") == -5


def test_the_root_group_has_no_nice_to_read():
    # The kernel prints nothing for a process left in the root group (PID 1 and children
    # that never started a session of their own, as under some CI runners).
    assert parse_autogroup("") is None
    assert parse_autogroup("\n") is None


def test_a_process_that_is_gone_has_none():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    assert autogroup_nice(pid) is None
