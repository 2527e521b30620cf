"""A TCP delay line: a user-space stand-in for ``tc netem delay`` (absent on our kernels).

``DelayRelay`` listens on one address and, for every accepted connection, dials the target
and forwards bytes both ways. Each chunk read from one side is written to the other side
``delay_ms`` after it was read, in order, so one relay adds ``delay_ms`` to each direction
and ``2 * delay_ms`` to a round trip -- in the spirit of toxiproxy's latency toxic.

It is a delay *line*, not stop-and-wait: any number of chunks are in flight at once (up to
``max_buffer_bytes`` per direction, then the relay stops reading and TCP flow control pushes
back on the sender), so throughput is bounded by the CPU and ``rate_mbit``, not by
``chunk / delay``. An optional ``rate_mbit`` serialises each direction at that rate before
the delay (a bottleneck link followed by propagation delay); ``jitter_ms`` adds a uniform
random extra delay in ``[-jitter_ms, +jitter_ms]`` without reordering bytes.

Connection lifecycle travels through the delay too, so HTTP/2 (gRPC) behaves as over a
real link: a half-close (FIN) from one side reaches the other side ``delay_ms`` later as a
``shutdown(SHUT_WR)``; a reset (RST) arrives as an abort; when both directions have seen
FIN, both sockets are closed. If the target refuses the connection, the accepted socket is
reset at once.

In-process (benchmarks, loopback tests)::

    relay = DelayRelay(("127.0.0.1", 0), ("127.0.0.1", server_port), delay_ms=150)
    port = relay.start()          # the bound port; the relay runs on its own thread
    ...                           # dial 127.0.0.1:port
    relay.stop()

``DelayRelay(..., netns="name")`` runs the relay's thread inside a network namespace (the
thread calls ``setns``), so its sockets live there. As a process (what
``amprl_testing.netsim.netns.Topology.delay`` starts inside a namespace)::

    python -m amprl_testing.netsim.relay --listen 10.0.0.1:6000 --target 127.0.0.1:5000 --delay-ms 150

The process prints one JSON line ``{"event": "listening", "host": ..., "port": ...}`` on
stdout once it accepts connections, logs to stderr, and exits cleanly on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import logging
import random
import signal
import sys
import threading
from typing import Iterator, Sequence

log = logging.getLogger(__name__)

Address = tuple[str, int]

# Per direction, bytes held in the delay queue plus the outgoing socket buffer before the
# relay stops reading. It must exceed the bandwidth-delay product of the link it emulates:
# 32 MiB at 150 ms one way allows ~220 MB/s, more than Python forwards on one core.
DEFAULT_MAX_BUFFER_BYTES = 32 * 1024 * 1024

_EOF = object()  # queue marker: deliver a half-close (FIN)
_CLOSE = object()  # queue marker: the source vanished; close (or reset) the destination


def parse_address(text: str | Address) -> Address:
    """``"host:port"``, ``"[v6]:port"`` or ``(host, port)`` -> ``(host, port)``."""
    if isinstance(text, tuple):
        return str(text[0]), int(text[1])
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address {text!r} must look like host:port")
    return host.strip("[]"), int(port)


class _Pipe:
    """One direction of one connection: a FIFO of (due time, chunk or marker)."""

    def __init__(self, conn: "_Connection", name: str) -> None:
        self.conn = conn
        self.name = name
        self.src: asyncio.Transport | None = None
        self.dst: asyncio.Transport | None = None
        self.queue: collections.deque = collections.deque()
        self.queued_bytes = 0
        self.timer: asyncio.TimerHandle | None = None
        self.last_due = 0.0  # due times never decrease: jitter must not reorder bytes
        self.link_free_at = 0.0  # when the emulated link finishes serialising (rate cap)
        self.src_paused = False
        self.dst_blocked = False  # the destination transport asked us to stop writing
        self.eof_delivered = False
        self.done = False  # nothing more will be written in this direction

    def push(self, item: object, nbytes: int = 0) -> None:
        relay = self.conn.relay
        now = relay.loop.time()
        if relay.rate_bytes_per_s and nbytes:
            start = max(now, self.link_free_at)
            self.link_free_at = start + nbytes / relay.rate_bytes_per_s
            now = self.link_free_at
        due = now + relay.delay_s
        if relay.jitter_s:
            due += random.uniform(-relay.jitter_s, relay.jitter_s)
        due = max(due, self.last_due)
        self.last_due = due
        self.queue.append((due, item))
        self.queued_bytes += nbytes
        self._update_reading()
        self.schedule()

    def schedule(self) -> None:
        if (self.timer is None and self.queue and self.dst is not None
                and not self.conn.relay.blocked[self.name]):
            self.timer = self.conn.relay.loop.call_at(self.queue[0][0], self._flush)

    def _flush(self) -> None:
        self.timer = None
        loop = self.conn.relay.loop
        now = loop.time()
        chunks: list[bytes] = []
        marker = None
        while self.queue and self.queue[0][0] <= now:
            _, item = self.queue.popleft()
            if item is _EOF or item is _CLOSE:
                marker = item
                break
            chunks.append(item)
        dst = self.dst
        if chunks:
            n = sum(map(len, chunks))
            self.queued_bytes -= n
            self.conn.relay.bytes_forwarded[self.name] += n
            if dst is not None and not dst.is_closing() and not self.done:
                dst.writelines(chunks) if len(chunks) > 1 else dst.write(chunks[0])
        if marker is _EOF:
            self._deliver_eof()
        elif marker is _CLOSE:
            self.done = True
            self.queue.clear()
            self.conn.close(abort=self.conn.reset)
            return
        self._update_reading()
        self.schedule()

    def _deliver_eof(self) -> None:
        self.eof_delivered = True
        self.done = True
        dst = self.dst
        if dst is not None and not dst.is_closing():
            try:
                if dst.can_write_eof():
                    dst.write_eof()
                else:
                    dst.close()
            except OSError:  # the peer reset its side meanwhile: nothing left to half-close
                dst.close()
        self.conn.maybe_finished()

    def _update_reading(self) -> None:
        """Back-pressure: stop reading the source while too much is buffered downstream."""
        src = self.src
        if src is None or src.is_closing():
            return
        limit = self.conn.relay.max_buffer_bytes
        full = self.dst_blocked or self.queued_bytes >= limit or self.conn.relay.blocked[self.name]
        if full and not self.src_paused:
            self.src_paused = True
            src.pause_reading()
        elif not full and self.src_paused and self.queued_bytes < limit // 2:
            self.src_paused = False
            src.resume_reading()

    def set_dst_blocked(self, blocked: bool) -> None:
        self.dst_blocked = blocked
        self._update_reading()

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.queue.clear()
        self.done = True


class _Connection:
    """One accepted client socket and the upstream socket dialled for it."""

    def __init__(self, relay: "DelayRelay") -> None:
        self.relay = relay
        self.up = _Pipe(self, "up")  # client -> target
        self.down = _Pipe(self, "down")  # target -> client
        self.client: asyncio.Transport | None = None
        self.upstream: asyncio.Transport | None = None
        self.closed = False
        self.reset = False  # a side vanished with an error: reset the other one too

    def maybe_finished(self) -> None:
        if self.up.eof_delivered and self.down.eof_delivered:
            self.close(abort=False)

    def lost(self, pipe: _Pipe, exc: Exception | None) -> None:
        """A side's transport is gone; the other side learns of it ``delay`` later."""
        if self.closed:
            return
        if exc is not None:
            self.reset = True
        pipe.src = None
        pipe.push(_CLOSE)

    def close(self, abort: bool) -> None:
        if self.closed:
            return
        self.closed = True
        self.up.cancel()
        self.down.cancel()
        for t in (self.client, self.upstream):
            if t is not None and not t.is_closing():
                t.abort() if abort else t.close()
        self.relay.connections.discard(self)


