"""Conversion between NumPy arrays and ``amprl.v1.Tensor``.

bfloat16 has no NumPy dtype: it travels as DTYPE_BFLOAT16 and is held in NumPy as the raw
``uint16`` bit patterns (``amprl.compression`` turns those into torch tensors).
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import DTypeLike

from amprl.errors import InvalidArgument
from amprl.v1 import tensor_pb2

# proto enum value -> little-endian NumPy dtype
DTYPES: dict[int, np.dtype] = {
    tensor_pb2.DTYPE_FLOAT32: np.dtype("<f4"),
    tensor_pb2.DTYPE_FLOAT16: np.dtype("<f2"),
    tensor_pb2.DTYPE_BFLOAT16: np.dtype("<u2"),
    tensor_pb2.DTYPE_FLOAT64: np.dtype("<f8"),
    tensor_pb2.DTYPE_UINT8: np.dtype("u1"),
    tensor_pb2.DTYPE_INT32: np.dtype("<i4"),
    tensor_pb2.DTYPE_INT64: np.dtype("<i8"),
    tensor_pb2.DTYPE_BOOL: np.dtype("u1"),
}
_BY_NUMPY: dict[np.dtype, tensor_pb2.DType.ValueType] = {
    np.dtype("<f4"): tensor_pb2.DTYPE_FLOAT32,
    np.dtype("<f2"): tensor_pb2.DTYPE_FLOAT16,
    np.dtype("<f8"): tensor_pb2.DTYPE_FLOAT64,
    np.dtype("u1"): tensor_pb2.DTYPE_UINT8,
    np.dtype("<i4"): tensor_pb2.DTYPE_INT32,
    np.dtype("<i8"): tensor_pb2.DTYPE_INT64,
    np.dtype("bool"): tensor_pb2.DTYPE_BOOL,
}


def dtype_name(dtype: tensor_pb2.DType.ValueType) -> str:
    return tensor_pb2.DType.Name(dtype) if dtype in tensor_pb2.DType.values() else str(dtype)


def tensor_to_proto(array: np.ndarray, out: tensor_pb2.Tensor | None = None) -> tensor_pb2.Tensor:
    """Encodes ``array`` (any supported dtype) into ``out`` (or a new Tensor)."""
    array = np.asarray(array)
    dt = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    try:
        code = _BY_NUMPY[np.dtype(dt)]
    except KeyError:
        raise InvalidArgument(f"dtype {array.dtype} has no wire encoding; use one of "
                              f"{sorted(str(d) for d in _BY_NUMPY)}") from None
    t = out if out is not None else tensor_pb2.Tensor()
    t.dtype = code
    t.shape[:] = array.shape
    t.data = np.ascontiguousarray(array, dtype=dt).tobytes()
    return t


def tensor_from_proto(t: tensor_pb2.Tensor, name: str = "tensor", *,
                      dtype: DTypeLike | None = None, ndim: int | None = None,
                      finite: bool = False) -> np.ndarray:
    """Decodes a Tensor into a read-only NumPy view of its bytes, validating it.

    Raises InvalidArgument naming ``name`` when the dtype is unknown or not ``dtype``, the
    byte count disagrees with the shape, the rank is not ``ndim``, or (``finite``) any
    element is NaN or infinite.
    """
    if t.dtype not in DTYPES:
        raise InvalidArgument(f"{name}: unknown dtype {dtype_name(t.dtype)}")
    dt = DTYPES[t.dtype]
    if dtype is not None and np.dtype(dtype) != dt:
        raise InvalidArgument(f"{name}: dtype {dtype_name(t.dtype)}, expected {np.dtype(dtype)}")
    shape = tuple(int(s) for s in t.shape)
    if any(s < 0 for s in shape):
        raise InvalidArgument(f"{name}: negative dimension in shape {shape}")
    if ndim is not None and len(shape) != ndim:
        raise InvalidArgument(f"{name}: rank {len(shape)} (shape {shape}), expected rank {ndim}")
    n = math.prod(shape)  # exact: an int64 product of [2**32, 2**32] would wrap to 0
    if math.prod(s for s in shape if s) * dt.itemsize > np.iinfo(np.intp).max:
        # no elements, yet dimensions no array can have (NumPy refuses shape [0, 2**62])
        raise InvalidArgument(f"{name}: shape {shape} is larger than any array")
    if len(t.data) != n * dt.itemsize:
        raise InvalidArgument(f"{name}: {len(t.data)} bytes for shape {shape} of "
                              f"{dtype_name(t.dtype)} (expected {n * dt.itemsize})")
    array = np.frombuffer(t.data, dtype=dt).reshape(shape)
    if t.dtype == tensor_pb2.DTYPE_BOOL:
        array = array.view(np.bool_)
    if finite and dt.kind == "f" and not np.isfinite(array).all():
        raise InvalidArgument(f"{name}: contains NaN or infinite values")
    return array
