"""The gRPC boundary of the parameter server: ParameterService over a ParameterStore.

Translates messages (``messages`` converts requests and replies, ``amprl.wire.compressed``
encodes tensors) and errors (via ``map_errors``); the staleness rule and the optimizer live
in ``store``.

Weights are encoded and serialized once per (version, encoding) and the same bytes go to
every puller: the service is registered with ``add_to_server``, whose serializer passes
bytes through, because grpc-python would otherwise call SerializeToString on every send
(megabytes per pull of an Atari network). Clients see ordinary messages.

Two ports can serve the same store. The main port answers every RPC; the optional pull
port answers PullParameters, WatchParameters and Info (plus health and reflection) and
refuses PushGradients with PERMISSION_DENIED. On Kubernetes only learners may reach the
main port (a NetworkPolicy), so an actor or the evaluator, which only ever read weights,
cannot change them even if compromised or misconfigured. A pull-only follower
(``amprl.paramserver.follower``) serves its copy of the weights with the same servicer
behind the same read-only face (``create_pull_only_server``).
"""

from __future__ import annotations

import logging
import threading
from typing import Iterator, NamedTuple

import grpc
from torch import nn

from amprl.common import grpcutil
from amprl.common.inbound import check_id
from amprl.wire.compressed import encode
from amprl.config import ExperimentConfig
from amprl.errors import ConfigError, InvalidArgument, ResourceExhausted
from amprl.paramserver.messages import (PULL_ENCODINGS, WEIGHTS_FIELD, WireBytes, pull_encoding,
                                        pull_replies, push_id, push_parts, push_reply, push_steps,
                                        push_wire_bytes, serialized, with_tensors)
from amprl.paramserver.store import ParameterStore, build_store
from amprl.paramserver.weights import Snapshot, VersionedWeights
from amprl.v1 import paramserver_pb2, paramserver_pb2_grpc, tensor_pb2

log = logging.getLogger(__name__)

SERVICE_NAME = paramserver_pb2.DESCRIPTOR.services_by_name["ParameterService"].full_name

# Room left in each pull message for the response's own fields and per-tensor framing.
_CHUNK_MARGIN_BYTES = 16 * 1024

DEFAULT_MAX_WORKERS = 256
"""Server threads. The threads are created on demand; each open WatchParameters stream
holds one for its lifetime (a synchronous gRPC server), so the pool is sized for a fleet."""

DEFAULT_MAX_WATCHERS = 224
"""Open watch streams allowed at once; beyond it WatchParameters answers
RESOURCE_EXHAUSTED (the client then polls with PullParameters), so pushes and pulls always
keep DEFAULT_MAX_WORKERS - DEFAULT_MAX_WATCHERS threads."""


class _Encoded(NamedTuple):
    """One revision of the weights in one encoding, as the bytes every pull sends."""

    revision: int
    """``VersionedWeights.revision`` of the weights (what the cache is keyed on)."""
    version: int
    replies: list[bytes]
    """Serialized PullParametersResponse messages; the last has last = true."""


