"""The safetensors container, at the byte level.

expertmesh addresses tensors by byte range inside upstream shards, and writes shards whose
tensor order it chooses (experts contiguous, like the upstream checkpoints), which the
`safetensors` library does not let us do. The format is tiny: an 8-byte little-endian header
length, a JSON header mapping each tensor to its dtype, shape and `data_offsets` relative to
the end of the header, then the data.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# Safetensors refuses headers larger than this; so do we, before allocating anything.
MAX_HEADER_BYTES = 100 * 1024 * 1024

DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


class SafetensorsFormatError(ValueError):
    """The bytes are not a well-formed safetensors header."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a shard, with offsets absolute in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the first byte in the file
    end: int  # absolute byte offset one past the last byte

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def header_length(prefix: bytes) -> int:
    """The JSON header's length, from the first 8 bytes of a file."""
    if len(prefix) < 8:
        raise SafetensorsFormatError("file shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise SafetensorsFormatError(f"header of {n} bytes is larger than allowed")
    return n


def parse_header(header: bytes, file_size: int | None = None) -> tuple[dict[str, TensorEntry], dict]:
    """Parse the JSON header (without its 8-byte length) into entries with absolute offsets.

    Returns:
        `(tensors by name, the `__metadata__` dict)`.

    Raises:
        SafetensorsFormatError: malformed JSON, unknown dtype, sizes that disagree with the
            shape, or offsets past `file_size`.
    """
    try:
        raw = json.loads(header)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsFormatError(f"header is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise SafetensorsFormatError("header is not a JSON object")
    metadata = raw.pop("__metadata__", None) or {}
    base = 8 + len(header)
    tensors: dict[str, TensorEntry] = {}
    for name, info in raw.items():
        try:
            dtype, shape, (a, b) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise SafetensorsFormatError(f"tensor {name!r} has a malformed entry") from None
        if dtype not in DTYPE_BYTES:
            raise SafetensorsFormatError(f"tensor {name!r} has unknown dtype {dtype!r}")
        count = 1
        for d in shape:
            count *= d
        if b - a != count * DTYPE_BYTES[dtype] or a < 0:
            raise SafetensorsFormatError(f"tensor {name!r}: offsets disagree with its shape")
        if file_size is not None and base + b > file_size:
            raise SafetensorsFormatError(f"tensor {name!r} extends past the end of the file")
        tensors[name] = TensorEntry(name, dtype, shape, base + a, base + b)
    return tensors, metadata


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors of a local safetensors file."""
    with open(path, "rb") as f:
        n = header_length(f.read(8))
        tensors, _ = parse_header(f.read(n), os.fstat(f.fileno()).st_size)
    return tensors


def encode_header(entries: Iterable[tuple[str, str, tuple[int, ...], int]], metadata: dict | None = None) -> bytes:
    """Header bytes (length prefix included) for tensors laid out in the given order.

    Args:
        entries: `(name, dtype, shape, nbytes)` in file order.
        metadata: string-to-string `__metadata__`.
    """
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the spec recommends 8-byte alignment of the data
    return struct.pack("<Q", len(text)) + text


def write_file(
    path: Path, tensors: list[tuple[str, str, tuple[int, ...], bytes]], metadata: dict | None = None
) -> None:
    """Write a safetensors file with the tensors in exactly this order (atomically)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(encode_header(((n, d, s, len(b)) for n, d, s, b in tensors), metadata))
        for *_, data in tensors:
            f.write(data if isinstance(data, bytes | bytearray | memoryview) else bytes(data))  # lazily made
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
