"""Buffers for expert bytes that give their memory back when they go.

A K3 expert is 17.5 MB. Allocated as `bytearray`s by a dozen fetch threads, such blocks land in
glibc's per-thread heaps, whose freed space is kept rather than returned (its mmap threshold
grows past 17.5 MB after the first frees), so resident memory ratchets up far beyond what is in
use. An anonymous `mmap` is its own mapping: the kernel hands it out zeroed and lazily (no memset
on the fetch path) and takes it back when the buffer is collected.
"""

from __future__ import annotations

import mmap

MMAP_MIN_BYTES = 1024 * 1024  # smaller buffers come from the allocator, which handles them well


def expert_buffer(nbytes: int) -> bytearray | mmap.mmap:
    """A writable buffer of `nbytes` zero bytes, mapped on its own when large."""
    if nbytes < MMAP_MIN_BYTES:
        return bytearray(nbytes)
    return mmap.mmap(-1, nbytes)
