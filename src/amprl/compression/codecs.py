"""One tensor's encodings, as plain tensor maths: fp32, fp16, bf16 and 1-bit sign + block scale.

The 1-bit compressor (signSGD with error feedback, Seide et al. 2014; Karimireddy et al.
2019) sends, for a tensor ``e`` of n elements, one sign bit per element and one fp32 scale
per block of ``block_size`` consecutive elements::

    data[j]   bit (7 - i % 8) of byte i // 8  =  1 if e[i] >= 0 else 0     (MSB first)
    scales[k] = mean |e| over block k            (the last block may be shorter)
    D(C(e))[i] = (+1 if bit else -1) * scales[i // block_size]

so a tensor costs n/8 + 4*ceil(n/block_size) bytes instead of 4n: with the default block
of 2048 elements that is 1/32 + 1/2048 of fp32, about 1/31.5. The scale ``mean |e|`` is
the one that minimises ||e - s*sign(e)||_2 over s, block by block. The residual the sender
keeps (``amprl.compression.feedback.ErrorFeedback``) makes the compression error a delay
rather than a loss.

Everything runs as whole-tensor torch operations on the tensor's own device (CUDA or CPU);
bytes are produced only at the end (one device -> host copy per tensor). An encoded tensor
is an ``Encoded`` (its bytes and what reading them back needs); ``amprl.wire.compressed``
carries it as an ``amprl.v1.CompressedTensor``, so nothing here knows protobuf.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Sequence

import torch

from amprl.errors import InvalidArgument

if sys.byteorder != "little":  # the wire is little-endian; tobytes() writes native order
    raise ImportError("amprl.compression assumes a little-endian host")

DEFAULT_BLOCK_SIZE = 2048
"""Elements per scale of the 1-bit encoding. The scale overhead is 32/block bits per
element: 256 would cost 12.5% on top of the sign bits and miss the 1/30-of-fp32 target
(1/32 + 1/256 = 1/28.4); 2048 costs 1.6% (1/31.5) and still adapts the scale to each
slice of a large layer (one 256-wide row pair of an MLP layer, 1/8 of a conv filter bank)."""

DEFAULT_MIN_ELEMENTS = 64
"""Tensors with fewer elements travel dense fp32 (and keep no residual). Below ~64 elements
the framing of a message (name, shape, tags: ~30 bytes) outweighs what 1 bit saves, and
these are output-layer biases, where sign noise is least welcome. Larger biases (256 wide in
TD3) stay 1-bit: dense fp32 they alone would be ~20% of a whole TD3 push at 1/30 of fp32."""

ENCODING_NAMES = ("fp32", "fp16", "bf16", "onebit")
"""The encodings, by the names the config uses."""

DENSE_DTYPES: dict[str, tuple[torch.dtype, torch.dtype, int]] = {
    # encoding -> (torch dtype on the wire, same-width integer view, bytes per element)
    "fp32": (torch.float32, torch.int32, 4),
    "fp16": (torch.float16, torch.int16, 2),
    "bf16": (torch.bfloat16, torch.int16, 2),
}


def check_encoding(encoding: str) -> str:
    """``encoding`` if it names an encoding; InvalidArgument otherwise."""
    if encoding not in ENCODING_NAMES:
        raise InvalidArgument(f"unknown encoding {encoding!r}; use one of {sorted(ENCODING_NAMES)}")
    return encoding


@dataclass(frozen=True)
class Encoded:
    """One tensor as the compressor sends it: the bytes, and what reading them back needs."""

    name: str
    encoding: str
    """One of ``ENCODING_NAMES``."""
    shape: tuple[int, ...]
    data: bytes
    """Dense: the elements in the encoding's dtype, little-endian. 1-bit: the sign bits."""
    scales: bytes = b""
    """1-bit only: one little-endian fp32 scale per block."""
    block_size: int = 0
    """1-bit only: elements per scale."""
    preconditioned: bool = False
    """The sender divided the tensor by its running RMS first (``ErrorFeedback``)."""


_FP16_MAX = 65504.0


