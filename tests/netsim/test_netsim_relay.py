"""DelayRelay on loopback: delay per direction, ordering, half-close, resets, rate cap."""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest

from amprl_testing.netsim.relay import DelayRelay, parse_address

DELAY_MS = 40.0
SLACK_MS = 60.0  # scheduling noise on a busy 2-core machine


class Upstream:
    """A loopback TCP server whose per-connection behaviour is a function of the socket."""

    def __init__(self, handler) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.handler = handler
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.handler, args=(conn,), daemon=True).start()

    def close(self) -> None:
        self.sock.close()


def echo(conn: socket.socket) -> None:
    with conn:
        while data := conn.recv(1 << 20):
            conn.sendall(data)
        conn.shutdown(socket.SHUT_WR)


@pytest.fixture
def echo_relay():
    upstream = Upstream(echo)
    relay = DelayRelay(("127.0.0.1", 0), ("127.0.0.1", upstream.port), DELAY_MS)
    relay.start()
    yield relay
    relay.stop()
    upstream.close()


def dial(relay: DelayRelay) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", relay.port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def recv_exactly(s: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = s.recv(n - len(out))
        assert chunk, f"EOF after {len(out)} of {n} bytes"
        out += chunk
    return bytes(out)


def test_round_trip_takes_twice_the_one_way_delay(echo_relay):
    with dial(echo_relay) as s:
        rtts = []
        for i in range(5):
            t = time.perf_counter()
            s.sendall(b"%d" % i)
            assert recv_exactly(s, 1) == b"%d" % i
            rtts.append((time.perf_counter() - t) * 1e3)
    assert min(rtts) >= 2 * DELAY_MS - 0.5, rtts
    assert sorted(rtts)[2] < 2 * DELAY_MS + SLACK_MS, rtts


def test_many_chunks_are_in_flight_at_once(echo_relay):
    # 200 writes 5 ms apart take ~1 s to send; stop-and-wait would need 200 round trips (16 s).
    with dial(echo_relay) as s:
        t = time.perf_counter()
        got = bytearray()
        reader = threading.Thread(target=lambda: got.extend(recv_exactly(s, 200 * 1000)))
        reader.start()
        for i in range(200):
            s.sendall(bytes([i % 256]) * 1000)
            time.sleep(0.005)
        reader.join(20)
        elapsed = time.perf_counter() - t
    assert bytes(got) == b"".join(bytes([i % 256]) * 1000 for i in range(200))
    assert elapsed < 1.0 + 2 * DELAY_MS / 1e3 + 1.5, elapsed


def test_jitter_never_reorders_bytes():
    upstream = Upstream(echo)
    payload = random.Random(0).randbytes(300_000)
    with DelayRelay("127.0.0.1:0", f"127.0.0.1:{upstream.port}", 20, jitter_ms=15) as relay:
        with dial(relay) as s:
            reader_out = bytearray()
            reader = threading.Thread(
                target=lambda: reader_out.extend(recv_exactly(s, len(payload))))
            reader.start()
            for i in range(0, len(payload), 1000):
                s.sendall(payload[i:i + 1000])
            reader.join(20)
    upstream.close()
    assert bytes(reader_out) == payload


