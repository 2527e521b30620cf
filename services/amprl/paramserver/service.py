"""The gRPC boundary of the parameter server: ParameterService over a ParameterStore.

Translates messages (``amprl.compression`` decodes and encodes tensors) and errors (via
``map_errors``); the staleness rule and the optimizer live in ``store``.

Two ports can serve the same store. The main port answers every RPC; the optional pull
port answers PullParameters, WatchParameters and Info (plus health and reflection) and
refuses PushGradients with PERMISSION_DENIED. On Kubernetes only learners may reach the
main port (a NetworkPolicy), so an actor or the evaluator, which only ever read weights,
cannot change them even if compromised or misconfigured.
"""

from __future__ import annotations

import logging
import threading
from typing import Iterator, NamedTuple

import grpc
import torch
from torch import nn

from amprl.common import grpcutil
from amprl.compression import decode, encode, payload_bytes
from amprl.config import ExperimentConfig
from amprl.errors import ConfigError, InvalidArgument, ResourceExhausted
from amprl.paramserver.store import ParameterStore, Step, build_store, in_step
from amprl.v1 import paramserver_pb2, paramserver_pb2_grpc, tensor_pb2

log = logging.getLogger(__name__)

SERVICE_NAME = paramserver_pb2.DESCRIPTOR.services_by_name["ParameterService"].full_name

# Weights are served in these encodings (1-bit is for gradients, which carry error feedback).
_PULL_ENCODINGS = {
    tensor_pb2.ENCODING_FP32: "fp32",
    tensor_pb2.ENCODING_BF16: "bf16",
    tensor_pb2.ENCODING_FP16: "fp16",
}

# Room left in each pull message for the response's own fields and per-tensor framing.
_CHUNK_MARGIN_BYTES = 16 * 1024

DEFAULT_MAX_WORKERS = 256
"""Server threads. The threads are created on demand; each open WatchParameters stream
holds one for its lifetime (a synchronous gRPC server), so the pool is sized for a fleet."""

DEFAULT_MAX_WATCHERS = 224
"""Open watch streams allowed at once; beyond it WatchParameters answers
RESOURCE_EXHAUSTED (the client then polls with PullParameters), so pushes and pulls always
keep DEFAULT_MAX_WORKERS - DEFAULT_MAX_WATCHERS threads."""


