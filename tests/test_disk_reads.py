"""Reading an expert file with several positional reads in flight gives exactly the bytes one plain
read gives, whatever the fan-out, alignment and size; a file of the wrong size is refused before it
is read; and a pooled buffer is lent again only once nothing refers to it."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np
import pytest

from expertmesh.devtools.tiny import k3_proportions
from expertmesh.node.store.buffers import MMAP_MIN_BYTES, BufferPool
from expertmesh.node.store.disk_reads import DiskReadConfig, DiskReader, WrongSize, pieces

EXPERT = k3_proportions.SMALL.expert_bytes  # 1,671,168 bytes: a multi-MB expert, at test scale
SIZES = (EXPERT, 3 * 4096 + 1, 5 * 1024 * 1024 + 17)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("reads")
    out = {}
    for size in SIZES:
        path = root / f"{size}.bin"
        path.write_bytes(os.urandom(size))
        out[size] = path
    return out


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("fanout", [1, 2, 4, 7])
@pytest.mark.parametrize("align", [4096, 1024 * 1024])
def test_fanned_out_reads_return_the_bytes_of_a_plain_read(files, size: int, fanout: int, align: int) -> None:
    reader = DiskReader(DiskReadConfig(fanout=fanout, align_bytes=align, threads=3))
    try:
        got = reader.read(files[size], size)
        assert len(got) == size and got == files[size].read_bytes()
    finally:
        reader.close()


@pytest.mark.parametrize("size", [1, 4095, 4096, EXPERT, 17_547_264])
@pytest.mark.parametrize("fanout", [1, 3, 4, 16])
def test_pieces_cover_the_file_once_each_starting_aligned(size: int, fanout: int) -> None:
    align = 2 * 1024 * 1024 if size > EXPERT else 4096
    parts = pieces(size, fanout, align)
    assert 1 <= len(parts) <= fanout
    assert parts[0][0] == 0 and parts[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))  # contiguous, no overlap
    assert all(s % align == 0 and s < e for s, e in parts)


def test_dropping_the_page_cache_reads_the_same_bytes(files) -> None:
    reader = DiskReader(DiskReadConfig(page_cache="drop"))
    try:
        assert reader.read(files[EXPERT], EXPERT) == files[EXPERT].read_bytes()
    finally:
        reader.close()


def test_a_short_or_long_file_is_refused_and_a_closed_reader_still_reads(files, tmp_path: Path) -> None:
    reader = DiskReader(DiskReadConfig(fanout=4, align_bytes=4096))
    data = files[EXPERT].read_bytes()
    short, long = tmp_path / "short.bin", tmp_path / "long.bin"
    short.write_bytes(data[:-1])
    long.write_bytes(data + b"\0")
    with pytest.raises(WrongSize):
        reader.read(short, EXPERT)
    with pytest.raises(WrongSize):
        reader.read(long, EXPERT)
    with pytest.raises(FileNotFoundError):
        reader.read(tmp_path / "missing.bin", EXPERT)
    reader.close()
    assert reader.read(files[EXPERT], EXPERT) == data  # on the calling thread now


def test_bad_settings_are_refused() -> None:
    for bad in ({"fanout": 0}, {"align_bytes": 1000}, {"page_cache": "sometimes"}):
        with pytest.raises(ValueError):
            DiskReadConfig(**bad)


def test_a_pooled_buffer_is_lent_again_only_when_no_view_of_it_is_left() -> None:
    pool = BufferPool(max_idle_buffers=3)
    first = pool.lend(MMAP_MIN_BYTES)
    first[:4] = b"keep"
    as_array = np.frombuffer(first, dtype=np.uint8)[2:]  # what the codec makes of a blob
    part = first[:4]
    del first
    gc.collect()
    second = pool.lend(MMAP_MIN_BYTES)  # the first is still referred to: a new one
    second[:4] = b"next"
    assert bytes(part) == b"keep" and bytes(as_array[:2]) == b"ep" and pool.allocated == 2
    del part, as_array
    gc.collect()
    assert pool.idle_bytes == MMAP_MIN_BYTES
    third = pool.lend(MMAP_MIN_BYTES)
    assert pool.reused == 1 and pool.allocated == 2 and len(third) == MMAP_MIN_BYTES
    del second, third
    gc.collect()
    assert pool.idle_bytes == 2 * MMAP_MIN_BYTES
    too_many = [pool.lend(2 * MMAP_MIN_BYTES) for _ in range(3)]
    del too_many
    gc.collect()
    assert pool.idle_bytes == 2 * MMAP_MIN_BYTES + (
        2 * MMAP_MIN_BYTES
    )  # 3 idle at most: one 2 MB buffer kept, two unmapped