class ParameterServicer(paramserver_pb2_grpc.ParameterServiceServicer):
    """Serves one ParameterStore (or, on a follower, the VersionedWeights it keeps).

    Pull replies are encoded and serialized once per (version, encoding) and the same bytes
    are sent to every caller of that version, so a fleet of actors pulling the same weights
    costs one encoding and one serialization. Methods answer bytes where they send cached
    ones (``add_to_server`` registers them so).
    """

    def __init__(self, store: ParameterStore | VersionedWeights, *,
                 max_message_bytes: int = grpcutil.DEFAULT_MAX_MESSAGE_BYTES,
                 max_watchers: int = DEFAULT_MAX_WATCHERS, watch_poll_s: float = 0.5):
        self.store = store
        self.max_message_bytes = max_message_bytes
        self.chunk_bytes = max(1024, max_message_bytes - _CHUNK_MARGIN_BYTES)
        largest = max(store.params.items(), key=lambda kv: kv[1].numel())
        if 4 * largest[1].numel() + 1024 > self.chunk_bytes:
            raise ConfigError(f"parameter {largest[0]} ({4 * largest[1].numel()} bytes in fp32) "
                              f"does not fit one message of {max_message_bytes} bytes; raise "
                              f"the message limit")
        self.max_watchers = max_watchers
        self.watch_poll_s = watch_poll_s
        self._lock = threading.Lock()
        self._cache: dict[int, _Encoded] = {}
        self._encode_locks = {enc: threading.Lock() for enc in PULL_ENCODINGS}
        self._watchers = 0
        self._closing = threading.Event()
        self.wire = WireBytes()

    def close(self) -> None:
        """Ends every open watch stream (call before ``server.stop``)."""
        self._closing.set()
        self.store.close()

    # -- PushGradients -------------------------------------------------------------------

    @grpcutil.map_errors
    def PushGradients(self, request: paramserver_pb2.PushGradientsRequest,
                      context) -> paramserver_pb2.PushGradientsResponse | bytes:
        store = self.store
        # a follower's VersionedWeights is served only behind PullOnlyServicer, which
        # refuses pushes before they get here
        assert isinstance(store, ParameterStore)
        check_id("learner_id", request.learner_id)
        parts = push_parts(request)
        self.wire.received(parts)
        try:
            steps = push_steps(parts, store.shapes, store.device)
        except InvalidArgument:
            store.note_invalid_push()
            raise
        result = store.apply_steps(request.base_version, steps, learner_id=request.learner_id,
                                   wire_bytes=push_wire_bytes(parts),
                                   snapshot=request.return_weights,
                                   caller_gone=lambda: not context.is_active(),
                                   push_id=push_id(request))
        reply = push_reply(result, store.incarnation)
        if result.weights is not None:
            # the fp32 tensors a pull of this version serves (and now finds cached); sent
            # back only when they fit one message, else the caller pulls them in chunks
            encoded, tensors = self._encode_snapshot(
                tensor_pb2.ENCODING_FP32, Snapshot(result.version, result.weights, result.revision,
                                                   store.incarnation))
            if len(encoded.replies) == 1:
                store.count_pull(unchanged=False)
                self.wire.sent("fp32", sum(map(len, tensors)))
                return with_tensors(reply, WEIGHTS_FIELD, tensors)
        return reply

    # -- PullParameters ------------------------------------------------------------------

    def _cached(self, encoding: tensor_pb2.Encoding.ValueType) -> _Encoded | None:
        with self._lock:
            cached = self._cache.get(encoding)
        return cached if cached is not None and cached.revision == self.store.revision else None

    def encoded(self, encoding: tensor_pb2.Encoding.ValueType) -> _Encoded:
        """The current weights in ``encoding`` as pull replies, encoded on first use."""
        cached = self._cached(encoding)
        if cached is not None:
            return cached
        # One encoder per encoding: a fleet pulling a new version at once waits for one
        # encoding instead of each making its own.
        with self._encode_locks[encoding]:
            cached = self._cached(encoding)
            if cached is not None:
                return cached
            return self._encode_snapshot(encoding, self.store.snapshot())[0]

    def _encode_snapshot(self, encoding: tensor_pb2.Encoding.ValueType,
                         snap: Snapshot) -> tuple[_Encoded, list[bytes]]:
        """Encodes and serializes ``snap`` once: (its pull replies, now cached unless a newer
        revision already is; each tensor's serialized CompressedTensor, in order)."""
        name = PULL_ENCODINGS[encoding]
        tensors = [encode(pname, t, name).SerializeToString() for pname, t in snap.weights.items()]
        replies = pull_replies(snap.version, snap.incarnation, tensors, self.chunk_bytes)
        encoded = _Encoded(snap.revision, snap.version, replies)
        with self._lock:
            old = self._cache.get(encoding)
            if old is None or old.revision <= snap.revision:
                self._cache[encoding] = encoded
        return encoded, tensors

    @grpcutil.map_errors
    def PullParameters(self, request: paramserver_pb2.PullParametersRequest,
                       context) -> Iterator[paramserver_pb2.PullParametersResponse | bytes]:
        encoding = pull_encoding(request)
        self.store.note_client(check_id("client_id", request.client_id))
        version, incarnation = self.store.version, self.store.incarnation
        # have_version 0 = "none"; a have_incarnation of another life makes the number moot
        if (request.have_version == version and version != 0
                and request.have_incarnation in (0, incarnation)):
            self.store.count_pull(unchanged=True)
            yield paramserver_pb2.PullParametersResponse(version=version, unchanged=True, last=True,
                                                         incarnation=incarnation)
            return
        self.store.count_pull(unchanged=False)
        replies = self.encoded(encoding).replies
        self.wire.sent(PULL_ENCODINGS[encoding], sum(map(len, replies)))
        yield from replies

    # -- WatchParameters -----------------------------------------------------------------

    @grpcutil.map_errors
    def WatchParameters(self, request: paramserver_pb2.WatchParametersRequest,
                        context) -> Iterator[paramserver_pb2.WatchParametersResponse]:
        check_id("client_id", request.client_id)
        with self._lock:
            if self._watchers >= self.max_watchers:
                raise ResourceExhausted(f"{self._watchers} watch streams are open (the limit); "
                                        f"poll with PullParameters instead")
            self._watchers += 1
        client_id = request.client_id
        store = self.store
        store.watch_started(client_id)

        def wake():  # client cancelled or deadline passed: stop waiting now
            with store.changed:
                store.changed.notify_all()

        context.add_callback(wake)
        try:
            have, have_incarnation = request.have_version, request.have_incarnation
            first = True
            while context.is_active() and not self._closing.is_set():
                version = store.version if first else store.wait_for_version(have, self.watch_poll_s)
                incarnation = store.incarnation
                if self._closing.is_set() or not context.is_active():
                    break
                # have_version 0 means "none": the current version is announced at once; so
                # is one of another incarnation (a follower whose main server restarted).
                if (version != have or (first and have == 0)
                        or have_incarnation not in (0, incarnation)):
                    # Coalescing: whatever happened while the previous message was being
                    # sent, this reads the newest version once.
                    yield paramserver_pb2.WatchParametersResponse(version=version,
                                                                  incarnation=incarnation)
                    have, have_incarnation = version, incarnation
                first = False
        finally:
            store.watch_ended(client_id)
            with self._lock:
                self._watchers -= 1

    # -- Info ----------------------------------------------------------------------------

    @grpcutil.map_errors
    def Info(self, request, context) -> paramserver_pb2.ParameterServiceInfoResponse:
        return paramserver_pb2.ParameterServiceInfoResponse(**self.store.info())


