"""Tensor encodings for the wire: fp32/fp16/bf16 and 1-bit signs with block scales, plus
the sender-side error feedback that makes 1-bit gradients converge (see ``codecs``)."""

from amprl.compression.codecs import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MIN_ELEMENTS,
    ENCODINGS,
    ErrorFeedback,
    decode,
    encode,
    encoding_name,
    encoding_value,
    nonfinite,
    payload_bytes,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE", "DEFAULT_MIN_ELEMENTS", "ENCODINGS", "ErrorFeedback", "decode",
    "encode", "encoding_name", "encoding_value", "nonfinite", "payload_bytes",
]
