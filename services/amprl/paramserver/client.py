"""A typed client for ParameterService; its methods mirror the RPCs.

    client = ParameterClient("paramserver:50051", "learner-0")
    version, weights = client.pull()                       # dict name -> fp32 tensor
    reply = client.push(version, ef.encode(grads), batch_size=128)
    for v in client.watch(version): ...                    # newest versions, coalesced

Errors come back as ``amprl.errors`` exceptions: InvalidArgument, FailedPrecondition (a
stale push; ``.current_version`` says where the server is), Unavailable, DeadlineExceeded.

Retries: every call waits for the channel to be ready (``wait_for_ready``), so a dropped
connection is re-established under the call's deadline, and no request is sent twice. Pull
and Info, which are safe to repeat, also retry with exponential backoff when the server
answers UNAVAILABLE mid-call. Pushes are not repeated: applying a gradient twice is a
different update, so a push that fails mid-flight surfaces as Unavailable and the learner
decides (drop it and compute the next one).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Sequence

import grpc
import torch

from amprl import errors
from amprl.common import grpcutil
from amprl.compression import decode, encoding_value
from amprl.v1 import paramserver_pb2, paramserver_pb2_grpc, tensor_pb2

DEFAULT_TIMEOUT_S = 30.0
"""Deadline of a call when the caller gives none."""

_RETRY_BACKOFF_S = (0.1, 0.2, 0.4, 0.8, 1.6)  # then give up (UNAVAILABLE -> Unavailable)


def _mapped(exc: grpc.RpcError) -> Exception:
    try:
        grpcutil.raise_for_rpc_error(exc)
    except Exception as mapped:  # noqa: BLE001 - we want the mapped exception object
        return mapped
    return exc  # pragma: no cover - raise_for_rpc_error always raises


class VersionWatch:
    """Iterator over new parameter versions from one WatchParameters stream.

    A background thread drains the stream and keeps only the newest version, so however
    slowly the caller iterates it gets the newest version, never a backlog. Iteration ends
    after ``cancel()`` or when the server ends the stream; a lost connection raises
    ``amprl.errors.Unavailable`` (watch again to resume).
    """

    def __init__(self, call):
        self._call = call
        self._cond = threading.Condition()
        self._pending: int | None = None
        self._done = False
        self._cancelled = False
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._drain, name="param-watch", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        try:
            for resp in self._call:
                with self._cond:
                    self._pending = resp.version
                    self._cond.notify_all()
        except grpc.RpcError as exc:
            if not (self._cancelled and exc.code() == grpc.StatusCode.CANCELLED):
                self._error = _mapped(exc)
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def __iter__(self) -> "VersionWatch":
        return self

    def __next__(self) -> int:
        version = self.next(timeout=None)
        if version is None:
            raise StopIteration
        return version

    def next(self, timeout: float | None = None) -> int | None:
        """The newest version not yet returned; None on timeout or at the end of the stream
        (``done`` tells which). Raises the stream's error, if it failed."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending is not None or self._done, timeout)
            if self._pending is not None:
                version, self._pending = self._pending, None
                return version
            if self._done and self._error is not None:
                raise self._error
            return None

    @property
    def done(self) -> bool:
        return self._done and self._pending is None

    def cancel(self) -> None:
        """Ends the stream; a blocked ``next`` returns (iteration stops)."""
        self._cancelled = True
        self._call.cancel()
        self._thread.join(timeout=5.0)

    def __enter__(self) -> "VersionWatch":
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


