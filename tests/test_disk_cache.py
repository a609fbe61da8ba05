"""The disk tier's budget holds for the files on disk, not only for its own accounting, when
writes and evictions overlap (the fetch threads write concurrently)."""

from __future__ import annotations

import builtins
import errno
import os
import threading
from pathlib import Path

import pytest

from expertmesh.node.hub.expert_index import ExpertIndex, ExpertLocation, TensorSlice
from expertmesh.node.store.integrity import DigestBook, sha256
from expertmesh.node.store.tiers import disk as disk_cache
from expertmesh.node.store.tiers.disk import TMP_SUFFIX, DiskCache

SIZE = 64


def _cache(root: Path, count: int, budget_experts: int) -> tuple[DiskCache, dict, dict]:
    locs = {
        (1, e): ExpertLocation(1, e, [TensorSlice(f"e{e}", "U8", (SIZE,), "f.safetensors", e * SIZE, (e + 1) * SIZE)])
        for e in range(count)
    }
    index = ExpertIndex("test/disk", "0" * 40, {"f.safetensors": SIZE * count}, {}, locs)
    digests = DigestBook(root / "digests.tsv")
    blobs = {key: bytes([key[1]]) * SIZE for key in locs}
    for key, blob in blobs.items():
        digests.record(key, sha256(blob))
    return DiskCache(root / "cache", index, budget_experts * SIZE, digests), locs, blobs


def _files(cache: DiskCache) -> list[Path]:
    return sorted(cache.root.glob("*/*.bin"))


def test_a_write_evicted_while_in_flight_is_not_published(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache, locs, blobs = _cache(tmp_path, count=6, budget_experts=2)
    real_open = builtins.open
    raced = []

    def open_then_race(path, *args, **kwargs):
        # while expert 0's bytes are being written, two other writes evict its reservation
        if not raced and str(path).endswith(TMP_SUFFIX) and Path(path).name.startswith("0.bin"):
            raced.append(path)
            cache.put(locs[(1, 1)], blobs[(1, 1)])
            cache.put(locs[(1, 2)], blobs[(1, 2)])
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(disk_cache, "open", open_then_race, raising=False)
    cache.put(locs[(1, 0)], blobs[(1, 0)])
    assert raced, "the race was not staged"
    assert [p.name for p in _files(cache)] == ["1.bin", "2.bin"]  # not 0.bin: its reservation was evicted
    assert cache.nbytes == 2 * SIZE and (1, 0) not in cache and cache.fetch(locs[(1, 0)]) is None
    assert not list(cache.root.glob(f"*/*{TMP_SUFFIX}"))
    assert bytes(cache.fetch(locs[(1, 2)])) == blobs[(1, 2)]


def test_an_expert_being_written_is_not_served_or_advertised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache, locs, blobs = _cache(tmp_path, count=3, budget_experts=3)
    real_open = builtins.open
    seen = []

    def open_and_look(path, *args, **kwargs):
        if str(path).endswith(TMP_SUFFIX):
            seen.append(((1, 0) in cache, cache.fetch(locs[(1, 0)])))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(disk_cache, "open", open_and_look, raising=False)
    cache.put(locs[(1, 0)], blobs[(1, 0)])
    assert seen == [(False, None)]
    assert (1, 0) in cache and bytes(cache.fetch(locs[(1, 0)])) == blobs[(1, 0)]  # and kept once written


def test_writes_behind_are_readable_at_once_and_published_by_flush(tmp_path: Path, monkeypatch) -> None:
    """Once started, `put` leaves the fetch path: the expert is held (and served from memory) at
    once, and its file appears when the writer publishes it."""
    cache, locs, blobs = _cache(tmp_path, count=3, budget_experts=3)
    cache.start()
    gate, written = threading.Event(), []
    real_write = cache._write

    def slow_write(key, blob):
        gate.wait(10)
        real_write(key, blob)
        written.append(key)

    monkeypatch.setattr(cache, "_write", slow_write)
    try:
        cache.put(locs[(1, 0)], blobs[(1, 0)])
        assert (1, 0) in cache and bytes(cache.fetch(locs[(1, 0)])) == blobs[(1, 0)]  # before any file exists
        assert not _files(cache) and not written
        gate.set()
        cache.flush()
        assert [p.name for p in _files(cache)] == ["0.bin"] and written == [(1, 0)]
    finally:
        gate.set()
        cache.close()


@pytest.mark.parametrize("refusal", [errno.ENOSPC, errno.EROFS])
def test_a_disk_that_refuses_writes_turns_the_tier_off_without_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refusal: int
) -> None:
    """A full or read-only disk: the write fails quietly, nothing half-written is left, and the tier
    keeps nothing more (no room), so generation goes on from the other tiers."""
    cache, locs, blobs = _cache(tmp_path, count=3, budget_experts=3)

    def refuse(*_args, **_kwargs):
        raise OSError(refusal, os.strerror(refusal))

    monkeypatch.setattr(disk_cache.os, "replace", refuse)
    cache.start()
    try:
        cache.put(locs[(1, 0)], blobs[(1, 0)])
        cache.flush()
        assert cache.refused and not cache.has_room(SIZE)
        assert (1, 0) not in cache and cache.fetch(locs[(1, 0)]) is None and cache.nbytes == 0
        cache.put(locs[(1, 1)], blobs[(1, 1)])  # ignored: the tier is off
        assert (1, 1) not in cache
        assert not list(cache.root.glob(f"*/*{TMP_SUFFIX}")) and not _files(cache)
    finally:
        cache.close()
