"""The disk tier's budget holds for the files on disk, not only for its own accounting, when
writes and evictions overlap (the fetch threads write concurrently)."""

from __future__ import annotations

import builtins
import errno
import os
import random
import threading
from pathlib import Path

import pytest

from expertmesh.node.model.expert_index import ExpertIndex, ExpertLocation, TensorSlice
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


def _churn(cache: DiskCache, locs: dict, blobs: dict, seed: int, wrong: list) -> None:
    r = random.Random(seed)
    keys = list(locs)
    for _ in range(150):
        key = r.choice(keys)
        if r.random() < 0.5:
            cache.put(locs[key], blobs[key], wait=r.random() < 0.3)
        else:
            got = cache.fetch(locs[key])
            if got is not None and bytes(got) != blobs[key]:
                wrong.append(key)


def test_concurrent_puts_reads_and_evictions_keep_files_and_accounting_equal(tmp_path: Path) -> None:
    """Write-behind under churn: an expert evicted while its write is queued or being published,
    and put again, neither leaves an unaccounted file nor stops the writer."""
    for trial in range(8):
        cache, locs, blobs = _cache(tmp_path / str(trial), count=40, budget_experts=5)
        cache.start()
        wrong: list = []
        threads = [threading.Thread(target=_churn, args=(cache, locs, blobs, trial * 10 + i, wrong)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        cache.flush()
        assert cache._writer.is_alive() and not wrong
        cache.close()
        on_disk = {(int(p.parent.name), int(p.stem)) for p in _files(cache)}
        assert on_disk == set(cache._files) and len(on_disk) * SIZE <= cache.budget_bytes


class _Owns:
    def __init__(self, mine: set) -> None:
        self.mine, self.version = mine, 0

    def owns(self, key) -> bool:
        return key in self.mine


def test_copies_of_others_experts_go_first_and_never_push_out_our_own(tmp_path: Path) -> None:
    cache, locs, blobs = _cache(tmp_path, count=8, budget_experts=4)
    ownership = _Owns({(1, 0), (1, 1), (1, 2)})
    cache.ownership = ownership
    for e in (0, 3, 1, 4):  # ours, theirs, ours, theirs: full
        cache.put(locs[(1, e)], blobs[(1, e)])
    cache.fetch(locs[(1, 3)])  # theirs, but most recently used
    cache.put(locs[(1, 2)], blobs[(1, 2)])  # ours: evicts the least recently used of theirs
    assert set(cache._files) == {(1, 0), (1, 1), (1, 2), (1, 3)}
    cache.put(locs[(1, 5)], blobs[(1, 5)])  # theirs: pushes out theirs only
    assert set(cache._files) == {(1, 0), (1, 1), (1, 2), (1, 5)}
    cache.put(locs[(1, 6)], blobs[(1, 6)])
    assert set(cache._files) == {(1, 0), (1, 1), (1, 2), (1, 6)}
    # the household changes: 6 is ours now, 0 no longer
    ownership.mine, ownership.version = {(1, 1), (1, 2), (1, 6), (1, 7)}, 1
    cache.put(locs[(1, 7)], blobs[(1, 7)])
    assert set(cache._files) == {(1, 1), (1, 2), (1, 6), (1, 7)}
    cache.put(locs[(1, 3)], blobs[(1, 3)])  # theirs, and only our own could make room: not kept
    assert (1, 3) not in cache and set(cache._files) == {(1, 1), (1, 2), (1, 6), (1, 7)}
    assert {(int(p.parent.name), int(p.stem)) for p in _files(cache)} == set(cache._files)


def test_an_expert_claimed_by_a_peer_is_kept_as_our_own(tmp_path: Path) -> None:
    """An expert a peer asked for as its owner (`claim`) is kept like one this node owns, though
    this node's view of the household names another owner: the peer counts on the copy."""
    cache, locs, blobs = _cache(tmp_path, count=6, budget_experts=3)
    cache.ownership = _Owns({(1, 0), (1, 1)})
    cache.put(locs[(1, 3)], blobs[(1, 3)])  # theirs, held before any claim
    for e in (0, 1):
        cache.put(locs[(1, e)], blobs[(1, e)])
    cache.claim((1, 2))
    cache.put(locs[(1, 2)], blobs[(1, 2)])  # claimed: pushes out theirs, not ours
    assert set(cache._files) == {(1, 0), (1, 1), (1, 2)}
    cache.claim((1, 0))  # already ours: nothing changes
    cache.put(locs[(1, 4)], blobs[(1, 4)])  # theirs, and only our own and the claimed could make room
    assert set(cache._files) == {(1, 0), (1, 1), (1, 2)}


def test_a_second_process_on_the_same_cache_reads_but_never_writes_or_evicts(tmp_path: Path) -> None:
    """One writer per cache folder (a flock, as a second `run` on the same home would meet it):
    the budget holds for both, and the second one takes over when the first closes."""
    first, locs, blobs = _cache(tmp_path, count=4, budget_experts=2)
    first.put(locs[(1, 0)], blobs[(1, 0)])
    second = DiskCache(first.root, first.index, first.budget_bytes, first.digests)
    assert bytes(second.fetch(locs[(1, 0)])) == blobs[(1, 0)]  # reads what it found
    second.put(locs[(1, 1)], blobs[(1, 1)])
    second.put(locs[(1, 2)], blobs[(1, 2)])
    assert (1, 1) not in second and [p.name for p in _files(first)] == ["0.bin"]  # wrote and evicted nothing
    first.close()
    second._retry_at = 0.0  # as DISK_RETRY_S later
    second.put(locs[(1, 3)], blobs[(1, 3)])
    assert (1, 3) in second and sorted(p.name for p in _files(second)) == ["0.bin", "3.bin"]
    second.close()


def test_a_refusing_disk_is_tried_again_later_and_a_failing_read_is_fetched_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, locs, blobs = _cache(tmp_path, count=3, budget_experts=3)
    real_replace = os.replace
    monkeypatch.setattr(disk_cache.os, "replace", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    cache.put(locs[(1, 0)], blobs[(1, 0)])
    assert cache.refused and cache.refusals == 1 and (1, 0) not in cache
    monkeypatch.setattr(disk_cache.os, "replace", real_replace)  # room again
    cache.put(locs[(1, 1)], blobs[(1, 1)])
    assert (1, 1) not in cache  # not before the retry time
    cache._retry_at = 0.0
    cache.put(locs[(1, 1)], blobs[(1, 1)])
    assert (1, 1) in cache and not cache.refused

    def eio(*_a):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(disk_cache.os, "preadv", eio)
    assert cache.fetch(locs[(1, 1)]) is None and cache.read_errors == 1 and (1, 1) not in cache
    cache.close()


def test_opening_the_cache_deletes_only_names_it_writes(tmp_path: Path) -> None:
    """A layer folder linked to another disk holds the user's files too: opening the cache once
    deleted everything in it that was not `N.bin` (found by an audit). Only the cache's own names
    are deleted now (debris of a write, a file of the wrong size), and a folder where an expert's
    file belongs is reported, not removed."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "my-notes.txt").write_text("mine")
    (outside / f"3.bin.1.2{TMP_SUFFIX}").write_bytes(b"debris of a write")
    (outside / "4.bin").write_bytes(b"short")  # the cache's name, the wrong size
    root = tmp_path / "cache"
    root.mkdir()
    (root / "1").symlink_to(outside, target_is_directory=True)
    (root / "notes").mkdir()
    (root / "notes" / "readme.txt").write_text("also mine")
    (outside / "5.bin").mkdir()
    (outside / "5.bin" / "inside.txt").write_text("in a folder named like an expert")

    cache, _, _ = _cache(tmp_path, count=8, budget_experts=8)

    assert (outside / "my-notes.txt").read_text() == "mine"
    assert (root / "notes" / "readme.txt").read_text() == "also mine"
    assert not (outside / f"3.bin.1.2{TMP_SUFFIX}").exists() and not (outside / "4.bin").exists()
    assert (outside / "5.bin" / "inside.txt").exists()
    assert [p.name for p in cache.stray_folders] == ["5.bin"]
    assert len(cache) == 0
    from expertmesh.node.store.maintenance import expert_files

    assert (1, 5) not in expert_files(root)  # `ls` and `cache` counted the folder as an expert
