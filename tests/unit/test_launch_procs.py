"""How the launcher reads a process's scheduler group (``/proc/<pid>/autogroup``)."""

from __future__ import annotations

import os

from amprl.launch.procs import autogroup_nice, parse_autogroup


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
