"""ParameterService requests and replies <-> what the store takes and gives: a push's
messages into validated steps, an ApplyResult into a PushGradientsResponse, and the
serialized tensors of some weights into pull replies.

Weights go out as bytes serialized once (``amprl.paramserver.service`` caches them): a reply
is its own fields serialized, followed by the already serialized CompressedTensors
(``with_tensors``), so no tensor is serialized twice.
"""

from __future__ import annotations

import collections
import threading

import torch
from google.protobuf import message as message_types

from amprl.errors import InvalidArgument
from amprl.paramserver.admission import in_step
from amprl.paramserver.store import ApplyResult, Step
from amprl.v1 import paramserver_pb2, tensor_pb2
from amprl.wire.compressed import decode, encoding_name, payload_bytes

PULL_ENCODINGS = {
    tensor_pb2.ENCODING_FP32: "fp32",
    tensor_pb2.ENCODING_BF16: "bf16",
    tensor_pb2.ENCODING_FP16: "fp16",
}
"""The encodings weights are served in (1-bit is for gradients, which carry error feedback)."""

PARAMETERS_FIELD = paramserver_pb2.PullParametersResponse.DESCRIPTOR.fields_by_name["parameters"].number
WEIGHTS_FIELD = paramserver_pb2.PushGradientsResponse.DESCRIPTOR.fields_by_name["weights"].number


def with_tensors(head: message_types.Message, field: int, tensors: list[bytes]) -> bytes:
    """``head`` serialized, followed by ``tensors`` (serialized CompressedTensors) as the
    repeated message field ``field``: what serializing ``head`` with those tensors in that
    field gives, without serializing the tensors again. In protobuf's wire format a
    repeated message field is one (tag, varint length, bytes) record per element, and
    records may come in any order."""
    assert field < 16  # a one-byte tag
    parts: list[bytes | bytearray] = [head.SerializeToString()]
    for tensor in tensors:
        prefix = bytearray([field << 3 | 2])  # wire type 2: length-delimited
        n = len(tensor)
        while n > 0x7F:
            prefix.append(n & 0x7F | 0x80)
            n >>= 7
        prefix.append(n)
        parts += (prefix, tensor)
    return b"".join(parts)


def serialized(reply: message_types.Message | bytes) -> bytes:
    """A reply as sent: bytes as they are (serialized once, for every caller), a message
    serialized now."""
    return reply if isinstance(reply, bytes) else reply.SerializeToString()


# -- PushGradients -----------------------------------------------------------------------


def _decode_step(msgs, shapes: dict[str, tuple], device: torch.device) -> dict[str, torch.Tensor]:
    """The gradients of one step, by name; InvalidArgument for a duplicate or unknown
    name or a wrong shape (NaN/Inf are found by the store's validation, one check for
    the whole push)."""
    grads: dict[str, torch.Tensor] = {}
    for msg in msgs:
        name = msg.name
        if name in grads:
            raise InvalidArgument(f"{name}: appears twice in one push")
        expected = shapes.get(name)
        if expected is None:
            raise InvalidArgument(f"{name or '<unnamed>'}: not a parameter of the model")
        if tuple(msg.shape) != expected:
            raise InvalidArgument(f"{name}: gradient shape {list(msg.shape)} differs from "
                                  f"the parameter's {list(expected)}")
        grads[name] = decode(msg, device=device, finite=False)
    return grads


def push_parts(request: paramserver_pb2.PushGradientsRequest) -> list[tuple]:
    """(gradient messages, batch size) of each step of a push, in order."""
    return [(request.gradients, request.batch_size)] + [
        (step.gradients, step.batch_size) for step in request.more_steps]


def push_steps(parts: list[tuple], shapes: dict[str, tuple], device: torch.device) -> list[Step]:
    """The steps of a push (``push_parts``), decoded onto ``device``; InvalidArgument
    naming the step for a bad one."""
    steps = []
    for i, (msgs, batch_size) in enumerate(parts):
        try:
            grads = _decode_step(msgs, shapes, device)
        except InvalidArgument as exc:
            raise in_step(exc, i, len(parts)) from None
        steps.append(Step(grads, {msg.name for msg in msgs if msg.preconditioned}, batch_size))
    return steps


