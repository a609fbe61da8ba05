"""Activation rows on the wire (the `Tensor` message): raw bytes, shape and dtype, checked on arrival.

Remote expert execution sends an expert's input rows to the node that holds the expert and gets
its output rows back. Both directions are a few KB per token, so they travel as raw C-order bytes
with no compression; bfloat16, which numpy lacks, travels as its 16-bit patterns. Anything that
arrives is checked against what the receiver expects before MLX sees it: a peer that sends the
wrong shape, dtype or length is caught here, not as a broadcasting error deep in a layer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from expertmesh.node.engine.host_view import host_view
from expertmesh.v1 import node_pb2

DTYPES: dict[str, tuple[mx.Dtype, np.dtype]] = {  # wire name -> (MLX dtype, numpy carrier)
    "float32": (mx.float32, np.dtype("<f4")),
    "float16": (mx.float16, np.dtype("<f2")),
    "bfloat16": (mx.bfloat16, np.dtype("<u2")),
}
_WIRE_NAMES = {mlx: name for name, (mlx, _) in DTYPES.items()}


class BadTensor(ValueError):
    """A Tensor message that does not hold what it should."""


def wire_dtype(dtype: mx.Dtype) -> str:
    try:
        return _WIRE_NAMES[dtype]
    except KeyError:
        raise BadTensor(f"activations of dtype {dtype} cannot be sent (only {', '.join(DTYPES)})") from None


def to_numpy(rows: mx.array) -> np.ndarray:
    """The rows' bytes as a C-ordered numpy array (evaluates them); bfloat16 as uint16 bit
    patterns, read without a device round trip of their own (engine/host_view.py)."""
    name = wire_dtype(rows.dtype)
    return np.ascontiguousarray(host_view(rows), dtype=DTYPES[name][1])


def encode(rows: mx.array | np.ndarray, dtype: str | None = None) -> node_pb2.Tensor:
    """A Tensor message of `rows` (an MLX array, or numpy bytes already converted by `to_numpy`
    with their wire `dtype`)."""
    if isinstance(rows, mx.array):
        dtype, rows = wire_dtype(rows.dtype), to_numpy(rows)
    return node_pb2.Tensor(shape=list(rows.shape), dtype=dtype, data=rows.tobytes())


def check(t: node_pb2.Tensor, width: int, dtype: str | None = None, rows: int | None = None) -> None:
    """That a Tensor message holds (n, width) rows as `decode` takes them; no MLX involved, so
    any thread may check a request before handing it to the MLX thread.

    Raises:
        BadTensor: not two-dimensional, another width or row count than expected, an unknown or
            unexpected dtype, or a byte length that does not match the shape.
    """
    if t.dtype not in DTYPES:
        # quoted in part: the whole string is the sender's to choose, and an error's text travels back
        # in a gRPC trailer, which a long one would push past the metadata limit
        raise BadTensor(f"unknown dtype {t.dtype[:32]!r} (expected one of {', '.join(DTYPES)})")
    if dtype is not None and t.dtype != dtype:
        raise BadTensor(f"dtype {t.dtype}, expected {dtype}")
    shape = tuple(t.shape)
    if len(shape) != 2 or shape[1] != width or shape[0] == 0 or (rows is not None and shape[0] != rows):
        want = f"({rows if rows is not None else 'n'}, {width})"
        raise BadTensor(f"shape {shape}, expected {want}")
    if len(t.data) != math.prod(shape) * DTYPES[t.dtype][1].itemsize:
        raise BadTensor(f"{len(t.data)} bytes for shape {shape} of {t.dtype}")


def decode(t: node_pb2.Tensor, width: int, dtype: str | None = None, rows: int | None = None) -> mx.array:
    """The (n, width) MLX array a Tensor message holds.

    Raises:
        BadTensor: see `check`.
    """
    check(t, width, dtype, rows)
    mlx_dtype, carrier = DTYPES[t.dtype]
    arr = mx.array(np.frombuffer(t.data, dtype=carrier).reshape(tuple(t.shape)))
    return arr.view(mlx_dtype) if t.dtype == "bfloat16" else arr


def finite(t: node_pb2.Tensor) -> bool:
    """Whether every value of a Tensor message (checked by `check`) is finite, read from its
    bytes on the host: asked of the device, it would be a kernel and a wait for each answer."""
    values = np.frombuffer(t.data, dtype=DTYPES[t.dtype][1])
    if t.dtype == "bfloat16":  # all exponent bits set: an infinity or a NaN
        return not bool(np.any(values & 0x7F80 == 0x7F80))
    return bool(np.isfinite(values).all())


def take_rows(t: node_pb2.Tensor, index: Sequence[int]) -> node_pb2.Tensor:
    """The rows of a Tensor message (checked by `check`) at `index`, in that order, as a message
    of their own: an expert's rows out of a call's shared rows."""
    values = np.frombuffer(t.data, dtype=DTYPES[t.dtype][1]).reshape(tuple(t.shape))
    picked = values[np.fromiter(index, dtype=np.int64, count=len(index))]
    return encode(np.ascontiguousarray(picked), t.dtype)


def as_float32(t: node_pb2.Tensor) -> np.ndarray:
    """A Tensor message's values (checked by `check`) as float32 on the host, bfloat16 widened
    from its bit patterns: for comparing answers without MLX, off its thread."""
    values = np.frombuffer(t.data, dtype=DTYPES[t.dtype][1]).reshape(tuple(t.shape))
    if t.dtype == "bfloat16":
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32)


def nbytes(t: node_pb2.Tensor) -> int:
    return len(t.data)
