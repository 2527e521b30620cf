"""Per-RPC latency and status codes of every server in this process, for ``/metrics``.

``ObserveCalls`` (synchronous servers) and ``AsyncObserveCalls`` (``grpc.aio``) are the
outermost interceptors of every AMP-RL server (``grpcutil.server_interceptors``,
``aioserver.AioServer``), so a call refused by an interceptor inside them (authorization's
PERMISSION_DENIED, the decode guard's INVALID_ARGUMENT) is counted with its code too. The
series carry the names most gRPC dashboards already use (go-grpc-prometheus):

  grpc_server_handled_total{grpc_type, grpc_service, grpc_method, grpc_code}
  grpc_server_handling_seconds{grpc_type, grpc_service, grpc_method}   (a histogram)

A streaming call is timed from its start to its end (a replay Insert stream or a
WatchParameters stream for its whole life), so read those methods' latency as stream
lifetimes. A call to a method the server does not have (UNIMPLEMENTED) never reaches a
handler and is not counted.

The counts belong to the process (``RPC_METRICS``), not to one server: every port of it
(the parameter server's pull port too) adds to the same series, which its ``/metrics``
serves (``amprl.common.metrics``).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Callable, Iterator

import grpc
from prometheus_client import Counter, Histogram
from prometheus_client.registry import Collector

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
"""Histogram buckets: from a sub-millisecond Info or priority update to a rate-limited
Sample (seconds) and a stream's life (minutes)."""


class RpcMetrics(Collector):
    """The two series of the module docstring; a prometheus_client collector."""

    def __init__(self) -> None:
        labels = ["grpc_type", "grpc_service", "grpc_method"]
        self.handled = Counter("grpc_server_handled", "RPCs completed on the server, by status code.",
                               labels + ["grpc_code"], registry=None)
        self.seconds = Histogram("grpc_server_handling_seconds",
                                 "Time from the start to the end of an RPC on the server (seconds).",
                                 labels, buckets=LATENCY_BUCKETS_S, registry=None)

    def observe(self, kind: str, method: str, code: grpc.StatusCode, seconds: float) -> None:
        """One finished call of ``method`` ("/package.Service/Method")."""
        _, service, name = method.split("/", 2) if method.count("/") >= 2 else ("", "", method)
        self.handled.labels(kind, service, name, code.name).inc()
        self.seconds.labels(kind, service, name).observe(seconds)

    def collect(self):
        yield from self.handled.collect()
        yield from self.seconds.collect()


RPC_METRICS = RpcMetrics()
"""This process's RPC series (module docstring)."""

_FIELDS = {(False, False): ("unary_unary", "unary"), (True, False): ("stream_unary", "client_stream"),
           (False, True): ("unary_stream", "server_stream"), (True, True): ("stream_stream", "bidi_stream")}


def _code(context: Any, exc: BaseException | None) -> grpc.StatusCode:
    """How a call ended: the code set on its context (``abort`` sets it before raising),
    else OK, or UNKNOWN for an exception, CANCELLED for a call that went away."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(code, int):  # grpc.aio answers the core's number
        return next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
    if exc is None:
        return grpc.StatusCode.OK
    if isinstance(exc, (GeneratorExit, asyncio.CancelledError)):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN


def _observed(handler: grpc.RpcMethodHandler | None, method: str,
              metrics: RpcMetrics) -> grpc.RpcMethodHandler | None:
    """``handler`` with its behaviour timed and its outcome counted."""
    if handler is None:
        return None
    field, kind = _FIELDS[(bool(handler.request_streaming), bool(handler.response_streaming))]
    behaviour = getattr(handler, field)

    def done(context: Any, exc: BaseException | None, start: float) -> None:
        metrics.observe(kind, method, _code(context, exc), time.perf_counter() - start)

    wrapped: Callable
    if inspect.isasyncgenfunction(behaviour):
        async def wrapped_async_stream(request, context):
            start, exc = time.perf_counter(), None
            try:
                async for reply in behaviour(request, context):
                    yield reply
            except BaseException as e:
                exc = e
                raise
            finally:
                done(context, exc, start)
        wrapped = wrapped_async_stream
    elif inspect.iscoroutinefunction(behaviour):
        async def wrapped_async(request, context):
            start, exc = time.perf_counter(), None
            try:
                return await behaviour(request, context)
            except BaseException as e:
                exc = e
                raise
            finally:
                done(context, exc, start)
        wrapped = wrapped_async
    elif handler.response_streaming:
        def wrapped_stream(request, context) -> Iterator:
            start, exc = time.perf_counter(), None
            try:
                yield from behaviour(request, context)
            except BaseException as e:
                exc = e
                raise
            finally:
                done(context, exc, start)
        wrapped = wrapped_stream
    else:
        def wrapped_unary(request, context):
            start, exc = time.perf_counter(), None
            try:
                return behaviour(request, context)
            except BaseException as e:
                exc = e
                raise
            finally:
                done(context, exc, start)
        wrapped = wrapped_unary
    return handler._replace(**{field: wrapped})  # type: ignore[attr-defined]


class _Observed:
    """Each method's handler, wrapped once: method -> (its handler, that handler wrapped)."""

    def __init__(self, metrics: RpcMetrics):
        self.metrics = metrics
        self._by_method: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler | None]] = {}

    def __call__(self, method: str, handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
        if handler is None:
            return None
        known = self._by_method.get(method)
        if known is None or known[0] is not handler:
            known = self._by_method[method] = (handler, _observed(handler, method, self.metrics))
        return known[1]


class ObserveCalls(grpc.ServerInterceptor):
    """A synchronous server's interceptor: every call timed and counted (module docstring)."""

    def __init__(self, metrics: RpcMetrics = RPC_METRICS):
        self._observed = _Observed(metrics)

    def intercept_service(self, continuation, handler_call_details):
        return self._observed(handler_call_details.method, continuation(handler_call_details))


class AsyncObserveCalls(grpc.aio.ServerInterceptor):
    """``ObserveCalls`` for a ``grpc.aio`` server."""

    def __init__(self, metrics: RpcMetrics = RPC_METRICS):
        self._observed = _Observed(metrics)

    async def intercept_service(self, continuation, handler_call_details):
        return self._observed(handler_call_details.method, await continuation(handler_call_details))
