"""A typed client for ParameterService; its methods mirror the RPCs.

    client = ParameterClient("paramserver:50051", "learner-0")
    version, weights = client.pull()                       # dict name -> fp32 tensor
    reply = client.push(version, ef.encode(grads), batch_size=128)
    for v in client.watch(version): ...                    # newest versions, coalesced

Errors come back as ``amprl.errors`` exceptions: InvalidArgument, FailedPrecondition (a
stale push; ``.current_version`` says where the server is), Unavailable, DeadlineExceeded.

Retries: every call waits for the channel to be ready (``wait_for_ready``), so a dropped
connection is re-established under the call's deadline. Pull and Info, which are safe to
repeat, are retried on UNAVAILABLE by gRPC's retry policy (``amprl.common.channels``). So
are pushes: each carries this client's incarnation and a sequence number, and the server
applies a numbered push at most once and answers a resend with the first outcome
(``reply.repeat``), so a push cut off mid-flight is sent again instead of being lost or
applied twice. A pull stream cut off after its first message is not retried: the caller
pulls again.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import secrets
import threading
from pathlib import Path
from typing import Sequence

import grpc
import torch

from amprl import errors
from amprl.common import grpcutil
from amprl.common.channels import make_channel
from amprl.config import ExperimentConfig
from amprl.core import Pulled
from amprl.wire.compressed import decode, encoding_value
from amprl.v1 import paramserver_pb2, paramserver_pb2_grpc, tensor_pb2

DEFAULT_TIMEOUT_S = 30.0
"""Deadline of a call when the caller gives none."""
MAX_PUSHES_IN_FLIGHT = 256
"""Push threads per client (made on demand): pushes beyond this many in flight wait in its
queue. It must not bound a learner's window: at 300 ms RTT a window of 48 needs 48 threads,
and 32 (the value before) capped such a learner at 32 / 0.3 s = 107 pushes/s."""

_SERVICE = "amprl.v1.ParameterService"
RETRIED = [f"{_SERVICE}/PushGradients", f"{_SERVICE}/PullParameters", f"{_SERVICE}/Info"]
"""The calls gRPC repeats on UNAVAILABLE (pushes are numbered, so a resend applies once)."""


def reply_weights(reply, device: torch.device | str | None = None) -> dict[str, torch.Tensor] | None:
    """The weights of ``reply.version`` that a ``return_weights`` push brought back, decoded
    to fp32 on ``device``; None when the server sent none (too large for one message: pull)."""
    weights = getattr(reply, "weights", None)
    if not weights:
        return None
    return {msg.name: decode(msg, device=device) for msg in weights}


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
        except errors.AmprlError as exc:
            self._error = exc
        except grpc.RpcError as exc:  # cancelled by us, or a code with no amprl error
            if not self._cancelled:
                self._error = exc
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
        self.channel = make_channel(address, server_role="paramserver", retry=RETRIED,
                                    max_message_bytes=max_message_bytes)
        # pushes are numbered (incarnation, 1, 2, ...) so a resend is applied at most once
        self.incarnation = secrets.randbelow(2**63 - 1) + 1
        self._push_sequence = itertools.count(1)
        self.stub = paramserver_pb2_grpc.ParameterServiceStub(self.channel)
        self._push_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    # -- PushGradients -------------------------------------------------------------------

    def _push_request(self, base_version: int, grads: Sequence[tensor_pb2.CompressedTensor],
                      batch_size: int, return_weights: bool,
                      more_steps: Sequence[tuple[Sequence[tensor_pb2.CompressedTensor], int]] = ()
                      ) -> paramserver_pb2.PushGradientsRequest:
        return paramserver_pb2.PushGradientsRequest(
            learner_id=self.client_id, base_version=base_version, gradients=grads,
            batch_size=batch_size, return_weights=return_weights,
            more_steps=[paramserver_pb2.GradientStep(gradients=g, batch_size=b) for g, b in more_steps],
            learner_incarnation=self.incarnation, sequence=next(self._push_sequence))

    def push(self, base_version: int, grads: Sequence[tensor_pb2.CompressedTensor],
             batch_size: int = 0, timeout: float | None = None, *, return_weights: bool = False,
             more_steps: Sequence[tuple[Sequence[tensor_pb2.CompressedTensor], int]] = ()
             ) -> paramserver_pb2.PushGradientsResponse:
        """Pushes one gradient computed on ``base_version``; returns the server's reply
        (with ``return_weights``, ``reply_weights(reply)`` gives the weights it made, if the
        server sent them). ``more_steps``: (gradients, batch_size) of further steps, the
        i-th computed on ``base_version + i`` and applied right after (one call, one
        version each; the reply's version is the last step's).

        Raises FailedPrecondition (``.current_version``) when it is too stale,
        InvalidArgument when malformed (nothing was applied in either case).
        """
        request = self._push_request(base_version, grads, batch_size, return_weights, more_steps)
        return self.stub.PushGradients(request, wait_for_ready=True, timeout=timeout or self.timeout_s)

    def push_future(self, base_version: int, grads: Sequence[tensor_pb2.CompressedTensor],
                    batch_size: int = 0, timeout: float | None = None, *,
                    return_weights: bool = False,
                    more_steps: Sequence[tuple[Sequence[tensor_pb2.CompressedTensor], int]] = ()
                    ) -> "concurrent.futures.Future[paramserver_pb2.PushGradientsResponse]":
        """Starts a push and returns at once; the future yields what ``push`` would return
        or raises what it would raise (learners keep a window of these in flight).

        The call runs as a blocking ``push`` on one of this client's push threads, which
        live as long as the client: building and serialising the request (a whole
        gradient) happens there, not in the caller's update loop, and no gRPC channel-spin
        thread is started per call (what ``stub.X.future`` does whenever no other call is
        in flight: a large share of the learner's update thread in a py-spy profile).
        """
        with self._pool_lock:
            if self._push_pool is None:
                # threads are made on demand and reused; more than the widest window in use
                self._push_pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=MAX_PUSHES_IN_FLIGHT, thread_name_prefix="ps-push")
            return self._push_pool.submit(self.push, base_version, grads, batch_size, timeout,
                                          return_weights=return_weights, more_steps=more_steps)

    # -- PullParameters ------------------------------------------------------------------

    def pull(self, have_version: int = 0, encoding: str = "fp32", timeout: float | None = None,
             device: torch.device | str | None = None
             ) -> tuple[int, dict[str, torch.Tensor] | None]:
        """(version, weights) with weights decoded to fp32 on ``device``, in the server's
        order; (version, None) when ``have_version`` is already the newest. Blind to the
        server's incarnation: a client that keeps weights across server restarts uses
        ``pull_versioned``."""
        pulled = self.pull_versioned(have_version, 0, encoding=encoding, timeout=timeout,
                                     device=device)
        return pulled.version, pulled.weights

    def pull_versioned(self, have_version: int = 0, have_incarnation: int = 0, *,
                       encoding: str = "fp32", timeout: float | None = None,
                       device: torch.device | str | None = None) -> "Pulled":
        """The newest weights unless (``have_version``, ``have_incarnation``) are the
        server's (then ``weights`` is None). Weights of another incarnation than
        ``have_incarnation`` come whatever their version: the server restarted, maybe from
        an older checkpoint, and its version numbers name other weights now."""
        enc = encoding_value(encoding)
        if enc not in (tensor_pb2.ENCODING_FP32, tensor_pb2.ENCODING_BF16, tensor_pb2.ENCODING_FP16):
            raise errors.InvalidArgument(f"encoding {encoding!r}: weights come in fp32, bf16 or fp16")
        request = paramserver_pb2.PullParametersRequest(have_version=have_version, encoding=enc,
                                                        client_id=self.client_id,
                                                        have_incarnation=have_incarnation)
        weights: dict[str, torch.Tensor] = {}
        version = None
        last = False
        for resp in self.stub.PullParameters(request, timeout=timeout or self.timeout_s,
                                             wait_for_ready=True):
            if resp.unchanged:
                return Pulled(resp.version, resp.incarnation, None)
            if version is not None and resp.version != version:
                raise errors.Unavailable(f"pull stream mixed versions {version} and {resp.version}")
            version, incarnation = resp.version, resp.incarnation
            for msg in resp.parameters:
                weights[msg.name] = decode(msg, device=device)
            last = resp.last
        if version is None or not last:
            raise errors.Unavailable("pull stream ended before its last message")
        return Pulled(version, incarnation, weights)

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
        return self.stub.Info(paramserver_pb2.ParameterServiceInfoRequest(),
                              timeout=timeout or self.timeout_s, wait_for_ready=True)

    def close(self) -> None:
        with self._pool_lock:
            pool, self._push_pool = self._push_pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
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


def checkpoint_files(folder: Path) -> list[tuple[int, Path]]:
    """A parameter server's checkpoint files in ``folder``, newest first, as (version, path):
    for tools that copy one without reading it (``amprl run --init-from``)."""
    from amprl.paramserver.checkpoint import CheckpointManager

    return CheckpointManager(folder).files()


def checkpointed_weights(cfg: ExperimentConfig, run_dir: str) -> tuple[int, dict[str, torch.Tensor], list[str]]:
    """The newest readable checkpoint of a run's parameter server, read from its folder
    (``paramserver.checkpoint_dir``, default ``<run_dir>/checkpoints``) without a server:
    (version, fp32 weights by wire name, one line per newer file skipped as unreadable).
    For tools reading a stopped run (``amprl enjoy --final``); each file is checked by its
    hash and loaded with ``torch.load(weights_only=True)`` (``amprl.paramserver.checkpoint``).
    FileNotFoundError if no file is readable."""
    from amprl.paramserver.__main__ import checkpoint_dir
    from amprl.paramserver.checkpoint import CheckpointManager

    folder = checkpoint_dir(cfg, run_dir)
    skipped = []
    for _, path in CheckpointManager(folder).files():
        try:
            state = CheckpointManager.read(path)
        except (OSError, errors.InvalidArgument) as exc:
            skipped.append(f"{path.name}: {exc}")
            continue
        weights = {n: state["params"][n].float() for n in state["names"]}
        return int(state["version"]), weights, skipped
    raise FileNotFoundError(f"{folder}: no readable checkpoint ({'; '.join(skipped) or 'none there'})")


__all__ = ["ParameterClient", "VersionWatch", "load_into", "checkpoint_files", "checkpointed_weights",
           "DEFAULT_TIMEOUT_S"]
