"""Reading one expert file the way an SSD wants it: several aligned positional reads in flight.

An SSD reaches its speed only with many requests queued; one `read` at a time leaves it idle
between requests. So an expert file is cut into `fanout` pieces, each starting at a multiple of
`align_bytes`, and read by `os.preadv` (which releases the interpreter lock) on a small pool of
threads, the calling thread reading the first piece itself: the fetch threads (one per expert a
layer asks for) then keep fetch-threads × fanout reads in flight. The bytes land in a page-aligned
buffer lent by a `BufferPool` (store/buffers.py) and reused once its holder lets it go, so a read
faults in no fresh pages.

The page cache (`page_cache`): "keep" lets the kernel keep what was read, so an expert read again
soon (by another prompt, by a peer's request) comes from memory; "drop" tells it not to keep the
file (`posix_fadvise(POSIX_FADV_DONTNEED)` after the read on Linux, `F_NOCACHE` before it on macOS)
for when the RAM tier already holds the hot experts and the page cache would only duplicate them.
Both measured at K3 proportions in docs/benchmarks.md ("Warm disk"); "keep" is the default.

A file whose size is not the expert's is refused before anything is read (`WrongSize`): a
truncated or overlong file is never a copy of the expert.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from expertmesh.node.store.buffers import BufferPool, shared_pool

_F_NOCACHE = getattr(fcntl, "F_NOCACHE", 48)  # macOS; the constant is in fcntl only from Python 3.12 on


@dataclass(frozen=True)
class DiskReadConfig:
    """How an expert file is read.

    Args:
        fanout: pieces of one expert read at once (1: a single read by the calling thread).
        align_bytes: pieces start at multiples of this (and of the page size: the buffers are
            page-aligned), the I/O size SSDs serve best.
        threads: the pool's threads, shared by every expert read at once.
        page_cache: "keep" or "drop" (see the module's docstring).
    """

    fanout: int = 4
    align_bytes: int = 2 * 1024 * 1024
    threads: int = 8
    page_cache: str = "keep"

    def __post_init__(self):
        if self.fanout < 1 or self.threads < 0 or self.align_bytes < 4096 or self.align_bytes % 4096:
            raise ValueError(f"bad disk read settings: {self}")
        if self.page_cache not in ("keep", "drop"):
            raise ValueError(f"page_cache must be 'keep' or 'drop', not {self.page_cache!r}")


class WrongSize(Exception):
    """The file is not the size of the expert it should hold."""


def pieces(nbytes: int, fanout: int, align: int) -> list[tuple[int, int]]:
    """(start, end) of up to `fanout` pieces covering [0, nbytes), each starting at a multiple of `align`."""
    if nbytes <= 0:
        return []
    step = -(-nbytes // fanout)  # ceil
    step = -(-step // align) * align
    return [(start, min(start + step, nbytes)) for start in range(0, nbytes, step)]


def _read_piece(fd: int, view: memoryview, start: int, end: int) -> int:
    """Fill view[start:end] from the same offsets of `fd`; returns the bytes read (short: the file shrank)."""
    done = start
    while done < end:
        n = os.preadv(fd, [view[done:end]], done)
        if n == 0:
            break
        done += n
    return done - start


class DiskReader:
    """Reads whole expert files into pooled buffers with `config`'s fan-out; thread-safe."""

    def __init__(self, config: DiskReadConfig | None = None, pool: BufferPool | None = None):
        self.config = config or DiskReadConfig()
        self.pool = pool or shared_pool()
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False

    def _pool_threads(self) -> ThreadPoolExecutor | None:
        if self.config.fanout == 1 or self.config.threads == 0 or self._closed:
            return None
        with self._lock:
            if self._executor is None and not self._closed:
                self._executor = ThreadPoolExecutor(self.config.threads, thread_name_prefix="disk-read")
            return self._executor

    def read(self, path: Path | str, nbytes: int) -> memoryview:
        """The `nbytes` of the file at `path`, in a pooled buffer.

        Raises:
            FileNotFoundError, OSError: as opening or reading the file does.
            WrongSize: the file is shorter or longer than `nbytes` (or changed size while read).
        """
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(path, flags)
        try:
            size = os.fstat(fd).st_size
            if size != nbytes:
                raise WrongSize(f"{path}: {size} bytes, the expert has {nbytes}")
            drop = self.config.page_cache == "drop"
            if drop and sys.platform == "darwin":
                with contextlib.suppress(OSError):  # advice: a file system that ignores it still reads
                    fcntl.fcntl(fd, _F_NOCACHE, 1)
            buf = self.pool.lend(nbytes)
            parts = pieces(nbytes, self.config.fanout, self.config.align_bytes)
            got = self._read_all(fd, buf, parts)
            if drop and hasattr(os, "posix_fadvise"):
                with contextlib.suppress(OSError):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if got != nbytes:
                raise WrongSize(f"{path}: read {got} bytes, the expert has {nbytes}")
            return buf
        finally:
            os.close(fd)

    def _read_all(self, fd: int, buf: memoryview, parts: list[tuple[int, int]]) -> int:
        """The pieces after the first on the pool, the first here; every piece finished before returning."""
        executor = self._pool_threads() if len(parts) > 1 else None
        futures: list[Future] = []
        if executor is not None:
            try:
                futures = [executor.submit(_read_piece, fd, buf, s, e) for s, e in parts[1:]]
            except RuntimeError:  # shut down meanwhile: read them here
                futures = []
        rest = parts[1:] if not futures else []
        got = 0
        error: BaseException | None = None
        for s, e in [parts[0], *rest] if parts else []:
            try:
                got += _read_piece(fd, buf, s, e)
            except OSError as exc:
                error = exc
        for f in futures:  # wait for every piece even after an error: none may write into a lent-again buffer
            try:
                got += f.result()
            except OSError as exc:
                error = exc
        if error is not None:
            raise error
        return got

    def close(self) -> None:
        """Stop the pool's threads (reads after this run on the calling thread)."""
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
