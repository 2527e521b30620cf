"""Tensor encodings as plain tensor maths: fp32/fp16/bf16 and 1-bit signs with block
scales (``codecs``), plus the sender-side error feedback that makes 1-bit gradients
converge (``feedback``). The messages that carry them are ``amprl.wire.compressed``."""

from amprl.compression.codecs import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MIN_ELEMENTS,
    ENCODING_NAMES,
    Encoded,
    encode_tensor,
    nonfinite,
)
from amprl.compression.feedback import ErrorFeedback

__all__ = [
    "DEFAULT_BLOCK_SIZE", "DEFAULT_MIN_ELEMENTS", "ENCODING_NAMES", "Encoded", "ErrorFeedback",
    "encode_tensor", "nonfinite",
]
