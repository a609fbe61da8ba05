"""Buffers for expert bytes that give their memory back when they go, or are reused.

A K3 expert is 17.5 MB. Allocated as `bytearray`s by a dozen fetch threads, such blocks land in
glibc's per-thread heaps, whose freed space is kept rather than returned (its mmap threshold
grows past 17.5 MB after the first frees), so resident memory ratchets up far beyond what is in
use. An anonymous `mmap` is its own mapping: the kernel hands it out zeroed and lazily (no memset
on the fetch path) and takes it back when the buffer is collected.

Lazily is not free: every 4 KB page of a fresh mapping faults and is zeroed when it is first
written, and at an SSD's speed those page faults, not the disk, would bound a warm read
(docs/benchmarks.md, "Warm disk at the SSD's speed"). So the disk tier reads into a `BufferPool`: page-aligned mappings
kept after use and lent again. A lent buffer goes back to the pool only when nothing refers to it
any more (the lease is a ctypes view of the mapping, and every memoryview or numpy array made from
the lease holds the lease), so a buffer is never rewritten while a reader still holds its bytes.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import weakref
from collections import defaultdict

from expertmesh.node import constants

MMAP_MIN_BYTES = 1024 * 1024  # smaller buffers come from the allocator, which handles them well
# idle buffers kept at most: one per fetch worker, the "one expert per fetch worker" the memory
# budget allows beside the RAM tier (140 MB of K3 experts). Buffers of one size are lent idle ones
# first, so in-flight and idle buffers together stay within max(peak in flight, this). Beyond it,
# released buffers are unmapped.
POOL_IDLE_BUFFERS = constants.EXPERT_FETCH_CONCURRENCY


def expert_buffer(nbytes: int) -> bytearray | mmap.mmap:
    """A writable buffer of `nbytes` zero bytes, mapped on its own when large."""
    if nbytes < MMAP_MIN_BYTES:
        return bytearray(nbytes)
    return mmap.mmap(-1, nbytes)


class BufferPool:
    """Page-aligned buffers of any size, lent as writable memoryviews and reused once released.

    Args:
        max_idle_buffers: idle buffers kept for reuse at most; a buffer released beyond it is
            unmapped (its memory goes back to the system).
    """

    def __init__(self, max_idle_buffers: int = POOL_IDLE_BUFFERS):
        self.max_idle_buffers = max_idle_buffers
        self._idle: dict[int, list[mmap.mmap]] = defaultdict(list)
        self._idle_count = 0
        self._idle_bytes = 0
        # re-entrant: a garbage collection started under it may run a finalizer that gives a buffer back
        self._lock = threading.RLock()
        self.allocated = 0  # mappings made (a pool that works makes few)
        self.reused = 0  # lends answered by an idle mapping

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    def lend(self, nbytes: int) -> memoryview:
        """A writable, page-aligned buffer of `nbytes` (contents undefined: the caller fills it).

        It returns to the pool when the memoryview and everything made from it are gone.
        Small sizes get a plain bytearray (the allocator reuses those well).
        """
        if nbytes < MMAP_MIN_BYTES:
            return memoryview(bytearray(nbytes))
        with self._lock:
            free = self._idle.get(nbytes)
            if free:
                mm = free.pop()
                self._idle_count -= 1
                self._idle_bytes -= nbytes
                self.reused += 1
            else:
                mm = None
        if mm is None:
            mm = mmap.mmap(-1, nbytes)
            with self._lock:
                self.allocated += 1
        lease = (ctypes.c_char * nbytes).from_buffer(mm)  # holds an export of `mm`; views of it hold the lease
        weakref.finalize(lease, self._give_back, mm)
        return memoryview(lease).cast("B")

    def _give_back(self, mm: mmap.mmap) -> None:
        """Called when the last view of a lease is gone (any thread, from the garbage collector)."""
        with self._lock:
            if self._idle_count < self.max_idle_buffers:
                self._idle[len(mm)].append(mm)
                self._idle_count += 1
                self._idle_bytes += len(mm)
        # else: dropped; unmapped when collected (the lease's export may outlive this call by a moment)

    def clear(self) -> None:
        """Let every idle buffer go (lent ones return later, and are kept if there is room)."""
        with self._lock:
            self._idle.clear()
            self._idle_count = 0
            self._idle_bytes = 0


_shared: BufferPool | None = None
_shared_lock = threading.Lock()


def shared_pool() -> BufferPool:
    """The process's pool for expert bytes: the Hub's and the peers' fetches and the disk's reads
    lend from one pool, so at most POOL_IDLE_BUFFERS idle buffers stay resident in all, and a
    buffer a Hub fetch released serves the next disk read."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = BufferPool()
        return _shared