PULL_PORT_REFUSAL = ("PushGradients is not served on the parameter server's pull port (weights "
                     "are read-only here); learners push to the main port (--port / AMPRL_PORT)")


class PullOnlyServicer(paramserver_pb2_grpc.ParameterServiceServicer):
    """The read-only face of a ParameterServicer: the main server's pull port, and a
    pull-only follower (``amprl.paramserver.follower``).

    Delegates reads to ``inner``, so the main server's two ports share one encoding cache,
    one watch-stream limit and one set of live-client counts, and refuses PushGradients
    with PERMISSION_DENIED and ``refusal`` (which says where to push instead). With
    ``ready`` (a follower), PullParameters and WatchParameters answer UNAVAILABLE with
    ``not_ready`` until the event is set: before its first weights a follower has nothing
    it may serve.
    """

    def __init__(self, inner: ParameterServicer, *, refusal: str = PULL_PORT_REFUSAL,
                 ready: threading.Event | None = None, not_ready: str = "no weights yet"):
        self.inner = inner
        self.refusal = refusal
        self.ready = ready
        self.not_ready = not_ready

    def _check_ready(self, context) -> None:
        if self.ready is not None and not self.ready.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, self.not_ready)

    def PushGradients(self, request, context):
        context.abort(grpc.StatusCode.PERMISSION_DENIED, self.refusal)

    def PullParameters(self, request, context):
        self._check_ready(context)
        return self.inner.PullParameters(request, context)

    def WatchParameters(self, request, context):
        self._check_ready(context)
        return self.inner.WatchParameters(request, context)

    def Info(self, request, context):
        return self.inner.Info(request, context)


