"""`deploy.nice`: the launcher lowers the CPU priority of the processes it starts (real
processes, read back from the kernel)."""

from __future__ import annotations

import os
from pathlib import Path

from amprl.common.redis_server import EmbeddedRedis
from amprl.launch.procs import autogroup_nice, set_nice, start_service, stop_services, wait_for_port

from .conftest import TINY_CONFIG


def thread_nices(pid: int) -> dict[int, int]:
    """Nice value of every thread of ``pid``, from /proc (field 19 of stat)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        out[int(tid)] = int(stat.rsplit(")", 1)[1].split()[16])
    return out


def test_a_service_and_every_thread_it_starts_run_at_the_configured_nice(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(TINY_CONFIG)
    (tmp_path / "logs").mkdir()
    own, own_group = os.getpriority(os.PRIO_PROCESS, 0), autogroup_nice(os.getpid())
    args = ["--config", str(config), "--run-dir", str(tmp_path), "--host", "127.0.0.1"]
    low = start_service("paramserver", "amprl.paramserver", args, tmp_path / "logs", nice=7)
    equal = start_service("paramserver-equal", "amprl.paramserver", args, tmp_path / "logs")
    try:
        wait_for_port(low)
        wait_for_port(equal)
        # serving: gRPC's threads exist now, started after the priority was set
        nices = thread_nices(low.proc.pid)
        assert len(nices) > 2
        assert set(nices.values()) == {min(19, own + 7)}, nices
        assert set(thread_nices(equal.proc.pid).values()) == {own}
        if autogroup_nice(low.proc.pid) is not None:  # the session's group too
            assert autogroup_nice(low.proc.pid) == 7
            assert autogroup_nice(equal.proc.pid) == 0
        assert autogroup_nice(os.getpid()) == own_group  # the launcher's own untouched
        assert os.getpriority(os.PRIO_PROCESS, 0) == own
    finally:
        stop_services([low, equal])


def test_the_embedded_redis_is_lowered_too(tmp_path):
    own = os.getpriority(os.PRIO_PROCESS, 0)
    with EmbeddedRedis(tmp_path / "redis") as redis:
        set_nice(redis.pid, 19)
        assert set(thread_nices(redis.pid).values()) == {19}
        if autogroup_nice(redis.pid) is not None:
            assert autogroup_nice(redis.pid) == 19
    assert os.getpriority(os.PRIO_PROCESS, 0) == own
