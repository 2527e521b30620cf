"""What every server checks of a request before its servicer reads it: that its bytes parse,
and that the ids a client names itself by are short.

A request that does not parse (random bytes, a string field that is not UTF-8, another
message type) is the caller's mistake, but grpc-python answers it with INTERNAL (a
synchronous server) or UNKNOWN (``grpc.aio``) and a traceback in the server's log.
``DecodeGuard`` and ``AsyncDecodeGuard`` are the server interceptors every AMP-RL server is
built with (``grpcutil.create_server``, ``aioserver.AioServer``); they swap each method's
request parser for one that does not raise, so that:

- a unary request that does not parse reaches the method as ``Undecodable`` and the call
  ends with INVALID_ARGUMENT before the servicer sees it;
- a message of a request stream (``grpc.aio``: replay's Insert) that does not parse raises
  ``errors.InvalidArgument`` in the servicer's loop over the stream, which answers it as
  any other bad chunk (``map_errors_async``; the chunks before it are kept).

Request streams of a synchronous server (only server reflection has one) stay as grpc
has them.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, NamedTuple

import grpc

from amprl import errors

MAX_ID_CHARS = 512
"""Longest id a client may name itself by (actor_id, learner_id, client_id): a Kubernetes
pod name (at most 253 characters) with a role prefix fits. Servers remember ids (live
clients, replay's senders, in Redis too), so a megabyte id would cost a megabyte each."""


def check_id(field: str, value: str) -> str:
    """``value`` if it is at most ``MAX_ID_CHARS`` long; InvalidArgument naming ``field``
    otherwise."""
    if len(value) > MAX_ID_CHARS:
        raise errors.InvalidArgument(f"{field}: {len(value)} characters, at most {MAX_ID_CHARS} "
                                     f"allowed; name the client by its pod name or role "
                                     f"(\"actor-3\")")
    return value


class Undecodable(NamedTuple):
    """Stands for a request that did not parse."""

    message: str
    """Why, for the caller."""


def _why(data: bytes, exc: Exception) -> str:
    # protobuf's DecodeError names the message type and what was wrong with the bytes
    return (f"the request does not parse ({exc}; {len(data)} bytes); send the RPC's request "
            f"message, serialized, from a client built from the same protos/amprl/v1")


def _lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse_or_undecodable(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as exc:  # noqa: BLE001 - whatever the parser refuses the bytes with
            return Undecodable(_why(data, exc))
    return parse_or_undecodable


def _strict(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse_or_invalid(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as exc:  # noqa: BLE001 - whatever the parser refuses the bytes with
            raise errors.InvalidArgument(_why(data, exc)) from None
    return parse_or_invalid


def _behaviour(handler: grpc.RpcMethodHandler) -> str:
    """The name of the handler's field that holds its method (a unary request's)."""
    return "unary_stream" if handler.response_streaming else "unary_unary"


def _guard(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
    """``handler`` (of a synchronous server) answering INVALID_ARGUMENT to a unary request
    that does not parse."""
    if handler is None or handler.request_deserializer is None or handler.request_streaming:
        return handler
    field = _behaviour(handler)
    method = getattr(handler, field)

    def guarded(request, context):
        if isinstance(request, Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return method(request, context)

    return handler._replace(request_deserializer=_lenient(handler.request_deserializer),  # type: ignore[attr-defined]
                            **{field: guarded})


def _guard_async(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
    """``_guard`` for a ``grpc.aio`` server, whose methods are coroutines or async
    generators; a request stream's messages that do not parse raise InvalidArgument."""
    if handler is None or handler.request_deserializer is None:
        return handler
    if handler.request_streaming:
        return handler._replace(request_deserializer=_strict(handler.request_deserializer))  # type: ignore[attr-defined]
    field = _behaviour(handler)
    method = getattr(handler, field)
    if inspect.isasyncgenfunction(method):
        async def guarded_stream(request, context):
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            async for reply in method(request, context):
                yield reply
        guarded: Callable = guarded_stream
    elif inspect.iscoroutinefunction(method):
        async def guarded_unary(request, context):
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return await method(request, context)
        guarded = guarded_unary
    else:
        return handler  # a plain function, which grpc.aio runs on a thread: left as it is
    return handler._replace(request_deserializer=_lenient(handler.request_deserializer),  # type: ignore[attr-defined]
                            **{field: guarded})


class _Guarded:
    """Each method's handler, guarded once: method -> (its handler, that handler guarded)."""

    def __init__(self, guard: Callable[[grpc.RpcMethodHandler], grpc.RpcMethodHandler | None]):
        self._guard = guard
        self._by_method: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler | None]] = {}

    def __call__(self, method: str, handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
        if handler is None:  # an unknown method: grpc answers UNIMPLEMENTED
            return None
        known = self._by_method.get(method)
        if known is None or known[0] is not handler:
            known = self._by_method[method] = (handler, self._guard(handler))
        return known[1]


class DecodeGuard(grpc.ServerInterceptor):
    """A synchronous server's interceptor: INVALID_ARGUMENT for unary requests that do not
    parse (module docstring)."""

    def __init__(self) -> None:
        self._guarded = _Guarded(_guard)

    def intercept_service(self, continuation, handler_call_details):
        return self._guarded(handler_call_details.method, continuation(handler_call_details))


class AsyncDecodeGuard(grpc.aio.ServerInterceptor):
    """``DecodeGuard`` for a ``grpc.aio`` server (module docstring)."""

    def __init__(self) -> None:
        self._guarded = _Guarded(_guard_async)

    async def intercept_service(self, continuation, handler_call_details):
        return self._guarded(handler_call_details.method, await continuation(handler_call_details))