def add_to_server(servicer: paramserver_pb2_grpc.ParameterServiceServicer, server: grpc.Server) -> None:
    """Registers ``servicer`` as ParameterService on ``server``: the generated
    ``add_ParameterServiceServicer_to_server`` except that PushGradients and PullParameters
    may answer bytes, sent without serializing again. Clients, their generated stubs and
    reflection see no difference."""
    pb = paramserver_pb2
    handlers: dict[str, grpc.RpcMethodHandler] = {
        "PushGradients": grpc.unary_unary_rpc_method_handler(
            servicer.PushGradients, request_deserializer=pb.PushGradientsRequest.FromString,
            response_serializer=serialized),
        "PullParameters": grpc.unary_stream_rpc_method_handler(
            servicer.PullParameters, request_deserializer=pb.PullParametersRequest.FromString,
            response_serializer=serialized),
        "WatchParameters": grpc.unary_stream_rpc_method_handler(
            servicer.WatchParameters, request_deserializer=pb.WatchParametersRequest.FromString,
            response_serializer=pb.WatchParametersResponse.SerializeToString),
        "Info": grpc.unary_unary_rpc_method_handler(
            servicer.Info, request_deserializer=pb.ParameterServiceInfoRequest.FromString,
            response_serializer=pb.ParameterServiceInfoResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class ParameterServer(NamedTuple):
    """A started server (and, optionally, its pull-only server) and what they serve."""

    server: grpc.Server
    port: int
    store: ParameterStore | VersionedWeights
    servicer: ParameterServicer
    pull_server: grpc.Server | None = None
    pull_port: int = 0

    def stop(self, grace_s: float | None = 1.0) -> None:
        """Ends watch streams, then stops the servers (in-flight calls get ``grace_s``)."""
        self.servicer.close()
        stopping = [self.server.stop(grace_s)]
        if self.pull_server is not None:
            stopping.append(self.pull_server.stop(grace_s))
        for event in stopping:
            event.wait()


def _servicer(store: ParameterStore | VersionedWeights, max_message_bytes: int, max_workers: int,
              max_watchers: int) -> ParameterServicer:
    # Each open watch stream holds a server thread: 8 are always left for the other RPCs.
    return ParameterServicer(store, max_message_bytes=max_message_bytes,
                             max_watchers=min(max_watchers, max(1, max_workers - 8)))


def create_server(cfg: ExperimentConfig, model: nn.Module | None = None, *,
                  store: ParameterStore | None = None, host: str = "0.0.0.0",
                  port: int | None = None,
                  max_message_bytes: int = grpcutil.DEFAULT_MAX_MESSAGE_BYTES,
                  max_workers: int = DEFAULT_MAX_WORKERS,
                  max_watchers: int = DEFAULT_MAX_WATCHERS,
                  pull_port: int | None = None) -> ParameterServer:
    """Starts a ParameterService (with health and reflection) for ``model`` or ``store``.

    ``port`` None means ``cfg.paramserver.port`` (0 = any free port; the bound one is
    returned). ``pull_port`` not None also starts the pull-only server on that port
    (0 = any free port), with the same host, limits and TLS settings.
    """
    if store is None:
        if model is None:
            raise ValueError("create_server needs a model or a store")
        store = build_store(cfg, model)
    servicer = _servicer(store, max_message_bytes, max_workers, max_watchers)
    server, bound = grpcutil.create_server(
        [(add_to_server, servicer, SERVICE_NAME)],
        host=host, port=cfg.paramserver.port if port is None else port, max_workers=max_workers,
        max_message_bytes=max_message_bytes)
    pull_server, pull_bound = None, 0
    if pull_port is not None:
        try:
            pull_server, pull_bound = grpcutil.create_server(
                [(add_to_server, PullOnlyServicer(servicer), SERVICE_NAME)],
                host=host, port=pull_port, max_workers=max_workers,
                max_message_bytes=max_message_bytes)
        except BaseException:
            server.stop(0)
            raise
    return ParameterServer(server, bound, store, servicer, pull_server, pull_bound)


def create_pull_only_server(store: VersionedWeights, *, refusal: str,
                            ready: threading.Event | None = None, not_ready: str = "",
                            host: str = "0.0.0.0", port: int = 0,
                            max_message_bytes: int = grpcutil.DEFAULT_MAX_MESSAGE_BYTES,
                            max_workers: int = DEFAULT_MAX_WORKERS,
                            max_watchers: int = DEFAULT_MAX_WATCHERS) -> ParameterServer:
    """Starts a ParameterService that only reads ``store`` (a follower's weights): pulls,
    watches and Info as the main server answers them, PushGradients refused with
    ``refusal``; with ``ready``, pulls and watches UNAVAILABLE (``not_ready``) until it is
    set, and health NOT_SERVING until the caller sets it SERVING."""
    servicer = _servicer(store, max_message_bytes, max_workers, max_watchers)
    face = PullOnlyServicer(servicer, refusal=refusal, ready=ready, not_ready=not_ready)
    server, bound = grpcutil.create_server([(add_to_server, face, SERVICE_NAME)], host=host,
                                           port=port, max_workers=max_workers,
                                           max_message_bytes=max_message_bytes,
                                           serving=ready is None or ready.is_set())
    return ParameterServer(server, bound, store, servicer)
