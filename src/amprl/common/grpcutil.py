"""Shared gRPC plumbing of the servers: health and reflection, TLS, message limits, and
the mapping of ``amprl.errors`` onto canonical status codes (the client side, channels
with retries and mapped errors, is ``amprl.common.channels``).

Every AMP-RL server is built by ``create_server`` so that ``grpcurl`` can list and call
it (server reflection) and Kubernetes probes can ask ``grpc.health.v1.Health``.

TLS is switched on for a whole deployment by the environment, so every server and client
of a release agree without a flag on each:

  AMPRL_TLS_CERT_DIR     folder with tls.crt, tls.key (this process's key pair, served by
                         every server it starts) and ca.crt (what its clients trust)
  AMPRL_TLS_SERVER_NAME  the name the servers' certificate carries; clients check it in
                         place of the host they dial (grpc.ssl_target_name_override), so one
                         certificate serves every Service DNS name of the release
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
from concurrent import futures
from pathlib import Path
from typing import Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from amprl import errors
from amprl.common import inbound

log = logging.getLogger(__name__)

# Messages up to 64 MiB: one Atari sample batch of 512 compressed stacks fits easily; a
# larger message is RESOURCE_EXHAUSTED, which gRPC itself enforces on receive.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024

SERVER_KEEPALIVE = [
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
]
"""What every server accepts of its clients' keepalive pings (one per 10 s, no strikes)."""


LIVENESS = "liveness"
"""Health service name every server reports SERVING while it answers at all (liveness and
startup probes ask it); "" and the services' own names may go NOT_SERVING while a
dependency is down (readiness)."""

TLS_CERT_DIR_ENV = "AMPRL_TLS_CERT_DIR"
TLS_SERVER_NAME_ENV = "AMPRL_TLS_SERVER_NAME"


def tls_cert_dir() -> Path | None:
    """The folder named by AMPRL_TLS_CERT_DIR, or None when TLS is off."""
    value = os.environ.get(TLS_CERT_DIR_ENV, "")
    return Path(value) if value else None


def _read_tls_file(cert_dir: Path, name: str) -> bytes:
    path = cert_dir / name
    try:
        return path.read_bytes()
    except OSError as exc:
        raise errors.ConfigError(f"{TLS_CERT_DIR_ENV}={cert_dir}: cannot read {name} ({exc.strerror}); "
                                 f"the folder needs tls.crt, tls.key and ca.crt") from None


def server_credentials() -> grpc.ServerCredentials | None:
    """The key pair in AMPRL_TLS_CERT_DIR as server credentials; None when TLS is off."""
    cert_dir = tls_cert_dir()
    if cert_dir is None:
        return None
    return grpc.ssl_server_credentials([(_read_tls_file(cert_dir, "tls.key"),
                                         _read_tls_file(cert_dir, "tls.crt"))])


def channel_credentials(server_name: str | None = None
                        ) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, str]]]:
    """(credentials trusting ca.crt, channel options) when TLS is on, else (None, []).

    ``server_name`` (default: AMPRL_TLS_SERVER_NAME) is the certificate name to expect
    instead of the dialled host; empty means the dialled host itself.
    """
    cert_dir = tls_cert_dir()
    if cert_dir is None:
        return None, []
    creds = grpc.ssl_channel_credentials(root_certificates=_read_tls_file(cert_dir, "ca.crt"))
    name = os.environ.get(TLS_SERVER_NAME_ENV, "") if server_name is None else server_name
    return creds, ([("grpc.ssl_target_name_override", name)] if name else [])


def message_limits(max_message_bytes: int) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes)]


