"""A ``grpc.aio`` server on an event loop of its own, started and stopped from plain code.

For services where waiting must be an event, not a thread (replay: rate-limited inserts,
idle streams, samples waiting for the minimum size): a waiting call is a suspended
coroutine, so hundreds of them hold no worker that health, Info or a Sample needs. The
servicer's coroutines run on the loop; its blocking work goes to thread pools it owns.

    server = AioServer.start([(add_XServicer_to_server, servicer, "amprl.v1.X")], port=0)
    server.port                      # the bound port
    server.call(servicer.refresh())  # run a coroutine on the server's loop, wait for it
    server.stop(grace_s=5)           # NOT_SERVING, drain, stop, close the loop

Like ``grpcutil.create_server`` it adds health (``grpc.health.v1``, every service SERVING
once started) and server reflection, and speaks mutual TLS, authorizing each call by its caller's role, when
AMPRL_TLS_CERT_DIR is set; every call is timed and counted for ``/metrics``
(``amprl.common.rpcmetrics``). The
server pings every connection (keepalive) and drops one whose peer stops answering, so the
calls of a dead client are ended and their slots freed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Awaitable, Callable, Coroutine, Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from amprl.common import authz, grpcutil, inbound, rpcmetrics

log = logging.getLogger(__name__)


def keepalive_options(keepalive_s: float) -> list[tuple[str, int]]:
    """Server options that ping each connection every ``keepalive_s`` and close it when a
    ping is not answered within ``keepalive_s / 2``, with or without calls open."""
    timeout_ms = max(1, int(keepalive_s * 500))
    return [
        ("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        # what times an unanswered ping out in grpcio 1.85's core: with keepalive_timeout_ms
        # alone, a SIGSTOPped peer's connection was still open 20 s later
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


class AioServer:
    """A started ``grpc.aio`` server, its loop thread and its health service."""

    def __init__(self, loop: asyncio.AbstractEventLoop, thread: threading.Thread):
        self.loop = loop
        self._thread = thread
        self.server: grpc.aio.Server | None = None
        self.health: health_aio.HealthServicer | None = None
        self.port = 0
        self._names: list[str] = []
        self._on_stop: list[Callable[[], Awaitable[None]]] = []
        self._stopped = threading.Event()

    @classmethod
    def start(cls, register: Iterable[tuple[Callable, object, str]], *, host: str = "0.0.0.0",
              port: int = 0, max_message_bytes: int = grpcutil.DEFAULT_MAX_MESSAGE_BYTES,
              keepalive_s: float = 20.0,
              on_stop: Iterable[Callable[[], Awaitable[None]]] = ()) -> "AioServer":
        """Starts the loop thread and a server hosting ``register``'s
        ``(add_XServicer_to_server, servicer, full_service_name)`` triples plus health and
        reflection on ``host:port`` (0 = any free port). ``on_stop`` coroutines run on the
        loop after the server has stopped (closing the servicers' pools and tasks)."""
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="grpc-aio-loop", daemon=True)
        thread.start()
        self = cls(loop, thread)
        self._on_stop = list(on_stop)
        try:
            self.call(self._start(list(register), host, port, max_message_bytes, keepalive_s))
        except BaseException:
            self._close_loop()
            raise
        return self

    async def _start(self, register, host, port, max_message_bytes, keepalive_s) -> None:
        creds = grpcutil.server_credentials()
        guards: list[grpc.aio.ServerInterceptor] = [inbound.AsyncDecodeGuard()]
        if creds is not None:
            guards.insert(0, authz.AsyncAuthorize(grpcutil.own_identity()[0]))
        # outermost: every call timed and counted, those refused by the guards too
        server = grpc.aio.server(interceptors=[rpcmetrics.AsyncObserveCalls(), *guards],
                                 options=grpcutil.message_limits(max_message_bytes)
                                 + grpcutil.SERVER_KEEPALIVE + keepalive_options(keepalive_s))
        for add, servicer, name in register:
            add(servicer, server)
            self._names.append(name)
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            self._names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                           reflection.SERVICE_NAME], server)
        bound = (server.add_secure_port(f"{host}:{port}", creds) if creds is not None
                 else server.add_insecure_port(f"{host}:{port}"))
        if bound == 0:
            raise OSError(f"could not bind {host}:{port}")
        await server.start()
        for name in self._names + ["", grpcutil.LIVENESS]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.server, self.port = server, bound

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        """Runs ``coro`` on the server's loop and returns its result (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    # -- the grpc.Server face that bootstrap.ServiceProcess uses ---------------------------

    @property
    def health_servicer(self) -> "AioServer":
        return self

    def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING from now on (the start of a drain)."""
        if self.health is not None and not self._stopped.is_set():
            self.call(self.health.enter_graceful_shutdown())

    def stop(self, grace: float | None = None) -> threading.Event:
        """Stops serving (open calls get ``grace`` seconds), runs the ``on_stop`` hooks and
        ends the loop thread; returns an already-set Event (``stop(g).wait()`` as with a
        ``grpc.Server``). Safe to call twice."""
        if not self._stopped.is_set():
            try:
                if self.server is not None:
                    self.call(self._stop(grace))
            finally:
                self._close_loop()
        return self._stopped

    async def _stop(self, grace: float | None) -> None:
        assert self.server is not None
        if self.health is not None:
            await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        for hook in self._on_stop:
            try:
                await hook()
            except Exception:  # noqa: BLE001 - stopping goes on
                log.exception("error while stopping the server")

    def _close_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()
        self._stopped.set()
