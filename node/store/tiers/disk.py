"""The disk tier: one file per expert, published atomically, within a byte budget.

Layout: `$EXPERTMESH_HOME/experts/{ns}--{name}/{commit}/{layer}/{expert}.bin` holding the
expert's upstream bytes (its ranges concatenated). A file is written under a temporary name and
renamed into place, so a crash leaves either the whole expert or debris that start-up deletes;
a file whose size is not the expert's size, or that has no recorded sha256, is never served (the
store checks the digest of every file it reads). Least recently used files go first when the
budget is reached. An expert's bytes are counted against the budget from the moment its write is
reserved, and its file is renamed into place under the same lock that evicts: a write whose
reservation was evicted meanwhile drops its temporary file instead of publishing an expert the
accounting no longer holds, so the published files never exceed the budget. Reads are positional
reads into a preallocated buffer (`os.preadv`), which release the interpreter lock, so the fetch
threads read in parallel.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path

from expertmesh.node.hub import local_models
from expertmesh.node.hub.expert_index import ExpertIndex, ExpertLocation
from expertmesh.node.store.integrity import DigestBook

logger = logging.getLogger(__name__)

TMP_SUFFIX = ".tmp"


def cache_dir(home: Path, repo_id: str, commit: str) -> Path:
    return home / "experts" / local_models.repo_folder(repo_id) / commit


class DiskCache:
    """The disk tier of one pinned model (see the module's docstring); a `Tier` (store/tiers)."""

    source = "disk"
    local = True

    def __init__(self, root: Path, index: ExpertIndex, budget_bytes: int, digests: DigestBook):
        self.root = root
        self.index = index
        self.digests = digests
        self.budget_bytes = budget_bytes
        self._files: OrderedDict[tuple[int, int], int] = OrderedDict()  # key -> size, LRU first
        self._writing: set[tuple[int, int]] = set()  # reserved in _files, file not yet in place
        self._lock = threading.Lock()
        self.nbytes = 0
        self.evictions = 0
        self.write_errors = 0
        self._recover()

    def _path(self, layer: int, expert: int) -> Path:
        return self.root / str(layer) / f"{expert}.bin"

    def _recover(self) -> None:
        """Delete debris of interrupted writes, files of the wrong size or without a digest; list the rest."""
        self.root.mkdir(parents=True, exist_ok=True)
        found = []
        for path in self.root.glob("*/*"):
            try:
                if path.is_dir():
                    logger.warning("disk cache: ignoring the stray folder %s", path)
                    continue
                if path.name.endswith(TMP_SUFFIX) or not path.name.endswith(".bin"):
                    path.unlink()
                    continue
                key = (int(path.parent.name), int(path.stem))
                st = path.stat()
                if (
                    key not in self.index.experts
                    or st.st_size != self.index.expert(*key).nbytes
                    or not self.digests.persisted(key)
                ):
                    path.unlink()
                    continue
                found.append((st.st_mtime, key, st.st_size))
            except (OSError, ValueError):
                logger.warning("disk cache: removing unreadable entry %s", path)
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
        for _, key, size in sorted(found):
            self._files[key] = size
            self.nbytes += size

    def __len__(self) -> int:
        return len(self._files)

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self._files and key not in self._writing

    def has_room(self, nbytes: int) -> bool:
        """Whether `nbytes` more fit the budget without evicting anything (warming never evicts)."""
        with self._lock:
            return self.nbytes + nbytes <= self.budget_bytes

    def fetch(self, loc: ExpertLocation) -> bytearray | None:
        key = (loc.layer, loc.expert)
        with self._lock:
            if key not in self._files or key in self._writing:
                return None
            self._files.move_to_end(key)
        blob = bytearray(loc.nbytes)
        try:
            got = _pread_into(self._path(*key), blob)
        except FileNotFoundError:
            got = -1
        if got != loc.nbytes:
            self._forget(key)
            return None
        return blob

    def discard(self, loc: ExpertLocation) -> None:
        """Delete a copy that failed its check."""
        self._forget((loc.layer, loc.expert))

    def close(self) -> None:
        """Nothing to stop: every write is published or dropped before `put` returns."""

    def put(self, loc: ExpertLocation, blob: bytes) -> None:
        key = (loc.layer, loc.expert)
        size = len(blob)
        if size > self.budget_bytes or not self.digests.persisted(key):
            return
        with self._lock:
            if key in self._files:
                return
            while self._files and self.nbytes + size > self.budget_bytes:
                old, old_size = self._files.popitem(last=False)
                self.nbytes -= old_size
                self.evictions += 1
                self._writing.discard(old)  # its writer sees the reservation gone and drops its file
                self._path(*old).unlink(missing_ok=True)
            self._files[key] = size  # reserved now, so a concurrent put does not overshoot
            self._writing.add(key)
            self.nbytes += size
        path = self._path(*key)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(blob)
            with self._lock:  # a rename is cheap; under the lock it cannot race an eviction
                if key in self._writing:
                    os.replace(tmp, path)
                    self._writing.discard(key)
                    return
            tmp.unlink(missing_ok=True)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            self._forget(key)
            self.write_errors += 1
            level = logging.WARNING if e.errno in (errno.ENOSPC, errno.EDQUOT) else logging.ERROR
            logger.log(level, "disk cache: could not keep expert %s (%s); continuing without it", key, e.strerror)

    def _forget(self, key: tuple[int, int]) -> None:
        with self._lock:
            size = self._files.pop(key, None)
            if size is not None:
                self.nbytes -= size
            self._writing.discard(key)
            self._path(*key).unlink(missing_ok=True)


def _pread_into(path: Path, buf: bytearray) -> int:
    """Fill `buf` from the start of `path`; returns the bytes read (less than asked: too short)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        view = memoryview(buf)
        done = 0
        while done < len(buf):
            n = os.preadv(fd, [view[done:]], done)
            if n == 0:
                break
            done += n
        if done == len(buf) and os.pread(fd, 1, done):  # longer than the expert: not ours
            return -1
        return done
    finally:
        os.close(fd)