class ParameterClient:
    """Client of one parameter server; thread-safe (gRPC channels are)."""

    def __init__(self, address: str, client_id: str = "", *,
                 timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_message_bytes: int = grpcutil.DEFAULT_MAX_MESSAGE_BYTES):
        self.address = address
        self.client_id = client_id
        self.timeout_s = timeout_s
        # No channel-level retry policy: it would apply to pushes too (see module docstring).
        self.channel = grpcutil.make_channel(address, max_message_bytes=max_message_bytes)
        self.stub = paramserver_pb2_grpc.ParameterServiceStub(self.channel)

    # -- PushGradients -------------------------------------------------------------------

    def _push_request(self, base_version: int, grads: Sequence[tensor_pb2.CompressedTensor],
                      batch_size: int) -> paramserver_pb2.PushGradientsRequest:
        return paramserver_pb2.PushGradientsRequest(learner_id=self.client_id,
                                                    base_version=base_version,
                                                    gradients=grads, batch_size=batch_size)

    def push(self, base_version: int, grads: Sequence[tensor_pb2.CompressedTensor],
             batch_size: int = 0, timeout: float | None = None) -> paramserver_pb2.PushGradientsResponse:
        """Pushes one gradient computed on ``base_version``; returns the server's reply.

        Raises FailedPrecondition (``.current_version``) when it is too stale,
        InvalidArgument when malformed (nothing was applied in either case).
        """
        try:
            return self.stub.PushGradients(self._push_request(base_version, grads, batch_size),
                                           timeout=timeout or self.timeout_s, wait_for_ready=True)
        except grpc.RpcError as exc:
            grpcutil.raise_for_rpc_error(exc)
            raise  # pragma: no cover

    def push_future(self, base_version: int, grads: Sequence[tensor_pb2.CompressedTensor],
                    batch_size: int = 0, timeout: float | None = None
                    ) -> "concurrent.futures.Future[paramserver_pb2.PushGradientsResponse]":
        """Starts a push and returns at once; the future yields what ``push`` would return
        or raises what it would raise (learners keep a window of these in flight)."""
        out: concurrent.futures.Future = concurrent.futures.Future()
        out.set_running_or_notify_cancel()
        call = self.stub.PushGradients.future(self._push_request(base_version, grads, batch_size),
                                              timeout=timeout or self.timeout_s,
                                              wait_for_ready=True)

        def done(f):
            try:
                out.set_result(f.result())
            except grpc.RpcError as exc:
                out.set_exception(_mapped(exc))
            except Exception as exc:  # noqa: BLE001 - e.g. grpc.FutureCancelledError
                out.set_exception(exc)

        call.add_done_callback(done)
        return out

    # -- PullParameters ------------------------------------------------------------------

    def pull(self, have_version: int = 0, encoding: str = "fp32", timeout: float | None = None,
             device: torch.device | str | None = None
             ) -> tuple[int, dict[str, torch.Tensor] | None]:
        """(version, weights) with weights decoded to fp32 on ``device``, in the server's
        order; (version, None) when ``have_version`` is already the newest."""
        enc = encoding_value(encoding)
        if enc not in (tensor_pb2.ENCODING_FP32, tensor_pb2.ENCODING_BF16, tensor_pb2.ENCODING_FP16):
            raise errors.InvalidArgument(f"encoding {encoding!r}: weights come in fp32, bf16 or fp16")
        request = paramserver_pb2.PullParametersRequest(have_version=have_version, encoding=enc,
                                                        client_id=self.client_id)
        deadline = time.monotonic() + (timeout or self.timeout_s)
        for attempt in range(len(_RETRY_BACKOFF_S) + 1):
            try:
                return self._pull_once(request, deadline, device)
            except grpc.RpcError as exc:
                delay = _RETRY_BACKOFF_S[attempt] if attempt < len(_RETRY_BACKOFF_S) else None
                if (exc.code() != grpc.StatusCode.UNAVAILABLE or delay is None
                        or time.monotonic() + delay >= deadline):
                    grpcutil.raise_for_rpc_error(exc)
                time.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    def _pull_once(self, request, deadline: float, device):
        weights: dict[str, torch.Tensor] = {}
        version = None
        last = False
        for resp in self.stub.PullParameters(request, timeout=max(0.01, deadline - time.monotonic()),
                                             wait_for_ready=True):
            if resp.unchanged:
                return resp.version, None
            if version is not None and resp.version != version:
                raise errors.Unavailable(f"pull stream mixed versions {version} and {resp.version}")
            version = resp.version
            for msg in resp.parameters:
                weights[msg.name] = decode(msg, device=device)
            last = resp.last
        if version is None or not last:
            raise errors.Unavailable("pull stream ended before its last message")
        return version, weights

    # -- WatchParameters -----------------------------------------------------------------

    def watch(self, have_version: int = 0) -> VersionWatch:
        """Subscribes to new versions (the first differs from ``have_version``)."""
        call = self.stub.WatchParameters(
            paramserver_pb2.WatchParametersRequest(have_version=have_version,
                                                   client_id=self.client_id),
            wait_for_ready=True)
        return VersionWatch(call)

    # -- Info ----------------------------------------------------------------------------

    def info(self, timeout: float | None = None) -> paramserver_pb2.ParameterServiceInfoResponse:
        deadline = time.monotonic() + (timeout or self.timeout_s)
        for attempt in range(len(_RETRY_BACKOFF_S) + 1):
            try:
                return self.stub.Info(paramserver_pb2.ParameterServiceInfoRequest(),
                                      timeout=max(0.01, deadline - time.monotonic()),
                                      wait_for_ready=True)
            except grpc.RpcError as exc:
                delay = _RETRY_BACKOFF_S[attempt] if attempt < len(_RETRY_BACKOFF_S) else None
                if (exc.code() != grpc.StatusCode.UNAVAILABLE or delay is None
                        or time.monotonic() + delay >= deadline):
                    grpcutil.raise_for_rpc_error(exc)
                time.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "ParameterClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_into(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copies pulled weights into ``model``'s parameters in place (names must match)."""
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(weights))
    unknown = sorted(set(weights) - set(params))
    if missing or unknown:
        raise errors.InvalidArgument(f"pulled weights do not match the model: missing {missing[:4]}, "
                                     f"unknown {unknown[:4]}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name])


__all__ = ["ParameterClient", "VersionWatch", "load_into", "DEFAULT_TIMEOUT_S"]
