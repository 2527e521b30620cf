"""Network namespaces with a delay relay between them: real sockets, real addresses, real
latency on one machine. Clients always run inside a namespace (``Host.call`` or
``Host.exec``); nothing in the machine's own namespace dials a namespace address."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from amprl_testing.netsim import netns
from amprl_testing.netsim.netns import Topology, list_netns, read_line, sweep_stale
from amprl_testing.netsim.pytest_plugin import require_netns

pytestmark = pytest.mark.netns

HERE = Path(__file__).parent
PY = sys.executable
DELAY_MS = 50.0
SLACK_MS = 80.0  # scheduling noise on a busy 2-core machine
ECHO_PORT = 7000
GRPC_PORT = 50051


def start_echo(host: netns.Host, port: int = ECHO_PORT) -> subprocess.Popen:
    proc = host.exec([PY, HERE / "echo_server.py", host.address, str(port)],
                     stdout=subprocess.PIPE)
    host.wait_port(port, proc=proc)
    assert json.loads(read_line(proc, 10)) == {"event": "peer", "peer": [host.address, _any()]}
    return proc


class _any:
    def __eq__(self, other: object) -> bool:
        return True


def split(addr: str) -> tuple[str, int]:
    host, port = addr.rsplit(":", 1)
    return host, int(port)


def round_trips(addr: str, n: int = 5) -> list[float]:
    """Milliseconds per 1-byte echo; runs inside a namespace via Host.call."""
    with socket.create_connection(split(addr), timeout=10) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out = []
        for _ in range(n):
            t = time.perf_counter()
            s.sendall(b"x")
            assert s.recv(1) == b"x"
            out.append((time.perf_counter() - t) * 1e3)
    return out


def echo_bulk(addr: str, nbytes: int) -> tuple[float, int]:
    """Sends ``nbytes``, half-closes, reads the echo to EOF; returns (seconds, bytes back)."""
    with socket.create_connection(split(addr), timeout=30) as s:
        received = [0]

        def reader() -> None:
            while chunk := s.recv(1 << 20):
                received[0] += len(chunk)

        t = time.perf_counter()
        th = threading.Thread(target=reader)
        th.start()
        block = b"\xa5" * 65536
        for _ in range(nbytes // len(block)):
            s.sendall(block)
        s.shutdown(socket.SHUT_WR)
        th.join(30)
        return time.perf_counter() - t, received[0]


def test_round_trip_through_the_relay_is_twice_the_one_way_delay(netns_topology):
    topo = netns_topology(["ps", "learner"])
    start_echo(topo["ps"])
    direct = topo["learner"].call(round_trips, f"{topo['ps'].address}:{ECHO_PORT}")
    relay_addr = topo.delay("learner", "ps", ECHO_PORT, DELAY_MS)
    delayed = topo["learner"].call(round_trips, relay_addr)
    assert max(direct) < 20, direct
    assert min(delayed) >= 2 * DELAY_MS - 0.5, delayed
    assert sorted(delayed)[2] < 2 * DELAY_MS + SLACK_MS, delayed


def test_a_20mb_transfer_is_pipelined_not_stop_and_wait(netns_topology):
    topo = netns_topology(["ps", "learner"])
    start_echo(topo["ps"])
    relay_addr = topo.delay("learner", "ps", ECHO_PORT, DELAY_MS)
    nbytes = 20 * 1024 * 1024
    elapsed, back = topo["learner"].call(echo_bulk, relay_addr, nbytes)
    assert back == nbytes
    # Stop-and-wait with 64 KiB chunks: 320 round trips of 100 ms = 32 s.
    stop_and_wait_s = nbytes / 65536 * 2 * DELAY_MS / 1e3
    assert 2 * DELAY_MS / 1e3 <= elapsed < 5.0, (elapsed, stop_and_wait_s)


def test_grpc_unary_and_server_streaming_calls_cross_the_relay(netns_topology):
    topo = netns_topology(["ps", "learner"])
    ps, learner = topo["ps"], topo["learner"]
    server = ps.exec([PY, HERE / "health_server.py", "--host", ps.address,
                      "--port", str(GRPC_PORT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert json.loads(read_line(server, 20)) == {"event": "serving", "port": GRPC_PORT}
    relay_addr = topo.delay("learner", "ps", GRPC_PORT, DELAY_MS)

    unary = learner.run([PY, HERE / "health_client.py", "--target", relay_addr,
                         "--mode", "unary", "--count", "4"], timeout=30)
    result = json.loads(unary.stdout)
    assert result["statuses"] == ["SERVING"] * 4
    assert min(result["latency_ms"]) >= 2 * DELAY_MS - 0.5, result
    assert sorted(result["latency_ms"])[1] < 2 * DELAY_MS + SLACK_MS, result

    watch = learner.exec([PY, HERE / "health_client.py", "--target", relay_addr,
                          "--mode", "watch", "--service", "amprl.test"], stdout=subprocess.PIPE)
    assert json.loads(read_line(watch, 20)) == {"event": "update", "status": "SERVING"}
    time.sleep(0.5)  # the stream stays open across idle time
    for status in ("NOT_SERVING", "SERVING"):
        t = time.perf_counter()
        server.stdin.write(f"{status}\n".encode())
        server.stdin.flush()
        assert json.loads(read_line(watch, 10)) == {"event": "update", "status": status}
        one_way_ms = (time.perf_counter() - t) * 1e3
        assert DELAY_MS - 0.5 <= one_way_ms < DELAY_MS + SLACK_MS + 100, one_way_ms

    # The server dies: its socket closes, the relay carries the close, the stream ends.
    os.killpg(server.pid, signal.SIGKILL)
    t = time.perf_counter()
    end = json.loads(read_line(watch, 10))
    assert end["event"] == "end" and end["code"] == "UNAVAILABLE", end
    assert time.perf_counter() - t < 5.0
    assert watch.wait(10) == 0


def test_services_bind_namespace_addresses_not_localhost(netns_topology):
    topo = netns_topology(["ps", "learner"])
    ps, learner = topo["ps"], topo["learner"]
    for host in (ps, learner, topo.switch):
        assert ipaddress.ip_address(host.address).is_private
        assert not ipaddress.ip_address(host.address).is_loopback
    echo = start_echo(ps)

    def connect(addr: tuple[str, int]) -> str:
        try:
            socket.create_connection(addr, timeout=5).close()
            return "connected"
        except ConnectionRefusedError:
            return "refused"

    # Nothing listens on loopback, neither in the client's namespace nor the server's.
    assert learner.call(connect, ("127.0.0.1", ECHO_PORT)) == "refused"
    assert ps.call(connect, ("127.0.0.1", ECHO_PORT)) == "refused"
    # Direct, the server sees the client's namespace address; via the relay, the switch's.
    assert learner.call(round_trips, f"{ps.address}:{ECHO_PORT}", 1)
    assert json.loads(read_line(echo, 10))["peer"][0] == learner.address
    assert learner.call(round_trips, topo.delay("learner", "ps", ECHO_PORT, 1), 1)
    assert json.loads(read_line(echo, 10))["peer"][0] == topo.switch.address
    # The machine's own namespace holds none of the topology's addresses or links.
    own = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    assert topo.subnet + "." not in own


def test_an_in_process_relay_can_live_in_a_namespace(netns_topology):
    from amprl_testing.netsim.relay import DelayRelay

    topo = netns_topology(["ps", "learner"])
    start_echo(topo["ps"])
    with DelayRelay((topo.switch.address, 0), (topo["ps"].address, ECHO_PORT), DELAY_MS,
                    netns=topo.switch.netns) as relay:
        delayed = topo["learner"].call(round_trips, relay.address, 3)
        assert relay.stats()["connections_accepted"] == 1
    assert min(delayed) >= 2 * DELAY_MS - 0.5, delayed


def test_limit_rate_applies_a_token_bucket_to_the_host_link(netns_topology):
    topo = netns_topology(["ps", "learner"])
    start_echo(topo["ps"])
    topo["learner"].limit_rate(40)  # 5 MB/s out of the learner
    elapsed, back = topo["learner"].call(echo_bulk, f"{topo['ps'].address}:{ECHO_PORT}",
                                         2 * 1024 * 1024)
    assert back == 2 * 1024 * 1024
    assert elapsed >= 0.3, elapsed


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def test_leaving_the_topology_by_an_exception_removes_everything():
    require_netns()
    with pytest.raises(RuntimeError, match="test body failed"):
        with Topology(["a", "b"]) as topo:
            namespaces = topo.namespaces
            topo["a"].exec(["sleep", "300"])
            topo["b"].exec(["bash", "-c", "sleep 300 & sleep 300 & wait"])
            topo["b"].exec(["setsid", "-f", "sleep", "300"])  # escapes its process group
            topo.delay("a", "b", ECHO_PORT, 10)
            deadline = time.monotonic() + 5
            while len(pids := [p for ns in namespaces for p in netns.netns_pids(ns)]) < 6:
                assert time.monotonic() < deadline, pids
                time.sleep(0.02)
            raise RuntimeError("test body failed")
    assert not set(namespaces) & set(list_netns())
    assert [p for p in pids if _alive(p)] == []
    assert not topo.tmpdir.exists()


def test_the_fixture_cleans_up_after_a_failing_test(tmp_path):
    require_netns()
    record = tmp_path / "record.json"
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(f"""
        import json

        def test_fails(netns_topology):
            topo = netns_topology(["x", "y"])
            proc = topo["x"].exec(["sleep", "300"])
            with open({str(record)!r}, "w") as f:
                json.dump({{"netns": topo.namespaces, "pid": proc.pid,
                           "tmpdir": str(topo.tmpdir)}}, f)
            raise AssertionError("deliberate failure")
    """))
    inner = subprocess.run([PY, "-m", "pytest", "-q", "-p", "amprl_testing.netsim.pytest_plugin",
                            "-p", "no:cacheprovider", "test_inner.py"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert inner.returncode == 1, inner.stdout + inner.stderr
    assert "deliberate failure" in inner.stdout
    assert "process logs of amprl-" in inner.stdout
    left = json.loads(record.read_text())
    assert not set(left["netns"]) & set(list_netns())
    assert not _alive(left["pid"])
    assert not Path(left["tmpdir"]).exists()


def test_sweep_removes_namespaces_of_dead_runs_only():
    require_netns()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{netns.PREFIX}-{dead.pid}-0-stale"
    live = f"{netns.PREFIX}-{os.getpid()}-999999-live"
    squatter = None
    try:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "add", name], check=True)
        squatter = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "300"],
                                    start_new_session=True)
        deadline = time.monotonic() + 5
        while not netns.netns_pids(stale):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        sweep_stale()
        assert stale not in list_netns()
        assert live in list_netns()
        assert squatter.wait(5) == -signal.SIGKILL
    finally:
        if squatter is not None and squatter.poll() is None:
            os.killpg(squatter.pid, signal.SIGKILL)
            squatter.wait()
        for name in (stale, live):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