class _Side(asyncio.Protocol):
    """Protocol for either socket of a connection; ``out`` is the pipe it feeds."""

    def __init__(self, conn: _Connection, out: _Pipe, back: _Pipe) -> None:
        self.conn = conn
        self.out = out  # bytes read here go into this pipe
        self.back = back  # this pipe writes to our transport

    def data_received(self, data: bytes) -> None:
        if not self.out.done:
            self.out.push(data, len(data))

    def eof_received(self) -> bool:
        if not self.out.done:
            self.out.push(_EOF)
        return True  # keep the transport open: the other direction may still carry data

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn.lost(self.out, exc)

    def pause_writing(self) -> None:
        self.back.set_dst_blocked(True)

    def resume_writing(self) -> None:
        self.back.set_dst_blocked(False)


class _ClientSide(_Side):
    def __init__(self, relay: "DelayRelay") -> None:
        conn = _Connection(relay)
        super().__init__(conn, conn.up, conn.down)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        conn = self.conn
        conn.client = transport
        conn.up.src = transport
        conn.down.dst = transport
        conn.relay.connections.add(conn)
        conn.relay.connections_accepted += 1
        transport.set_write_buffer_limits(high=256 * 1024)
        transport.pause_reading()  # until the upstream socket exists
        self.out.src_paused = True
        conn.relay.loop.create_task(self._dial())

    async def _dial(self) -> None:
        conn = self.conn
        relay = conn.relay
        host, port = relay.target
        await relay.link_up.wait()  # a partition holds the dial, as a dropped SYN would
        if conn.closed:
            return
        try:
            transport, _ = await relay.loop.create_connection(
                lambda: _Side(conn, conn.down, conn.up), host, port)
        except OSError as e:
            log.warning("relay %s -> %s:%d: connect failed: %s", relay.listen_repr, host, port, e)
            conn.reset = True
            conn.close(abort=True)
            return
        if conn.closed:
            transport.abort()
            return
        assert isinstance(transport, asyncio.Transport)
        transport.set_write_buffer_limits(high=256 * 1024)
        conn.upstream = transport
        conn.up.dst = transport
        conn.down.src = transport
        conn.up.src_paused = False
        if conn.client is not None and not conn.client.is_closing():
            conn.client.resume_reading()
        conn.up.schedule()


