"""Who may call what, with mutual TLS on: each RPC's allowed roles, and the server
interceptors that enforce them.

With TLS on (AMPRL_TLS_CERT_DIR set) every server requires a client certificate signed by
the deployment's CA, so a caller without one never gets past the handshake. The
certificate names the caller's role and release (``amprl.common.certs``); ``POLICY`` says
which roles each RPC admits, and a server admits only callers of its own release. A caller
not admitted gets PERMISSION_DENIED with a message naming the role (or release) the RPC
needs, before the servicer or the request's payload is touched.

An RPC of the ``amprl.v1`` package that ``POLICY`` does not list is refused to everyone
(a new RPC is closed until someone decides who may call it; a test checks that every RPC
in ``protos/`` is listed). Health and server reflection are open to every authenticated
caller: probes and grpcurl need them.

With TLS off there are no identities and nothing here runs; the NetworkPolicy is then the
only guard (see docs/kubernetes.md's threat model).
"""

from __future__ import annotations

import inspect
from typing import Callable, Mapping

import grpc

from amprl.common.certs import ROLES, SPIFFE_PREFIX, identity_of_uri

EVERYONE = frozenset(ROLES)

POLICY: dict[str, frozenset[str]] = {
    # Only learners write weights, read batches and re-prioritize them.
    "/amprl.v1.ParameterService/PushGradients": frozenset({"learner"}),
    "/amprl.v1.ReplayService/Sample": frozenset({"learner"}),
    "/amprl.v1.ReplayService/UpdatePriorities": frozenset({"learner"}),
    # Only actors add experience.
    "/amprl.v1.ReplayService/Insert": frozenset({"actor"}),
    # Reads: weights for actors, the evaluator, followers and people; Info for everyone.
    "/amprl.v1.ParameterService/PullParameters": EVERYONE,
    "/amprl.v1.ParameterService/WatchParameters": EVERYONE,
    "/amprl.v1.ParameterService/Info": EVERYONE,
    "/amprl.v1.ReplayService/Info": EVERYONE,
    "/amprl.v1.LearnerService/Info": EVERYONE,
    "/amprl.v1.ActorService/Info": EVERYONE,
    "/amprl.v1.EvaluatorService/Info": EVERYONE,
    # The run's state: actors and learners poll it, people and the done Job wait on it.
    "/amprl.v1.EvaluatorService/GetRunState": EVERYONE,
    # The best weights: as readable as the weights a pull gives.
    "/amprl.v1.EvaluatorService/GetBestPolicy": EVERYONE,
}
"""Full method name -> the roles that may call it."""

OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
"""Methods any authenticated caller may use (probes, grpcurl)."""


def identity_of_peer(context: grpc.ServicerContext) -> tuple[str | None, str | None]:
    """(release, role) the caller's verified certificate names: from a URI SAN
    ``spiffe://amprl/<release>/<role>``, else (None, the CN); role None when it names none."""
    # types-grpcio types each property as bytes; grpc gives a list of bytes per property
    auth: Mapping[str, list[bytes]] = context.auth_context()  # type: ignore[assignment]
    for san in auth.get("x509_subject_alternative_name", []):
        identity = identity_of_uri(san.decode(errors="replace"))
        if identity is not None:
            return identity
    for cn in auth.get("x509_common_name", []):
        text = cn.decode(errors="replace")
        if text in ROLES:
            return None, text
    return None, None


def refusal(method: str, role: str | None) -> str:
    """Why a caller of ``role`` may not call ``method`` ("" when it may)."""
    if method.startswith(OPEN_PREFIXES):
        return ""
    allowed = POLICY.get(method)
    if allowed is None:
        return f"{method} is not open to any role (not in amprl.common.authz.POLICY)"
    if role in allowed:
        return ""
    needed = "a certificate of any AMP-RL role" if allowed == EVERYONE else (
        " or ".join(f"the {r} role" for r in sorted(allowed)))
    held = (f"the {role} role" if role is not None else
            "a certificate that names no role (it needs a URI SAN "
            f"{SPIFFE_PREFIX}<release>/<role> or CN=<role>)")
    return f"{method} needs {needed}; this call came with {held}"


def release_refusal(own: str | None, theirs: str | None) -> str:
    """Why a caller of release ``theirs`` may not call a server of release ``own`` ("" when
    it may). A server whose own certificate names a release admits only callers of the
    same release, so two releases whose issuers share a CA cannot write each other's
    weights; a server with a CN-only certificate has no release to compare."""
    if own is None or theirs == own:
        return ""
    held = f"release {theirs!r}" if theirs is not None else "no release (a CN-only certificate)"
    return (f"this server belongs to release {own!r} (its certificate's "
            f"{SPIFFE_PREFIX}{own}/...); this call came with a certificate of {held}")


def _check(method: str, context: grpc.ServicerContext, release: str | None) -> str:
    theirs, role = identity_of_peer(context)
    return release_refusal(release, theirs) or refusal(method, role)


class Authorize(grpc.ServerInterceptor):
    """Refuses, with PERMISSION_DENIED, each call whose caller's role ``POLICY`` does not
    admit or whose certificate is of another release than ``release`` (this server's own;
    None: no check). A synchronous server's interceptor."""

    def __init__(self, release: str | None):
        self.release = release

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_PREFIXES):
            return handler
        method_name = handler_call_details.method
        field = _field(handler)
        behaviour = getattr(handler, field)

        def authorized(request, context):
            why = _check(method_name, context, self.release)
            if why:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
            return behaviour(request, context)

        return handler._replace(**{field: authorized})


class AsyncAuthorize(grpc.aio.ServerInterceptor):
    """``Authorize`` for a ``grpc.aio`` server."""

    def __init__(self, release: str | None):
        self.release = release

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_PREFIXES):
            return handler
        method_name = handler_call_details.method
        field = _field(handler)
        behaviour = getattr(handler, field)
        if inspect.isasyncgenfunction(behaviour):
            async def authorized_stream(request, context):
                why = _check(method_name, context, self.release)
                if why:
                    await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
                async for reply in behaviour(request, context):
                    yield reply
            authorized: Callable = authorized_stream
        else:
            async def authorized_call(request, context):
                why = _check(method_name, context, self.release)
                if why:
                    await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
                result = behaviour(request, context)
                return await result if inspect.isawaitable(result) else result
            authorized = authorized_call
        return handler._replace(**{field: authorized})


def _field(handler: grpc.RpcMethodHandler) -> str:
    """The name of the handler's field that holds its behaviour."""
    if handler.request_streaming:
        return "stream_stream" if handler.response_streaming else "stream_unary"
    return "unary_stream" if handler.response_streaming else "unary_unary"
