"""Compressed tensors (``amprl.compression``) <-> ``amprl.v1.CompressedTensor``.

Gradients and weights travel in these messages. The maths of each encoding, and the error
feedback a sender keeps, are in ``amprl.compression``, which knows no protobuf; this module
names the encodings by their wire enum, builds the messages and reads them back.
``decode`` is the gate in front of the parameter server: it checks a message's byte counts
against its shape and block size and raises InvalidArgument naming the tensor, so nothing
malformed reaches the store.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

import torch

from amprl import compression
from amprl.compression.codecs import (DEFAULT_BLOCK_SIZE, DENSE_DTYPES, Encoded, encode_tensor,
                                      expand_scales, from_bytes, nonfinite, unpack_signs)
from amprl.errors import InvalidArgument
from amprl.v1 import tensor_pb2

ENCODINGS: dict[str, tensor_pb2.Encoding.ValueType] = {
    "fp32": tensor_pb2.ENCODING_FP32,
    "fp16": tensor_pb2.ENCODING_FP16,
    "bf16": tensor_pb2.ENCODING_BF16,
    "onebit": tensor_pb2.ENCODING_ONE_BIT,
}
"""Config name -> wire enum."""


def encoding_value(encoding: str | int) -> tensor_pb2.Encoding.ValueType:
    """Wire enum for a config name ("onebit") or an enum value; InvalidArgument otherwise."""
    if isinstance(encoding, str):
        try:
            return ENCODINGS[encoding]
        except KeyError:
            raise InvalidArgument(f"unknown encoding {encoding!r}; use one of {sorted(ENCODINGS)}") from None
    if encoding not in ENCODINGS.values():
        raise InvalidArgument(f"unknown encoding {encoding!r}")
    return tensor_pb2.Encoding.ValueType(encoding)  # int(encoding), typed as the enum


def encoding_name(encoding: int) -> str:
    for name, value in ENCODINGS.items():
        if value == encoding:
            return name
    known = encoding in tensor_pb2.Encoding.values()
    return tensor_pb2.Encoding.Name(tensor_pb2.Encoding.ValueType(encoding)) if known else str(encoding)


def encoded_to_proto(e: Encoded) -> tensor_pb2.CompressedTensor:
    """The message that carries ``e``."""
    return tensor_pb2.CompressedTensor(
        name=e.name, encoding=ENCODINGS[e.encoding], shape=list(e.shape), data=e.data,
        scales=e.scales, block_size=e.block_size, preconditioned=e.preconditioned)


def encode(name: str, tensor: torch.Tensor, encoding: str | int = "fp32",
           block_size: int = DEFAULT_BLOCK_SIZE) -> tensor_pb2.CompressedTensor:
    """Encodes a float tensor (any device) as a CompressedTensor named ``name``.

    fp16 saturates at +-65504 (larger magnitudes are clamped, never sent as inf); bf16
    keeps fp32's range with 8 bits of mantissa. NaN/Inf inputs are encoded as they are and
    rejected by ``decode``.
    """
    enc = encoding_name(encoding_value(encoding))
    return encoded_to_proto(encode_tensor(name, tensor, enc, block_size))


def _numel(msg: tensor_pb2.CompressedTensor) -> int:
    shape = list(msg.shape)
    if any(s < 0 for s in shape):
        raise InvalidArgument(f"{msg.name or '<unnamed>'}: negative dimension in shape {shape}")
    return math.prod(shape)


def decode(msg: tensor_pb2.CompressedTensor, device: torch.device | str | None = None,
           *, finite: bool = True) -> torch.Tensor:
    """Decodes a CompressedTensor into a dense float32 tensor on ``device`` (CPU if None).

    Raises InvalidArgument naming the tensor when the encoding is unknown, the byte counts
    disagree with the shape and block size, or (``finite``) a value or scale is NaN/Inf.
    """
    name = msg.name or "<unnamed>"
    n = _numel(msg)
    shape = tuple(msg.shape)
    enc = msg.encoding
    if enc == tensor_pb2.ENCODING_ONE_BIT:
        b = msg.block_size
        if b < 1:
            raise InvalidArgument(f"{name}: ENCODING_ONE_BIT needs block_size >= 1, got {b}")
        nb = max(1, math.ceil(n / b))
        if len(msg.data) != math.ceil(n / 8):
            raise InvalidArgument(f"{name}: {len(msg.data)} bytes of sign bits for {n} elements "
                                  f"(expected {math.ceil(n / 8)})")
        if len(msg.scales) != 4 * nb:
            raise InvalidArgument(f"{name}: {len(msg.scales)} bytes of scales for {n} elements in "
                                  f"blocks of {b} (expected {4 * nb})")
        scales = from_bytes(msg.scales, torch.float32, device)
        if finite and nonfinite([scales]):
            raise InvalidArgument(f"{name}: scales contain NaN or infinite values")
        if n == 0:
            return torch.zeros(shape, dtype=torch.float32, device=scales.device)
        packed = from_bytes(msg.data, torch.uint8, device)
        signs = unpack_signs(packed, n)
        return expand_scales(signs, scales, b).view(shape)
    dense = encoding_name(enc)
    if dense not in DENSE_DTYPES:
        raise InvalidArgument(f"{name}: unknown encoding {dense}")
    wire_dtype, _, itemsize = DENSE_DTYPES[dense]
    if len(msg.data) != n * itemsize:
        raise InvalidArgument(f"{name}: {len(msg.data)} bytes for shape {list(shape)} in "
                              f"{dense} (expected {n * itemsize})")
    if msg.scales or msg.block_size:
        raise InvalidArgument(f"{name}: block_size/scales are only valid with ENCODING_ONE_BIT")
    t = from_bytes(msg.data, wire_dtype, device).to(torch.float32).view(shape)
    if finite and nonfinite([t]):
        raise InvalidArgument(f"{name}: contains NaN or infinite values")
    return t


def payload_bytes(msgs: Iterable[tensor_pb2.CompressedTensor]) -> int:
    """Bytes of data + scales (the payload, without framing) of some messages."""
    return sum(len(m.data) + len(m.scales) for m in msgs)


class ErrorFeedback(compression.ErrorFeedback):
    """``amprl.compression.ErrorFeedback`` (the residuals and the preconditioner, described
    there) answering each step as the CompressedTensor messages a learner pushes.
    ``encoding`` may also be the wire enum."""

    def __init__(self, encoding: str | int = "onebit", *args, **kwargs):
        super().__init__(encoding_name(encoding_value(encoding)), *args, **kwargs)

    # It answers messages where the base answers Encoded: a deliberate override (a sender
    # holds this class, never the base), so its return type differs.
    def compress(  # type: ignore[override]
            self, grads: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
            *, known_finite: bool = False) -> list[tensor_pb2.CompressedTensor]:
        """``compression.ErrorFeedback.compress``, as messages."""
        return [encoded_to_proto(e) for e in super().compress(grads, known_finite=known_finite)]

    encode = compress  # type: ignore[assignment]  # as compress