def create_server(register: Iterable[tuple[Callable, object, str]], *, host: str = "0.0.0.0",
                  port: int = 0, max_workers: int = 16,
                  max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                  serving: bool = True) -> tuple[grpc.Server, int]:
    """Builds a server hosting the given servicers plus health and reflection.

    ``register`` holds ``(add_XServicer_to_server, servicer, full_service_name)`` triples.
    Returns the started server and the bound port (useful with ``port=0``). With
    AMPRL_TLS_CERT_DIR set the port speaks TLS only, with that folder's key pair. Health
    reports every service SERVING from the start, or NOT_SERVING with ``serving=False``
    (the caller sets it when the server is ready).
    """
    creds = server_credentials()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                         interceptors=[inbound.DecodeGuard()],
                         options=message_limits(max_message_bytes) + SERVER_KEEPALIVE)
    names = []
    for add, servicer, name in register:
        add(servicer, server)
        names.append(name)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in names + [""]:
        health_servicer.set(name, status)
    health_servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME], server)
    bound = (server.add_secure_port(f"{host}:{port}", creds) if creds is not None
             else server.add_insecure_port(f"{host}:{port}"))
    if bound == 0:
        raise OSError(f"could not bind {host}:{port}")
    server.start()
    server.health_servicer = health_servicer  # type: ignore[attr-defined]
    server.service_names = names  # type: ignore[attr-defined]
    return server, bound


def set_health(server: grpc.Server, *, serving: bool) -> None:
    """Readiness of a server from ``create_server``: the whole server ("") and each of its
    services SERVING or NOT_SERVING (``LIVENESS`` is left SERVING). Ignored once the
    server has entered its graceful shutdown."""
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in [*server.service_names, ""]:  # type: ignore[attr-defined]  # create_server's
        server.health_servicer.set(name, status)  # type: ignore[attr-defined]


_CODES = [
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
]


def status_of(exc: Exception) -> tuple[grpc.StatusCode, tuple[tuple[str, str], ...]]:
    """The status code an exception becomes at the gRPC boundary, and trailing metadata
    (a stale push's ``amprl-current-version``): INTERNAL for anything not in amprl.errors."""
    for cls, code in _CODES:
        if isinstance(exc, cls):
            if isinstance(exc, errors.FailedPrecondition) and exc.current_version is not None:
                return code, (("amprl-current-version", str(exc.current_version)),)
            return code, ()
    return grpc.StatusCode.INTERNAL, ()


def internal_error(rpc: str) -> str:
    """Logs the exception being handled with a new incident id and returns the INTERNAL
    reply's message, which names the id and nothing of the exception."""
    incident = secrets.token_hex(4)
    log.exception("internal error %s in %s", incident, rpc)
    return f"internal error {incident} in {rpc}: a bug on the server, not your request; its log has the details"


def map_errors(method):
    """Servicer-method decorator: turns ``amprl.errors`` into canonical status codes.

    Any other exception is logged with its traceback and becomes INTERNAL, so a bug never
    takes the server down and the caller sees a status instead of a hang. The INTERNAL
    reply carries no exception text (internals stay in the log), only an incident id that
    names the log line (``internal_error``). Works for unary
    and server-streaming methods (generators) of a synchronous server; ``map_errors_async``
    is the same for coroutine methods of a ``grpc.aio`` server.
    """
    def _abort(context, exc):
        code, trailing = status_of(exc)
        if code == grpc.StatusCode.INTERNAL:
            context.abort(code, internal_error(method.__name__))
        if trailing:
            context.set_trailing_metadata(trailing)
        context.abort(code, str(exc))

    if _is_generator(method):
        @functools.wraps(method)
        def gen_wrapper(self, request, context):
            try:
                yield from method(self, request, context)
            except errors.AmprlError as exc:
                _abort(context, exc)
            except Exception as exc:  # noqa: BLE001 - reported as INTERNAL
                if isinstance(exc, grpc.RpcError) or context.code() is not None:
                    raise
                _abort(context, exc)
        return gen_wrapper

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except errors.AmprlError as exc:
            _abort(context, exc)
        except Exception as exc:  # noqa: BLE001 - reported as INTERNAL
            if context.code() is not None:  # already aborted by the method itself
                raise
            _abort(context, exc)
    return wrapper


def map_errors_async(method):
    """``map_errors`` for the coroutine methods (unary or stream-unary) of a ``grpc.aio``
    servicer."""
    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise  # the method aborted on its own
        except Exception as exc:  # noqa: BLE001 - AmprlError mapped, the rest INTERNAL
            code, trailing = status_of(exc)
            if code == grpc.StatusCode.INTERNAL:
                await context.abort(code, internal_error(method.__name__))
            if trailing:
                context.set_trailing_metadata(trailing)
            await context.abort(code, str(exc))
    return wrapper


def _is_generator(fn) -> bool:
    import inspect
    return inspect.isgeneratorfunction(fn)
