"""Shared gRPC plumbing of the servers: health and reflection, TLS, message limits, and
the mapping of ``amprl.errors`` onto canonical status codes (the client side, channels
with retries and mapped errors, is ``amprl.common.channels``).

Every AMP-RL server is built by ``create_server`` so that ``grpcurl`` can list and call
it (server reflection) and Kubernetes probes can ask ``grpc.health.v1.Health``.

TLS is switched on for a whole deployment by the environment, so every server and client
of a release agree without a flag on each. TLS on is mutual TLS: servers require a client
certificate from the deployment's CA and authorize each RPC by the role it names
(``amprl.common.authz``); clients present their own and check the server's.

  AMPRL_TLS_CERT_DIR     folder with tls.crt, tls.key (this process's role certificate,
                         used as server and client certificate; ``amprl.common.certs``) and
                         ca.crt (the CA it trusts, for servers and clients alike)
  AMPRL_TLS_SERVER_NAME  the deployment's server name S (default "amprl"): a server of role
                         R carries the DNS SAN "R.S", and a client dialing a server of role
                         R expects that name in place of the host it dials
                         (grpc.ssl_target_name_override), so one certificate per role serves
                         every address of that role and no other role can stand in for it
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import threading
from concurrent import futures
from pathlib import Path
from typing import Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from amprl import errors
from amprl.common import authz, certs, inbound, rpcmetrics

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
                                 f"the folder needs tls.crt, tls.key and ca.crt of this process's "
                                 f"role (`amprl certs DIR` makes them)") from None


TLS_FILES = ("tls.key", "tls.crt", "ca.crt")


def read_tls_files(cert_dir: Path) -> tuple[bytes, bytes, bytes]:
    """(tls.key, tls.crt, ca.crt) of ``cert_dir``; ConfigError naming a missing one."""
    key, crt, ca = (_read_tls_file(cert_dir, name) for name in TLS_FILES)
    return key, crt, ca


class _RenewedCertificates:
    """The fetcher of ``grpc.dynamic_ssl_server_credentials``: gRPC calls it before each
    handshake; it returns a new configuration when the files in the folder have changed
    (cert-manager renewed the Secret, the kubelet swapped the mounted files), else None
    (keep the current one). Files read half-way through a swap, or a pair that does not
    load, keep the current configuration until the next handshake."""

    def __init__(self, cert_dir: Path, current: tuple[bytes, bytes, bytes]):
        self.cert_dir = cert_dir
        self.current = current
        self.lock = threading.Lock()

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        try:
            files = read_tls_files(self.cert_dir)
        except errors.ConfigError:
            return None
        with self.lock:
            if files == self.current or certs.role_of_pem(files[1]) is None:
                return None
            self.current = files
        log.info("TLS: the certificate in %s changed; new handshakes use it", self.cert_dir)
        key, crt, ca = files
        return grpc.ssl_server_certificate_configuration([(key, crt)], root_certificates=ca)


def server_credentials() -> grpc.ServerCredentials | None:
    """Mutual-TLS server credentials from AMPRL_TLS_CERT_DIR (this process's key pair; client
    certificates required and verified against ca.crt), re-read when the files change (a
    renewed certificate is used without a restart); None when TLS is off."""
    cert_dir = tls_cert_dir()
    if cert_dir is None:
        return None
    files = read_tls_files(cert_dir)
    key, crt, ca = files
    initial = grpc.ssl_server_certificate_configuration([(key, crt)], root_certificates=ca)
    # types-grpcio types the fetcher's result without None, which gRPC documents as "keep"
    return grpc.dynamic_ssl_server_credentials(
        initial, _RenewedCertificates(cert_dir, files),  # type: ignore[arg-type]
        require_client_authentication=True)


def server_interceptors() -> list[grpc.ServerInterceptor]:
    """What every synchronous server runs before its servicers, outermost first: the
    per-RPC latency and status counts (``rpcmetrics``, so that a refused call is counted
    too), with TLS on the per-RPC authorization, and the request decode guard."""
    guards: list[grpc.ServerInterceptor] = [inbound.DecodeGuard()]
    if tls_cert_dir() is not None:
        guards.insert(0, authz.Authorize(own_identity()[0]))
    return [rpcmetrics.ObserveCalls(), *guards]


def tls_server_name() -> str:
    """The deployment's server name (AMPRL_TLS_SERVER_NAME, default ``certs.DEFAULT_SERVER_NAME``)."""
    return os.environ.get(TLS_SERVER_NAME_ENV, "") or certs.DEFAULT_SERVER_NAME


def channel_credentials(server_role: str | None
                        ) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, str]]]:
    """(mutual-TLS credentials, channel options) when TLS is on, else (None, []).

    The channel presents this process's certificate, trusts ca.crt, and expects the server
    to be of ``server_role`` (its certificate's DNS SAN "<role>.<server name>")."""
    cert_dir = tls_cert_dir()
    if cert_dir is None:
        return None, []
    if server_role not in certs.ROLES:
        raise errors.ConfigError(f"with {TLS_CERT_DIR_ENV} set a client must name the role of the "
                                 f"server it dials (one of {', '.join(certs.ROLES)}), not {server_role!r}")
    key, crt, ca = read_tls_files(cert_dir)
    creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=crt)
    return creds, [("grpc.ssl_target_name_override", certs.server_name_of(server_role, tls_server_name()))]


def own_identity() -> tuple[str | None, str]:
    """(release, role) of this process's certificate (AMPRL_TLS_CERT_DIR/tls.crt); TLS must
    be on."""
    cert_dir = tls_cert_dir()
    if cert_dir is None:
        raise errors.ConfigError(f"{TLS_CERT_DIR_ENV} is not set")
    return certs.identity_of_file(cert_dir / "tls.crt")


def own_role() -> str:
    """The role of this process's certificate; TLS must be on."""
    return own_identity()[1]


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
    AMPRL_TLS_CERT_DIR set the port speaks mutual TLS only, with that folder's key pair. Health
    reports every service SERVING from the start, or NOT_SERVING with ``serving=False``
    (the caller sets it when the server is ready). With TLS on, every call is authorized by
    its caller's role (``amprl.common.authz``).
    """
    creds = server_credentials()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                         interceptors=server_interceptors(),
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
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
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
