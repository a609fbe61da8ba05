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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

# Safetensors refuses headers larger than this; so do we, before allocating anything.
MAX_HEADER_BYTES = 100 * 1024 * 1024

# Bits of one element of every dtype the format defines: the `Dtype` enum of huggingface/safetensors
# (the 22 its 0.8 release accepts, sized as its `bitsize` sizes them). Sub-byte dtypes (F4, the F6s)
# are packed: a tensor takes its element count times its bits, in bytes, and the format does not
# round: a tensor whose bits do not end on a byte boundary is refused (its `MisalignedSlice`).
DTYPE_BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
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


def tensor_nbytes(dtype: str, shape: tuple[int, ...] | list[int]) -> int:
    """The bytes a tensor of `dtype` and `shape` takes in a file (see DTYPE_BITS).

    Raises:
        SafetensorsFormatError: a dtype the format does not define, or a sub-byte tensor whose
            bits do not fill whole bytes.
    """
    bits = DTYPE_BITS.get(dtype)
    if bits is None:
        raise SafetensorsFormatError(f"unknown dtype {_shown(dtype)}")
    count = 1
    for d in shape:
        count *= d
    if count * bits % 8:
        raise SafetensorsFormatError(f"{count} elements of {dtype} ({bits} bits each) do not end on a byte boundary")
    return count * bits // 8


def header_length(prefix: bytes | bytearray) -> int:
    """The JSON header's length, from the first 8 bytes of a file."""
    if len(prefix) < 8:
        raise SafetensorsFormatError("file shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise SafetensorsFormatError(f"header of {n} bytes is larger than allowed")
    return n


def parse_header(header: bytes | bytearray, file_size: int | None = None) -> tuple[dict[str, TensorEntry], dict]:
    """Parse the JSON header (without its 8-byte length) into entries with absolute offsets.

    The header comes from the network: every value is checked for its type before it is used,
    so a malformed one is a `SafetensorsFormatError` (which callers report as "not a valid
    safetensors file"), never a TypeError from deep inside, and no tensor can claim bytes that
    another tensor, the header or the space past the file holds.

    Returns:
        `(tensors by name, the `__metadata__` dict)`.

    Raises:
        SafetensorsFormatError: malformed JSON, unknown dtype, dimensions or offsets that are not
            non-negative integers, sizes that disagree with the shape, tensors that overlap, or
            offsets past `file_size`.
    """
    try:
        raw = json.loads(header)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsFormatError(f"header is not JSON: {e}") from None
    except RecursionError:  # `[[[[...` nested past Python's recursion limit
        raise SafetensorsFormatError("header is nested too deeply") from None
    if not isinstance(raw, dict):
        raise SafetensorsFormatError("header is not a JSON object")
    metadata = raw.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise SafetensorsFormatError("__metadata__ is not a JSON object")
    base = 8 + len(header)
    tensors: dict[str, TensorEntry] = {}
    for name, info in raw.items():
        dtype, shape, (a, b) = _checked_entry(name, info)
        if file_size is not None and base + b > file_size:
            raise SafetensorsFormatError(f"tensor {_shown(name)} extends past the end of the file")
        tensors[name] = TensorEntry(name, dtype, shape, base + a, base + b)
    _check_disjoint(tensors.values())
    return tensors, metadata


def _shown(value: object, limit: int = 80) -> str:
    """A value from a header, quoted and cut short: an error message stays one readable line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_count(x: object) -> bool:
    """A non-negative JSON integer (a bool is an int to Python, not to the format)."""
    return type(x) is int and x >= 0


def _checked_entry(name: str, info: object) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    """`(dtype, shape, (start, end))` of one header entry, relative to the data section."""
    if not isinstance(info, dict):
        raise SafetensorsFormatError(f"tensor {_shown(name)} has a malformed entry")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise SafetensorsFormatError(f"tensor {_shown(name)} has unknown dtype {_shown(dtype)}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise SafetensorsFormatError(
            f"tensor {_shown(name)}: shape {_shown(shape)} is not a list of non-negative integers"
        )
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(x) for x in offsets):
        raise SafetensorsFormatError(
            f"tensor {_shown(name)}: data_offsets {_shown(offsets)} is not a pair of non-negative integers"
        )
    a, b = offsets
    try:
        nbytes = tensor_nbytes(dtype, shape)
    except SafetensorsFormatError as e:
        raise SafetensorsFormatError(f"tensor {_shown(name)}: {e}") from None
    if b - a != nbytes:
        raise SafetensorsFormatError(f"tensor {_shown(name)}: offsets disagree with its shape")
    return dtype, tuple(shape), (a, b)


def _check_disjoint(entries: Iterable[TensorEntry]) -> None:
    """No two tensors share a byte: sorted by start, each starts at or after the one before ends."""
    previous: TensorEntry | None = None
    for e in sorted(entries, key=lambda e: (e.start, e.end)):
        if previous is not None and e.start < previous.end:
            raise SafetensorsFormatError(f"tensors {_shown(previous.name)} and {_shown(e.name)} overlap")
        previous = e


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


class MadeBytes(Protocol):
    """Bytes of a known length made when they are written (a tiny maker's K3-sized expert)."""

    def __len__(self) -> int: ...

    def __bytes__(self) -> bytes: ...


def write_file(
    path: Path,
    tensors: Sequence[tuple[str, str, tuple[int, ...], bytes | bytearray | memoryview | MadeBytes]],
    metadata: dict | None = None,
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
