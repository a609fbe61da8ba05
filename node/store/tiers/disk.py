"""The disk tier: one file per expert, published atomically, within a byte budget.

Layout: `$EXPERTMESH_HOME/experts/{ns}--{name}/{commit}/{layer}/{expert}.bin` holding the
expert's upstream bytes (its ranges concatenated). A file is written under a temporary name and
renamed into place, so a crash leaves either the whole expert or debris that start-up deletes;
a file whose size is not the expert's size, or that has no recorded sha256, is never served (the
store checks the digest of every file it reads). Least recently used files go first when the
budget is reached, but in a household (`ownership` set) the copies of experts other nodes own go
first, and such a copy never pushes out one this node owns: an owner keeps what it owns whatever
its generations bring in. An expert a peer asked this node for as its owner (`claim`) counts as
its own from then on, whatever this node's view of the household says: the peer counts on it
being kept here, and the two views differ while their peer tables do. An expert's bytes are counted against the budget from the moment its write is
reserved, and its file is renamed into place under the same lock that evicts: a write whose
reservation was evicted meanwhile drops its temporary file instead of publishing an expert the
accounting no longer holds, so the published files never exceed the budget. Reads are several
aligned positional reads in flight per expert (`os.preadv`, which releases the interpreter lock)
into page-aligned buffers reused from a pool (store/disk_reads.py), so the fetch threads keep the
SSD's queue full; the store checks each copy read back against the fast hash recorded when it was
written (xxh3_128, store/integrity.py), not the sha256, which is kept for copies that cross a network.

Once started, writes leave the fetch path: `put` reserves the expert's room and queues its bytes
for one writer thread (write-behind), and until the file is published a read is answered from
those queued bytes, so nothing is fetched twice. The queue is bounded (`put` waits while it is
full), and a crash loses only queued bytes, never a half-written file.

Disk faults degrade, never stop: a disk that refuses writes (full, read-only, gone) turns writing
off with one warning, generation goes on from RAM and the other tiers, and a write is tried again
after DISK_RETRY_S; a read that fails (EIO) drops that file. One process at a time keeps a cache
folder (an exclusive `flock` on its lock file, released when the process dies): another process
on the same home reads the experts it found at start but neither writes, evicts nor cleans up,
so the budget holds for both; it takes over the cache when the lock comes free.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import threading
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Protocol

from expertmesh.node import constants
from expertmesh.node.fetching import DEMAND, FetchContext
from expertmesh.node.hub import local_models
from expertmesh.node.model.expert_index import ExpertBytes, ExpertIndex, ExpertLocation
from expertmesh.node.store.disk_reads import DiskReadConfig, DiskReader, WrongSize
from expertmesh.node.store.integrity import DigestBook

logger = logging.getLogger(__name__)

TMP_SUFFIX = ".tmp"
# The names the cache writes in a layer's folder: `{expert}.bin`, and `{expert}.bin.{pid}.{thread}.tmp`
# while one is written. Nothing else there is ever deleted.
_OWN_NAME = re.compile(r"\d+\.bin(?:(?:\.\d+)*" + re.escape(TMP_SUFFIX) + ")?")
LOCK_FILENAME = ".lock"
DISK_RETRY_S = 60.0  # a disk that refused a write, or a cache another process keeps, is tried again after this
WRITE_BEHIND_EXPERTS = (
    constants.DISK_WRITE_BEHIND_EXPERTS
)  # queued writes at most (an SSD drains them in milliseconds); `put` waits beyond
# errors that mean the disk will not take more: the tier turns itself off
_DISK_REFUSES = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO)


def cache_dir(home: Path, repo_id: str, commit: str) -> Path:
    return home / "experts" / local_models.repo_folder(repo_id) / commit


class Ownership(Protocol):
    """Which experts this node owns in its household (household/membership.py's ExpertOwnership)."""

    @property
    def version(self) -> int: ...  # changes when ownership may have moved

    def owns(self, key: tuple[int, int]) -> bool: ...


class DiskCache:
    """The disk tier of one pinned model (see the module's docstring); a `Tier` (store/tiers)."""

    source = "disk"
    local = True
    household = False

    def __init__(
        self,
        root: Path,
        index: ExpertIndex,
        budget_bytes: int,
        digests: DigestBook,
        reads: DiskReadConfig | None = None,
    ):
        self.root = root
        self.reader = DiskReader(reads)
        self.index = index
        self.digests = digests
        self.budget_bytes = budget_bytes
        self._files: OrderedDict[tuple[int, int], int] = OrderedDict()  # key -> size, LRU first
        self._others: OrderedDict[tuple[int, int], None] = OrderedDict()  # held, owned elsewhere, LRU first
        self.ownership: Ownership | None = None  # None: alone, every expert is this node's own
        self._claimed: set[tuple[int, int]] = set()  # asked for by a peer as their owner: kept as ours
        self._ownership_version: int | None = None
        self._writing: set[tuple[int, int]] = set()  # reserved in _files, file not yet in place
        self._lock = threading.Lock()
        self._queued = threading.Condition(self._lock)
        self._pending: dict[tuple[int, int], ExpertBytes] = {}  # queued for the writer, readable
        self._queue: deque[tuple[int, int]] = deque()
        self._pending_bytes = 0
        self._pending_max = WRITE_BEHIND_EXPERTS * max((loc.nbytes for loc in index.experts.values()), default=0)
        self._writer: threading.Thread | None = None
        self._closing = False
        self.nbytes = 0
        self.evictions = 0
        self.write_errors = 0
        self.stray_folders: list[Path] = []  # folders where an expert's file belongs, left for the user
        self.read_errors = 0
        self.refused = False  # the disk refused a write, or another process keeps the cache: nothing is written
        self.refusals = 0  # times the disk refused (metrics)
        self._retry_at = 0.0
        self._lock_fd: int | None = None
        self._take_cache()
        if self._lock_fd is not None:
            self._recover()
        else:
            self._list()

    def _take_cache(self) -> bool:
        """Become the one process that writes this cache folder; False: another one is (or the disk refuses)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.root / LOCK_FILENAME, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            self._refuse(e)
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            if not self.refused:
                logger.warning(
                    "disk cache at %s is kept by another expertmesh process: this one reads it but keeps nothing new",
                    self.root,
                )
            self.refused, self._retry_at = True, time.monotonic() + DISK_RETRY_S
            return False
        self._lock_fd = fd
        return True

    def _list(self) -> None:
        """Know the complete, digest-checked files of a cache another process keeps (touching nothing)."""
        with contextlib.suppress(OSError):
            for path in self.root.glob("*/*.bin"):
                with contextlib.suppress(OSError, ValueError):
                    key = (int(path.parent.name), int(path.stem))
                    size = path.stat().st_size
                    if (
                        key in self.index.experts
                        and size == self.index.expert(*key).nbytes
                        and self.digests.persisted(key)
                    ):
                        self._files[key] = size
                        self.nbytes += size

    def _path(self, layer: int, expert: int) -> Path:
        return self.root / str(layer) / f"{expert}.bin"

    def _recover(self) -> None:
        """Delete debris of interrupted writes, files of the wrong size or without a digest; list the rest.

        Only names this cache writes are ever deleted (`{layer}/{expert}.bin` and its temporary
        names): a layer folder may be a link someone made to another disk, and what else it holds
        is theirs. A folder where an expert's file belongs is reported, not removed."""
        found = []
        for path in self.root.glob("*/*"):
            try:
                if not path.parent.name.isdigit() or not _OWN_NAME.fullmatch(path.name):
                    logger.warning("disk cache: leaving %s alone: the cache writes no such name", path)
                    continue
                if path.is_dir() and not path.is_symlink():
                    self.stray_folders.append(path)
                    logger.warning("disk cache: a folder is where an expert's file belongs (%s): remove it", path)
                    continue
                if path.name.endswith(TMP_SUFFIX):
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

    def __contains__(self, key: object) -> bool:
        """Held: published, or queued for the writer (readable from memory until it is written)."""
        return key in self._files and (key not in self._writing or key in self._pending)

    def held(self) -> list[tuple[int, int]]:
        """The experts whose files are on disk now (a snapshot, least recently used first)."""
        with self._lock:
            return [k for k in self._files if k not in self._writing]

    def held_sizes(self) -> dict[tuple[int, int], int]:
        """`held` with each file's size: what a metrics scrape needs without looking every expert
        up in the index (a K3 disk can hold tens of thousands)."""
        with self._lock:
            return {k: n for k, n in self._files.items() if k not in self._writing}

    def has_room(self, nbytes: int) -> bool:
        """Whether `nbytes` more fit the budget without evicting anything (warming never evicts)."""
        with self._lock:
            return not self._off() and self.nbytes + nbytes <= self.budget_bytes

    def owns(self, key: tuple[int, int]) -> bool:
        """Whether `key` is this node's own expert (alone: every one)."""
        return self.ownership is None or key in self._claimed or self.ownership.owns(key)

    def claim(self, key: tuple[int, int]) -> None:
        """A peer asked for `key` as its owner (fetch on a miss, or keep): keep it as one of this
        node's own from now on, so what is fetched for it is written and kept, not dropped or
        evicted first because this node's peer table names another owner. Bounded by the model's
        experts; forgotten at restart, when the peers ask again."""
        with self._lock:
            self._claimed.add(key)
            self._others.pop(key, None)

    def _off(self) -> bool:
        """Whether writing is off now; after DISK_RETRY_S it is tried again (the disk may have room,
        the other process may have gone)."""
        if not self.refused:
            return False
        if time.monotonic() < self._retry_at:
            return True
        if self._lock_fd is None:
            if not self._take_cache():
                return True
            # the other process is gone: what is on disk now is what it left, listed afresh
            self._files.clear()
            self._others.clear()
            self._ownership_version = None
            self.nbytes = 0
            self._recover()
        self.refused = False  # try: the next refusal turns it off again
        return False

    def fetch(self, loc: ExpertLocation, ctx: FetchContext = DEMAND) -> ExpertBytes | None:
        """The copy on disk (or queued for it); `ctx` is for tiers that move bytes over a link.
        A copy read from disk is a pooled buffer, reused once every view of it is gone."""
        key = (loc.layer, loc.expert)
        with self._lock:
            queued = self._pending.get(key)
            if queued is not None and key in self._files:
                self._touch(key)
                return queued
            if key not in self._files or key in self._writing:
                return None
            self._touch(key)
        try:
            return self.reader.read(self._path(*key), loc.nbytes)
        except (FileNotFoundError, WrongSize):
            pass
        except OSError as e:  # a failing disk: this copy is lost, the other tiers have it
            self.read_errors += 1
            logger.warning("disk cache: could not read expert %s (%s); fetching it elsewhere", key, e.strerror)
        self._forget(key)
        return None

    def discard(self, loc: ExpertLocation) -> None:
        """Delete a copy that failed its check."""
        self._forget((loc.layer, loc.expert))

    def start(self) -> None:
        """Write behind from now on: `put` queues, one thread writes."""
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_queued, name="disk-cache-writer", daemon=True)
            self._writer.start()

    def flush(self) -> None:
        """Wait until every queued write is published (or dropped)."""
        with self._queued:
            while self._pending and self._writer is not None and self._writer.is_alive():
                self._queued.wait(0.1)

    def close(self) -> None:
        """Publish what is queued, then stop the writer."""
        with self._queued:
            self._closing = True
            self._queued.notify_all()
        if self._writer is not None:
            self._writer.join(30.0)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # another process may keep the cache now
            self._lock_fd = None
        self.reader.close()

    def put(self, loc: ExpertLocation, blob: ExpertBytes, wait: bool = False) -> None:
        """Keep a copy of a verified expert (its digest must already be persisted); failing to
        keep one is not the caller's error. Queued when the writer runs, unless `wait`."""
        key = (loc.layer, loc.expert)
        size = len(blob)
        if size > self.budget_bytes:
            return
        if not self.digests.persisted(key):
            if self.digests.get(key) is not None and self.digests.write_error is not None:
                with self._lock:  # the book beside the cache could not be written: neither can the cache
                    if not self.refused:
                        self._refuse(self.digests.write_error)
            return
        with self._lock:
            if key in self._files or self._off() or not self._reserve(key, size):
                return
            if self._writer is not None and not wait and not self._closing:
                while self._pending_bytes + size > self._pending_max and self._pending and not self._closing:
                    self._queued.wait()  # bounded: the fetch path slows to the disk's pace
                if key not in self._writing:
                    return  # evicted while we waited
                self._pending[key] = blob
                self._pending_bytes += size
                self._queue.append(key)
                self._queued.notify_all()
                return
        self._write(key, blob)

    def _reserve(self, key: tuple[int, int], size: int) -> bool:
        """Count `size` against the budget now, evicting least recently used files, others' experts
        first (under the lock). False: `key` is owned elsewhere and only this node's own experts
        could make room, so it is not kept."""
        self._sync_ownership()
        theirs = not self.owns(key)
        if theirs and self.nbytes - sum(self._files[k] for k in self._others) + size > self.budget_bytes:
            return False
        while self._files and self.nbytes + size > self.budget_bytes:
            old = next(iter(self._others)) if self._others else next(iter(self._files))
            old_size = self._files.pop(old)
            self._others.pop(old, None)
            self.nbytes -= old_size
            self.evictions += 1
            self._writing.discard(old)  # its writer sees the reservation gone and drops its file
            if self._pending.pop(old, None) is not None:
                self._pending_bytes -= old_size
            else:
                with contextlib.suppress(OSError):
                    self._path(*old).unlink(missing_ok=True)
        self._files[key] = size  # reserved now, so a concurrent put does not overshoot
        if theirs:
            self._others[key] = None
        self._writing.add(key)
        self.nbytes += size
        return True

    def _touch(self, key: tuple[int, int]) -> None:
        self._files.move_to_end(key)
        if key in self._others:
            self._others.move_to_end(key)

    def _sync_ownership(self) -> None:
        """Sort the held experts into ours and theirs again when the household changed (under the lock)."""
        if self.ownership is None:
            return
        version = self.ownership.version
        if version != self._ownership_version:
            self._others = OrderedDict((k, None) for k in self._files if not self.owns(k))
            self._ownership_version = version

    def _write_queued(self) -> None:
        while True:
            with self._queued:
                while not self._queue and not self._closing:
                    self._queued.wait()
                if not self._queue:
                    return
                key = self._queue.popleft()
                blob = self._pending.get(key)
            if blob is not None:
                self._write(key, blob)
            with self._queued:
                if blob is not None:
                    self._unqueue(key, blob)
                self._queued.notify_all()

    def _unqueue(self, key: tuple[int, int], blob: ExpertBytes) -> None:
        """Drop `blob` from the queued bytes, unless `key` was evicted and queued anew meanwhile (under the lock)."""
        if self._pending.get(key) is blob:
            del self._pending[key]
            self._pending_bytes -= len(blob)

    def _write(self, key: tuple[int, int], blob: ExpertBytes) -> None:
        """Write under a temporary name and publish it by a rename, while the reservation stands."""
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
                    # published: from now on an eviction must delete the file, not just the queued bytes
                    self._unqueue(key, blob)
                    return
            tmp.unlink(missing_ok=True)
        except OSError as e:
            with contextlib.suppress(OSError):  # a read-only disk refuses the unlink too
                tmp.unlink(missing_ok=True)
            self._forget(key)
            self.write_errors += 1
            if e.errno in _DISK_REFUSES:
                self._refuse(e)
            else:
                logger.error("disk cache: could not keep expert %s (%s); continuing without it", key, e.strerror)

    def _refuse(self, e: OSError) -> None:
        """Turn writing off until DISK_RETRY_S from now; warn once, not at every retry."""
        first = self.refusals == 0
        self.refused, self._retry_at = True, time.monotonic() + DISK_RETRY_S
        self.refusals += 1
        log = logger.warning if first else logger.debug
        log(
            "disk cache at %s refused a write (%s): keeping no more experts on disk for now "
            "(tried again every %.0f s); generation goes on from RAM, peers and the Hub",
            self.root,
            e.strerror,
            DISK_RETRY_S,
        )

    def _forget(self, key: tuple[int, int]) -> None:
        with self._lock:
            size = self._files.pop(key, None)
            self._others.pop(key, None)
            if size is not None:
                self.nbytes -= size
            self._writing.discard(key)
            queued = self._pending.pop(key, None)
            if queued is not None:
                self._pending_bytes -= len(queued)
            with contextlib.suppress(OSError):
                self._path(*key).unlink(missing_ok=True)