def to_wire(t: torch.Tensor, wire_dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``wire_dtype``; fp16 saturates at +-65504 (NaN stays NaN)."""
    if wire_dtype == torch.float16:
        t = t.clamp(-_FP16_MAX, _FP16_MAX)  # saturate; NaN stays NaN
    return t.to(wire_dtype)


def to_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().cpu().numpy().tobytes()


def from_bytes(data: bytes, dtype: torch.dtype, device: torch.device | str | None) -> torch.Tensor:
    """A flat tensor of ``dtype`` read from ``data`` (a copy), on ``device`` (CPU if None)."""
    # bytearray: torch.frombuffer needs a writable buffer; the copy also detaches the
    # tensor from the (immutable) bytes it came in.
    t = torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)
    return t if device is None else t.to(device)


# ---------------------------------------------------------------------------------------
# 1-bit: pure tensor functions (device in, device out)


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """uint8 0/1 flat tensor -> bytes, 8 per byte, element 0 in bit 7; zero padding."""
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.nn.functional.pad(bits, (0, pad))
    b = bits.view(-1, 8)
    out = b[:, 0] << 7
    for j in range(1, 8):  # 8 whole-column operations, not a loop over elements
        out |= b[:, j] << (7 - j)
    return out


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Packs ``x >= 0`` of a tensor (flattened) into uint8, 8 per byte, MSB first."""
    return _pack_bits((x.reshape(-1) >= 0).to(torch.uint8))


def unpack_signs(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of ``pack_signs``: a float32 tensor of n values in {-1, +1}."""
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=packed.device)
    bits = (packed.view(-1, 1) >> shifts) & 1
    return bits.view(-1)[:n].to(torch.float32) * 2.0 - 1.0


def block_scales(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """mean |x| over consecutive blocks of ``block_size`` elements (the last may be shorter)."""
    n = x.numel()
    nb = max(1, math.ceil(n / block_size))
    a = x.reshape(-1).abs().to(torch.float32)
    pad = nb * block_size - n
    if pad:
        a = torch.nn.functional.pad(a, (0, pad))
    sums = a.view(nb, block_size).sum(dim=1)
    counts = torch.full((nb,), float(block_size), dtype=torch.float32, device=x.device)
    counts[-1] = float(n - (nb - 1) * block_size) if n else 1.0
    return sums / counts


def expand_scales(signs: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    """signs[i] * scales[i // block_size] for a flat tensor of signs."""
    n = signs.numel()
    nb = scales.numel()
    pad = nb * block_size - n
    s = torch.nn.functional.pad(signs, (0, pad)) if pad else signs
    return (s.view(nb, block_size) * scales.view(nb, 1)).view(-1)[:n]


def onebit_compress(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed sign bytes, fp32 scales, the decoded approximation) of ``x``, all on x's device."""
    flat = x.detach().reshape(-1).to(torch.float32)
    bits = (flat >= 0).to(torch.uint8)
    packed = _pack_bits(bits)
    scales = block_scales(flat, block_size)
    signs = bits.to(torch.float32) * 2.0 - 1.0
    approx = expand_scales(signs, scales, block_size).view(x.shape)
    return packed, scales, approx


def encode_tensor(name: str, tensor: torch.Tensor, encoding: str = "fp32",
                  block_size: int = DEFAULT_BLOCK_SIZE) -> Encoded:
    """Encodes a float tensor (any device) named ``name``.

    fp16 saturates at +-65504 (larger magnitudes are clamped, never sent as inf); bf16
    keeps fp32's range with 8 bits of mantissa. NaN/Inf inputs are encoded as they are (the
    receiver rejects them).
    """
    check_encoding(encoding)
    if not tensor.is_floating_point():
        raise InvalidArgument(f"{name}: dtype {tensor.dtype} is not a floating-point type")
    t = tensor.detach()
    shape = tuple(tensor.shape)
    if encoding == "onebit":
        if block_size < 1:
            raise InvalidArgument(f"{name}: block_size ({block_size}) must be >= 1")
        flat = t.reshape(-1).to(torch.float32)
        packed, scales = pack_signs(flat), block_scales(flat, block_size)
        return Encoded(name, encoding, shape, to_bytes(packed), to_bytes(scales), block_size)
    wire_dtype, int_view, _ = DENSE_DTYPES[encoding]
    return Encoded(name, encoding, shape, to_bytes(to_wire(t.reshape(-1), wire_dtype).view(int_view)))


def nonfinite(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Indices of the floating-point ``tensors`` that hold a NaN or an infinity, with one
    device sync.

    A fused L2 norm of each tensor comes first: a NaN or an infinity makes the norm NaN or
    infinite, so a finite norm proves the tensor finite. The norm is one vectorised
    reduction, where ``isfinite(t).all()`` writes a bool tensor and reduces it again,
    several times the cost on a CPU. Only a tensor whose norm is not finite -- a NaN or
    infinity, or finite values so large that the norm overflows -- gets the exact
    elementwise check.
    """
    tensors = [t.detach() for t in tensors]
    if not tensors:
        return []
    norms = torch.stack([n.float() for n in torch._foreach_norm(tensors)])
    suspects = torch.nonzero(~torch.isfinite(norms)).flatten().tolist()
    return [i for i in suspects if not bool(torch.isfinite(tensors[i]).all())]


__all__ = [
    "DEFAULT_BLOCK_SIZE", "DEFAULT_MIN_ELEMENTS", "DENSE_DTYPES", "ENCODING_NAMES", "Encoded",
    "block_scales", "check_encoding", "encode_tensor", "expand_scales", "from_bytes", "nonfinite",
    "onebit_compress", "pack_signs", "to_bytes", "to_wire", "unpack_signs",
]
