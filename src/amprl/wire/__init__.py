"""Tensors <-> protobuf messages. Raw little-endian buffers only; nothing is pickled."""

from amprl.wire.tensors import DTYPES, tensor_from_proto, tensor_to_proto

__all__ = ["DTYPES", "tensor_from_proto", "tensor_to_proto"]