class ParameterServicer(paramserver_pb2_grpc.ParameterServiceServicer):
    """Serves one ParameterStore.

    Pull replies are encoded once per (version, encoding) and shared by every caller of
    that version, so a fleet of actors pulling the same weights costs one encoding.
    """

    def __init__(self, store: ParameterStore, *,
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
        self._cache: dict[int, tuple[int, list[paramserver_pb2.PullParametersResponse]]] = {}
        self._encode_locks = {enc: threading.Lock() for enc in _PULL_ENCODINGS}
        self._watchers = 0
        self._closing = threading.Event()

    def close(self) -> None:
        """Ends every open watch stream (call before ``server.stop``)."""
        self._closing.set()
        self.store.close()

    # -- PushGradients -------------------------------------------------------------------

    def _decode_step(self, msgs) -> dict[str, torch.Tensor]:
        """The gradients of one step, by name; InvalidArgument for a duplicate or unknown
        name or a wrong shape (NaN/Inf are found by the store's validation, one check for
        the whole push)."""
        store = self.store
        grads: dict[str, torch.Tensor] = {}
        for msg in msgs:
            name = msg.name
            if name in grads:
                raise InvalidArgument(f"{name}: appears twice in one push")
            expected = store.shapes.get(name)
            if expected is None:
                raise InvalidArgument(f"{name or '<unnamed>'}: not a parameter of the model")
            if tuple(msg.shape) != expected:
                raise InvalidArgument(f"{name}: gradient shape {list(msg.shape)} differs from "
                                      f"the parameter's {list(expected)}")
            grads[name] = decode(msg, device=store.device, finite=False)
        return grads

    @grpcutil.map_errors
    def PushGradients(self, request: paramserver_pb2.PushGradientsRequest, context):
        store = self.store
        parts = [(request.gradients, request.batch_size)] + [
            (step.gradients, step.batch_size) for step in request.more_steps]
        steps = []
        try:
            for i, (msgs, batch_size) in enumerate(parts):
                try:
                    grads = self._decode_step(msgs)
                except InvalidArgument as exc:
                    raise in_step(exc, i, len(parts)) from None
                steps.append(Step(grads, {msg.name for msg in msgs if msg.preconditioned},
                                  batch_size))
        except InvalidArgument:
            store.note_invalid_push()
            raise
        result = store.apply_steps(request.base_version, steps, learner_id=request.learner_id,
                                   wire_bytes=sum(payload_bytes(msgs) for msgs, _ in parts),
                                   snapshot=request.return_weights)
        reply = paramserver_pb2.PushGradientsResponse(
            version=result.version,
            disposition=(paramserver_pb2.PUSH_DISPOSITION_SCALED if result.scaled
                         else paramserver_pb2.PUSH_DISPOSITION_APPLIED),
            staleness=result.staleness, scale=result.scale)
        if result.weights is not None:
            # the fp32 messages a pull of this version serves (and now finds cached); sent
            # back only when they fit one message, else the caller pulls them in chunks
            _, responses = self._encode_snapshot(tensor_pb2.ENCODING_FP32, result.version, result.weights)
            if len(responses) == 1:
                reply.weights.extend(responses[0].parameters)
                store.count_pull(unchanged=False)
        return reply

    # -- PullParameters ------------------------------------------------------------------

    def _cached(self, encoding: int):
        with self._lock:
            cached = self._cache.get(encoding)
        return cached if cached is not None and cached[0] == self.store.version else None

    def _encoded(self, encoding: int) -> tuple[int, list[paramserver_pb2.PullParametersResponse]]:
        cached = self._cached(encoding)
        if cached is not None:
            return cached
        # One encoder per encoding: a fleet pulling a new version at once waits for one
        # encoding instead of each making its own.
        with self._encode_locks[encoding]:
            cached = self._cached(encoding)
            if cached is not None:
                return cached
            return self._encode_snapshot(encoding, *self.store.snapshot())

    def _encode_snapshot(self, encoding: int, version: int, weights: dict[str, torch.Tensor]):
        name = _PULL_ENCODINGS[encoding]
        responses: list[paramserver_pb2.PullParametersResponse] = []
        current: list[tensor_pb2.CompressedTensor] = []
        size = 0
        for pname, tensor in weights.items():
            msg = encode(pname, tensor, name)
            n = msg.ByteSize() + 8  # + tag and length prefix of the repeated field
            if current and size + n > self.chunk_bytes:
                responses.append(paramserver_pb2.PullParametersResponse(version=version,
                                                                        parameters=current))
                current, size = [], 0
            current.append(msg)
            size += n
        responses.append(paramserver_pb2.PullParametersResponse(version=version, parameters=current))
        responses[-1].last = True
        with self._lock:
            old = self._cache.get(encoding)
            if old is None or old[0] <= version:
                self._cache[encoding] = (version, responses)
        return version, responses

    @grpcutil.map_errors
    def PullParameters(self, request: paramserver_pb2.PullParametersRequest,
                       context) -> Iterator[paramserver_pb2.PullParametersResponse]:
        encoding = request.encoding or tensor_pb2.ENCODING_FP32
        if encoding not in _PULL_ENCODINGS:
            raise InvalidArgument(f"encoding {tensor_pb2.Encoding.Name(encoding) if encoding in tensor_pb2.Encoding.values() else encoding}: "
                                  f"weights are served in ENCODING_FP32, ENCODING_BF16 or ENCODING_FP16")
        self.store.note_client(request.client_id)
        version = self.store.version
        if request.have_version == version and version != 0:  # have_version 0 = "none"
            self.store.count_pull(unchanged=True)
            yield paramserver_pb2.PullParametersResponse(version=version, unchanged=True, last=True)
            return
        self.store.count_pull(unchanged=False)
        _, responses = self._encoded(encoding)
        yield from responses

    # -- WatchParameters -----------------------------------------------------------------

    @grpcutil.map_errors
    def WatchParameters(self, request: paramserver_pb2.WatchParametersRequest,
                        context) -> Iterator[paramserver_pb2.WatchParametersResponse]:
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
            have = request.have_version
            first = True
            while context.is_active() and not self._closing.is_set():
                version = store.version if first else store.wait_for_version(have, self.watch_poll_s)
                if self._closing.is_set() or not context.is_active():
                    break
                # have_version 0 means "none": the current version is announced at once.
                if version != have or (first and have == 0):
                    # Coalescing: whatever happened while the previous message was being
                    # sent, this reads the newest version once.
                    yield paramserver_pb2.WatchParametersResponse(version=version)
                    have = version
                first = False
        finally:
            store.watch_ended(client_id)
            with self._lock:
                self._watchers -= 1

    # -- Info ----------------------------------------------------------------------------

    @grpcutil.map_errors
    def Info(self, request, context) -> paramserver_pb2.ParameterServiceInfoResponse:
        return paramserver_pb2.ParameterServiceInfoResponse(**self.store.info())


class PullOnlyServicer(paramserver_pb2_grpc.ParameterServiceServicer):
    """The read-only face of a ParameterServicer, served on the pull port.

    Delegates reads to the main servicer, so both ports share one encoding cache, one
    watch-stream limit and one set of live-client counts.
    """

    def __init__(self, inner: ParameterServicer):
        self.inner = inner

    def PushGradients(self, request, context):
        context.abort(grpc.StatusCode.PERMISSION_DENIED,
                      "PushGradients is not served on the parameter server's pull port (weights "
                      "are read-only here); learners push to the main port (--port / AMPRL_PORT)")

    def PullParameters(self, request, context):
        return self.inner.PullParameters(request, context)

    def WatchParameters(self, request, context):
        return self.inner.WatchParameters(request, context)

    def Info(self, request, context):
        return self.inner.Info(request, context)


class ParameterServer(NamedTuple):
    """A started server (and, optionally, its pull-only server) and what they serve."""

    server: grpc.Server
    port: int
    store: ParameterStore
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
    servicer = ParameterServicer(store, max_message_bytes=max_message_bytes,
                                 max_watchers=min(max_watchers, max(1, max_workers - 8)))
    server, bound = grpcutil.create_server(
        [(paramserver_pb2_grpc.add_ParameterServiceServicer_to_server, servicer, SERVICE_NAME)],
        host=host, port=cfg.paramserver.port if port is None else port, max_workers=max_workers,
        max_message_bytes=max_message_bytes)
    pull_server, pull_bound = None, 0
    if pull_port is not None:
        try:
            pull_server, pull_bound = grpcutil.create_server(
                [(paramserver_pb2_grpc.add_ParameterServiceServicer_to_server,
                  PullOnlyServicer(servicer), SERVICE_NAME)],
                host=host, port=pull_port, max_workers=max_workers,
                max_message_bytes=max_message_bytes)
        except BaseException:
            server.stop(0)
            raise
    return ParameterServer(server, bound, store, servicer, pull_server, pull_bound)
