"""Client channels: keepalive, message limits, TLS, gRPC's own retries, and one interceptor
that turns every failed call into an ``amprl.errors`` exception.

Every AMP-RL client builds its channel with ``make_channel``, so client methods hold no
retry loops and no ``try`` blocks of their own:

- **Retries** are gRPC's per-method retry policy (a service config on the channel): the
  methods a client names as safe to repeat are retried on UNAVAILABLE with exponential
  backoff, within the call's deadline. Calls wait for the connection to be ready
  (``wait_for_ready``), so an attempt made while the server restarts waits for it rather
  than failing at once. gRPC retries an attempt only until the reply's headers arrive: a
  stream cut off mid-way fails and its caller decides.
- **Errors**: a failed call raises InvalidArgument, FailedPrecondition (with the server's
  ``amprl-current-version``), NotFound, ResourceExhausted, DeadlineExceeded or Unavailable; a call
  the server cancelled (it went away) is Unavailable; a call this client cancelled keeps
  gRPC's own CANCELLED error, so its caller can tell the two apart. The mapping happens
  where the error surfaces: at the call, at a future's ``result()``, or in a stream's
  iteration.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from amprl import errors
from amprl.common.grpcutil import DEFAULT_MAX_MESSAGE_BYTES, channel_credentials, message_limits

KEEPALIVE = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
"""A client pings its server every 20 s, calls open or not, and drops a connection whose
pings go unanswered for 10 s (a dead peer or a cut link is noticed, not waited out)."""

RETRY_POLICY = {
    "maxAttempts": 5,  # gRPC's own cap
    "initialBackoff": "0.1s",
    "maxBackoff": "2s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}
"""What a retried method does on UNAVAILABLE: up to 4 more attempts, 0.1 s to 2 s apart
(with gRPC's jitter), all within the call's deadline."""


def mapped(exc: grpc.RpcError) -> Exception:
    """The ``amprl.errors`` exception a failed call stands for (``exc`` itself for codes
    that have none, e.g. UNIMPLEMENTED or INTERNAL: a bug, reported as it came)."""
    code = exc.code() if hasattr(exc, "code") else None
    details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return errors.InvalidArgument(details)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        version = None
        # types-grpcio types each entry as an object without iteration; it is a (key, value) tuple
        trailing: tuple[tuple[str, str | bytes], ...] = (
            exc.trailing_metadata() or ())  # type: ignore[assignment]
        for key, value in trailing:
            if key == "amprl-current-version":
                version = int(value)
        return errors.FailedPrecondition(details, current_version=version)
    if code == grpc.StatusCode.NOT_FOUND:
        return errors.NotFound(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return errors.ResourceExhausted(details)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return errors.DeadlineExceeded(details)
    if code == grpc.StatusCode.UNAVAILABLE:
        return errors.Unavailable(details)
    if code == grpc.StatusCode.CANCELLED:
        # one this client did not cancel: the server went away (a restart, a SIGTERM past
        # its grace), as retryable as a connection that could not be made
        return errors.Unavailable(f"the server cancelled the call (shutting down?): {details}")
    return exc


def _raise_mapped(exc: grpc.RpcError, cancelled: bool):
    if cancelled and exc.code() == grpc.StatusCode.CANCELLED:
        raise exc  # cancelled here: the caller knows
    error = mapped(exc)
    if error is exc:
        raise exc
    raise error from exc


class _MappedCall:
    """A unary call's outcome (a grpc.Call and grpc.Future) whose errors come out mapped."""

    def __init__(self, inner: Any):
        self._inner = inner
        self._cancelled = False

    def result(self, timeout: float | None = None) -> Any:
        try:
            return self._inner.result(timeout)
        except grpc.RpcError as exc:
            _raise_mapped(exc, self._cancelled)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        exc = self._inner.exception(timeout)
        if isinstance(exc, grpc.RpcError) and not (self._cancelled and exc.code() == grpc.StatusCode.CANCELLED):
            return mapped(exc)
        return exc

    def cancel(self) -> bool:
        self._cancelled = True
        return self._inner.cancel()

    def add_done_callback(self, fn) -> None:
        self._inner.add_done_callback(lambda _: fn(self))

    def __getattr__(self, name: str) -> Any:  # done, running, code, details, trailing_metadata, ...
        return getattr(self._inner, name)


class _MappedStream:
    """A server stream whose errors come out mapped while iterating."""

    def __init__(self, inner: Any):
        self._inner = inner
        self._cancelled = False

    def __iter__(self) -> "_MappedStream":
        return self

    def __next__(self) -> Any:
        try:
            return next(self._inner)
        except grpc.RpcError as exc:
            _raise_mapped(exc, self._cancelled)

    def cancel(self) -> bool:
        self._cancelled = True
        return self._inner.cancel()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class ErrorMapping(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor):
    """The one place where failed calls become ``amprl.errors`` (module docstring)."""

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return _MappedCall(continuation(client_call_details, request))

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return _MappedCall(continuation(client_call_details, request_iterator))

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return _MappedStream(continuation(client_call_details, request))


def service_config(retry: Iterable[str]) -> str:
    """A channel service config retrying the methods ``retry`` ("pkg.Service/Method")."""
    names = [{"service": m.split("/")[0], "method": m.split("/")[1]} for m in retry]
    return json.dumps({"methodConfig": [{"name": names, "retryPolicy": RETRY_POLICY}]})


def make_channel(address: str, *, server_role: str | None = None, retry: Iterable[str] = (),
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> grpc.Channel:
    """A channel to ``address`` with keepalive, message limits, gRPC retries of the methods
    in ``retry`` ("amprl.v1.ParameterService/PushGradients", ...) and mapped errors.

    Mutual TLS when AMPRL_TLS_CERT_DIR is set (this process's certificate presented, the
    server's checked to be of ``server_role``: "paramserver", "replay", ...), plaintext
    otherwise; ``grpcutil.channel_credentials`` has the rules.
    """
    retry = list(retry)
    options: list[tuple[str, Any]] = message_limits(max_message_bytes) + KEEPALIVE + [
        ("grpc.enable_retries", 1),
        # a request is kept for a retry only while it fits these buffers (a push of a
        # whole fp32 gradient must, or it would be sent once only)
        ("grpc.per_rpc_retry_buffer_size", max_message_bytes),
        ("grpc.retry_buffer_size", 4 * max_message_bytes),
    ]
    if retry:
        options.append(("grpc.service_config", service_config(retry)))
    creds, tls_options = channel_credentials(server_role)
    channel = (grpc.secure_channel(address, creds, options=options + tls_options) if creds is not None
               else grpc.insecure_channel(address, options=options))
    return grpc.intercept_channel(channel, ErrorMapping())


def wait_until_serving(address: str, timeout_s: float = 30.0, *, server_role: str | None = None) -> None:
    """Blocks until the server at ``address`` (of ``server_role``, which TLS needs) answers
    its health check with SERVING."""
    import time
    deadline = time.monotonic() + timeout_s
    with make_channel(address, server_role=server_role) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                # types-grpcio-health-checking's HealthStub lacks the generated methods
                r = stub.Check(  # type: ignore[attr-defined]
                    health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except (errors.AmprlError, grpc.RpcError):
                pass  # not up yet
            if time.monotonic() > deadline:
                raise errors.Unavailable(f"{address} not serving after {timeout_s:.0f}s")
            time.sleep(0.05)