def test_half_close_reaches_the_server_after_the_delay_and_replies_still_flow():
    seen: dict[str, float] = {}

    def reply_after_eof(conn: socket.socket) -> None:
        with conn:
            data = b""
            while chunk := conn.recv(4096):
                data += chunk
            seen["eof"] = time.perf_counter()
            conn.sendall(b"got %d" % len(data))  # the other direction is still open
            conn.shutdown(socket.SHUT_WR)

    upstream = Upstream(reply_after_eof)
    with DelayRelay(("127.0.0.1", 0), ("127.0.0.1", upstream.port), DELAY_MS) as relay:
        with dial(relay) as s:
            s.sendall(b"hello")
            t = time.perf_counter()
            s.shutdown(socket.SHUT_WR)
            assert s.recv(100) == b"got 5"
            answered = time.perf_counter()
            assert s.recv(100) == b""  # the server's FIN, relayed
        deadline = time.monotonic() + 5
        while relay.stats()["connections_open"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert relay.stats()["connections_open"] == 0
    upstream.close()
    assert (seen["eof"] - t) * 1e3 >= DELAY_MS - 0.5
    assert (answered - t) * 1e3 >= 2 * DELAY_MS - 0.5


def test_a_refused_target_closes_the_client_connection():
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens there now
    with DelayRelay(("127.0.0.1", 0), ("127.0.0.1", port), DELAY_MS) as relay:
        with dial(relay) as s:
            s.sendall(b"anyone?")
            try:
                assert s.recv(10) == b""
            except ConnectionResetError:
                pass  # a reset is the expected form; an orderly EOF is acceptable


def test_rate_cap_limits_throughput():
    upstream = Upstream(echo)
    # 2 MB at 40 Mbit/s (5 MB/s) takes >= 0.4 s each way, pipelined: >= 0.4 s in all.
    with DelayRelay(("127.0.0.1", 0), ("127.0.0.1", upstream.port), 5, rate_mbit=40) as relay:
        with dial(relay) as s:
            n = 2_000_000
            t = time.perf_counter()
            reader = threading.Thread(target=recv_exactly, args=(s, n))
            reader.start()
            s.sendall(b"\0" * n)
            reader.join(20)
            elapsed = time.perf_counter() - t
    upstream.close()
    assert 0.4 <= elapsed < 5.0, elapsed


def test_stop_resets_open_connections(echo_relay):
    s = dial(echo_relay)
    s.sendall(b"x")
    assert recv_exactly(s, 1) == b"x"
    echo_relay.stop()
    try:
        assert s.recv(10) == b""
    except ConnectionResetError:
        pass
    s.close()


@pytest.mark.parametrize("kwargs, message", [
    ({"delay_ms": -1}, "delay_ms"),
    ({"delay_ms": 10, "jitter_ms": 20}, "jitter_ms"),
    ({"delay_ms": 10, "rate_mbit": 0}, "rate_mbit"),
])
def test_bad_arguments_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DelayRelay("127.0.0.1:0", "127.0.0.1:1", **kwargs)


def test_parse_address_accepts_ipv6_brackets():
    assert parse_address("[::1]:5000") == ("::1", 5000)
    assert parse_address("10.0.0.1:6000") == ("10.0.0.1", 6000)
    with pytest.raises(ValueError, match="host:port"):
        parse_address("10.0.0.1")


def test_a_cut_link_moves_nothing_and_healing_delivers_what_was_held(echo_relay):
    with dial(echo_relay) as s:
        s.sendall(b"a")
        assert recv_exactly(s, 1) == b"a"
        with echo_relay.cut():
            s.sendall(b"held")
            s.settimeout(0.5)
            with pytest.raises(socket.timeout):
                s.recv(16)  # nothing crosses a cut link, in either direction
            # a connection made while cut is accepted but not dialled onward
            late = dial(echo_relay)
            late.sendall(b"late")
            late.settimeout(0.5)
            with pytest.raises(socket.timeout):
                late.recv(16)
            assert echo_relay.stats()["bytes_up"] == 1
        s.settimeout(10)
        late.settimeout(10)
        assert recv_exactly(s, 4) == b"held"  # delivered in order once healed
        with late:
            assert recv_exactly(late, 4) == b"late"


def test_a_one_way_cut_lets_requests_through_and_holds_the_replies():
    got = []

    def record_and_echo(conn):
        with conn:
            while data := conn.recv(1 << 20):
                got.append(data)
                conn.sendall(data)

    upstream = Upstream(record_and_echo)
    with DelayRelay(("127.0.0.1", 0), ("127.0.0.1", upstream.port), 0) as relay, dial(relay) as s:
        s.sendall(b"a")
        assert recv_exactly(s, 1) == b"a"
        with relay.cut("down"):
            s.sendall(b"bc")
            deadline = time.monotonic() + 5
            while b"".join(got) != b"abc" and time.monotonic() < deadline:
                time.sleep(0.01)
            assert b"".join(got) == b"abc"  # the request arrived
            s.settimeout(0.5)
            with pytest.raises(socket.timeout):
                s.recv(16)  # its answer did not
        s.settimeout(10)
        assert recv_exactly(s, 2) == b"bc"
        assert relay.reset_connections() == 1
        try:
            assert s.recv(16) == b""  # the connection is gone (closed or reset)
        except ConnectionResetError:
            pass
    upstream.close()