def push_wire_bytes(parts: list[tuple]) -> int:
    """Bytes of tensor payload in a push (Info's gradient_bytes_received)."""
    return sum(payload_bytes(msgs) for msgs, _ in parts)


class WireBytes:
    """Tensor bytes on the wire by encoding, for ``/metrics``: received in pushes (each
    tensor's data and scales, by its own encoding: a 1-bit push sends its small tensors in
    fp32) and sent as weights (the replies of pulls as serialized, and weights returned
    with a push)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._received: collections.Counter[str] = collections.Counter()
        self._sent: collections.Counter[str] = collections.Counter()

    def received(self, parts: list[tuple]) -> None:
        """A push's ``push_parts``."""
        by: collections.Counter[str] = collections.Counter()
        for msgs, _ in parts:
            for m in msgs:
                by[encoding_name(m.encoding)] += len(m.data) + len(m.scales)
        with self._lock:
            self._received.update(by)

    def sent(self, encoding: str, nbytes: int) -> None:
        with self._lock:
            self._sent[encoding] += nbytes

    def totals(self) -> tuple[dict[str, int], dict[str, int]]:
        """(received, sent) by encoding name, since the start."""
        with self._lock:
            return dict(self._received), dict(self._sent)


def push_id(request: paramserver_pb2.PushGradientsRequest) -> tuple | None:
    """(learner id, its incarnation, sequence) naming a numbered push; None for one
    without a sequence."""
    return ((request.learner_id, request.learner_incarnation, request.sequence)
            if request.sequence else None)


def push_reply(result: ApplyResult, incarnation: int) -> paramserver_pb2.PushGradientsResponse:
    """The reply to an applied (or repeated) push, without weights."""
    return paramserver_pb2.PushGradientsResponse(
        version=result.version,
        disposition=(paramserver_pb2.PUSH_DISPOSITION_SCALED if result.scaled
                     else paramserver_pb2.PUSH_DISPOSITION_APPLIED),
        staleness=result.staleness, scale=result.scale, incarnation=incarnation,
        repeat=result.repeat)


# -- PullParameters ----------------------------------------------------------------------


def pull_encoding(request: paramserver_pb2.PullParametersRequest) -> tensor_pb2.Encoding.ValueType:
    """The encoding a pull asks for (fp32 when unset); InvalidArgument for one weights
    are not served in."""
    encoding = request.encoding or tensor_pb2.ENCODING_FP32
    if encoding not in PULL_ENCODINGS:
        raise InvalidArgument(f"encoding {tensor_pb2.Encoding.Name(encoding) if encoding in tensor_pb2.Encoding.values() else encoding}: "
                              f"weights are served in ENCODING_FP32, ENCODING_BF16 or ENCODING_FP16")
    return encoding


def pull_replies(version: int, incarnation: int, tensors: list[bytes], chunk_bytes: int) -> list[bytes]:
    """Serialized PullParametersResponse messages carrying ``tensors`` (serialized
    CompressedTensors, in order), each under ``chunk_bytes`` of tensors unless one tensor
    alone is larger; the last has last = true."""
    replies: list[bytes] = []
    chunk: list[bytes] = []
    size = 0
    for tensor in tensors:
        n = len(tensor) + 8  # + tag and length prefix of the repeated field
        if chunk and size + n > chunk_bytes:
            replies.append(with_tensors(paramserver_pb2.PullParametersResponse(
                version=version, incarnation=incarnation), PARAMETERS_FIELD, chunk))
            chunk, size = [], 0
        chunk.append(tensor)
        size += n
    replies.append(with_tensors(paramserver_pb2.PullParametersResponse(
        version=version, incarnation=incarnation, last=True), PARAMETERS_FIELD, chunk))
    return replies