class DelayRelay:
    """Forwards TCP connections from ``listen`` to ``target`` with ``delay_ms`` each way.

    ``listen`` and ``target`` are ``"host:port"`` strings or ``(host, port)`` tuples; a
    listen port of 0 picks a free port, which ``start()`` returns. ``rate_mbit`` (megabits
    per second, per direction, per connection) caps bandwidth; ``jitter_ms`` adds uniform
    jitter without reordering. ``netns`` names a network namespace (``ip netns``) that the
    relay's sockets live in.
    """

    def __init__(self, listen: str | Address, target: str | Address, delay_ms: float, *,
                 jitter_ms: float = 0.0, rate_mbit: float | None = None,
                 max_buffer_bytes: int = DEFAULT_MAX_BUFFER_BYTES,
                 netns: str | None = None) -> None:
        if delay_ms < 0:
            raise ValueError(f"delay_ms ({delay_ms}) must be >= 0")
        if jitter_ms < 0 or jitter_ms > delay_ms:
            raise ValueError(f"jitter_ms ({jitter_ms}) must be in [0, delay_ms={delay_ms}]")
        if rate_mbit is not None and rate_mbit <= 0:
            raise ValueError(f"rate_mbit ({rate_mbit}) must be positive")
        if max_buffer_bytes < 64 * 1024:
            raise ValueError(f"max_buffer_bytes ({max_buffer_bytes}) must be >= 65536")
        self.listen = parse_address(listen)
        self.target = parse_address(target)
        self.delay_s = delay_ms / 1000.0
        self.jitter_s = jitter_ms / 1000.0
        self.rate_bytes_per_s = rate_mbit * 1e6 / 8 if rate_mbit else 0.0
        self.max_buffer_bytes = max_buffer_bytes
        self.netns = netns
        self.connections: set[_Connection] = set()
        self.connections_accepted = 0
        self.bytes_forwarded = {"up": 0, "down": 0}
        self.blocked = {"up": False, "down": False}  # a cut link, per direction
        self.link_up: asyncio.Event = None  # type: ignore[assignment]  # made on the loop
        self.port: int | None = None
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def listen_repr(self) -> str:
        return f"{self.listen[0]}:{self.port if self.port is not None else self.listen[1]}"

    @property
    def address(self) -> str:
        """``host:port`` to dial (valid after ``start()``)."""
        return self.listen_repr

    def stats(self) -> dict:
        return {"connections_open": len(self.connections),
                "connections_accepted": self.connections_accepted,
                "bytes_up": self.bytes_forwarded["up"],
                "bytes_down": self.bytes_forwarded["down"]}

    async def _open(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.link_up = asyncio.Event()
        self.link_up.set()
        host, port = self.listen
        self._server = await self.loop.create_server(
            lambda: _ClientSide(self), host, port, reuse_address=True, backlog=256)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("relay %s -> %s:%d, %.1f ms each way", self.listen_repr, *self.target,
                 self.delay_s * 1000)

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.close(abort=True)
        if self._server is not None:
            await self._server.wait_closed()
        for _ in range(3):  # let aborted transports run connection_lost and free their fds
            await asyncio.sleep(0)

    def _run(self) -> None:
        try:
            if self.netns:
                from amprl_testing.netsim.netns import enter_netns
                enter_netns(self.netns)  # this thread only
            loop = asyncio.new_event_loop()
            self.loop = loop
            loop.run_until_complete(self._open())
        except BaseException as e:  # reported by start()
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            loop.run_forever()
            loop.run_until_complete(self._close())
        finally:
            loop.close()

    def start(self, timeout_s: float = 10.0) -> int:
        """Starts the relay on a daemon thread and returns the bound port."""
        if self._thread is not None:
            raise RuntimeError("relay already started")
        self._thread = threading.Thread(target=self._run, name=f"delay-relay-{self.listen[1]}",
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"relay on {self.listen_repr} did not start in {timeout_s} s")
        if self._error is not None:
            raise self._error
        assert self.port is not None
        return self.port

    def stop(self, timeout_s: float = 5.0) -> None:
        """Closes the listener and every connection (reset), then joins the thread."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        thread.join(timeout_s)

    def set_partitioned(self, partitioned: bool, direction: str = "both",
                        timeout_s: float = 5.0) -> None:
        """Cuts the link (True) or heals it (False) for every connection: both ways, or only
        ``"up"`` (client to target) or ``"down"`` (replies: a one-way partition, where
        requests arrive and are acted on but their answers do not come back).

        Cut, the relay moves nothing that way: what is sent stays queued here or in socket
        buffers (as TCP keeps unacknowledged bytes for retransmission), closes are held
        too, and a new connection is accepted but not dialled onward (its handshake needs
        both ways), so only keepalives and deadlines can tell the peers that the other side
        is gone. Healed, what was held is delivered in order, as retransmission would.
        """
        if direction not in ("both", "up", "down"):
            raise ValueError(f"direction {direction!r}: one of both, up, down")
        done = threading.Event()

        def apply() -> None:
            for name in (("up", "down") if direction == "both" else (direction,)):
                self.blocked[name] = partitioned
            if any(self.blocked.values()):
                self.link_up.clear()
            else:
                self.link_up.set()
            for conn in list(self.connections):
                for pipe in (conn.up, conn.down):
                    if self.blocked[pipe.name] and pipe.timer is not None:
                        pipe.timer.cancel()
                        pipe.timer = None
                    pipe._update_reading()
                    pipe.schedule()
            done.set()

        self.loop.call_soon_threadsafe(apply)
        if not done.wait(timeout_s):
            raise TimeoutError(f"relay on {self.listen_repr} did not {'cut' if partitioned else 'heal'} "
                               f"the link in {timeout_s} s")

    def reset_connections(self, timeout_s: float = 5.0) -> int:
        """Resets (RST) every open connection on both sides, dropping what is queued: a
        middlebox forgetting its flows, or replies lost for good. Returns how many."""
        done = threading.Event()
        count = []

        def apply() -> None:
            conns = list(self.connections)
            for conn in conns:
                conn.close(abort=True)
            count.append(len(conns))
            done.set()

        self.loop.call_soon_threadsafe(apply)
        if not done.wait(timeout_s):
            raise TimeoutError(f"relay on {self.listen_repr} did not reset in {timeout_s} s")
        return count[0]

    @contextlib.contextmanager
    def cut(self, direction: str = "both") -> Iterator[None]:
        """``set_partitioned(True, direction)`` for the duration of the block, healed on
        the way out."""
        self.set_partitioned(True, direction)
        try:
            yield
        finally:
            self.set_partitioned(False, direction)

    def __enter__(self) -> "DelayRelay":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m amprl_testing.netsim.relay",
                                description="TCP relay adding a fixed delay to each direction.")
    p.add_argument("--listen", required=True, help="host:port to accept on (port 0 = any)")
    p.add_argument("--target", required=True, help="host:port to forward each connection to")
    p.add_argument("--delay-ms", type=float, required=True, help="one-way delay, milliseconds")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="uniform jitter, milliseconds")
    p.add_argument("--rate-mbit", type=float, default=None,
                   help="bandwidth cap per direction and connection, Mbit/s")
    p.add_argument("--max-buffer-bytes", type=int, default=DEFAULT_MAX_BUFFER_BYTES)
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--port-file", default="",
                   help="also write the listening port here, as the AMP-RL services do")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s relay: %(message)s")
    try:
        relay = DelayRelay(args.listen, args.target, args.delay_ms, jitter_ms=args.jitter_ms,
                           rate_mbit=args.rate_mbit, max_buffer_bytes=args.max_buffer_bytes)
    except ValueError as e:
        p.error(str(e))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        port = relay.start()
    except OSError as e:
        log.error("cannot listen on %s: %s", args.listen, e)
        return 1
    print(json.dumps({"event": "listening", "host": relay.listen[0], "port": port}), flush=True)
    if args.port_file:
        from amprl.common.cli import write_port_file
        write_port_file(args.port_file, port)
    while not stop.wait(3600):
        pass
    log.info("stopping: %s", json.dumps(relay.stats()))
    relay.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
