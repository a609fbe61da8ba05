"""The disk's own floor: how fast plain tools read the same files from a cold page cache.

A warm-disk benchmark is judged against what the disk gives anyone, not against itself: `cat`
(one process, sequential) and parallel `os.preadv` of whole files into reused buffers (THREADS
at once), each after the page cache of those files was emptied. The faster of the two is the
floor's bandwidth; the expert bytes a run read from disk divided by it is the floor's time.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def drop_page_cache(files: list[str] | list[Path]) -> str:
    """Empty the page cache of `files`: the whole cache where this process may (root on Linux),
    else `posix_fadvise(DONTNEED)` file by file. Returns how it was done."""
    try:
        os.sync()
        DROP_CACHES.write_text("3\n")
        return "drop_caches"
    except OSError:
        pass
    if not hasattr(os, "posix_fadvise"):
        return "not dropped (no drop_caches, no posix_fadvise here)"
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "posix_fadvise(DONTNEED) per file"


def cat_seconds(files: list[str]) -> float:
    """Seconds `cat FILES > /dev/null` takes from a cold page cache."""
    drop_page_cache(files)
    t0 = time.perf_counter()
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True, timeout=3600)
    return time.perf_counter() - t0


def pread_seconds(files: list[str], threads: int = 8) -> float:
    """Seconds `threads` threads take to read `files` whole with `os.preadv` into one reused
    buffer each, from a cold page cache."""
    local = threading.local()
    size = max((os.path.getsize(f) for f in files), default=0)

    def one(f: str) -> None:
        if getattr(local, "buf", None) is None:
            local.buf = memoryview(mmap.mmap(-1, max(size, 1)))
        fd = os.open(f, os.O_RDONLY)
        try:
            done, n = 0, os.fstat(fd).st_size
            while done < n:
                got = os.preadv(fd, [local.buf[done:n]], done)
                if got == 0:
                    break
                done += got
        finally:
            os.close(fd)

    drop_page_cache(files)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, map(str, files)))
    return time.perf_counter() - t0


def floor_bandwidth(files: list[str], threads: int = 8, rounds: int = 2) -> dict:
    """The best of `rounds` cold passes of `cat` and of parallel `preadv` over `files`, in bytes/s;
    `bytes_per_s` is the faster of the two (the floor)."""
    total = sum(os.path.getsize(f) for f in files)
    if not total:
        return {"cat_bytes_per_s": 0.0, "pread_bytes_per_s": 0.0, "bytes_per_s": 0.0, "page_cache": "-"}
    how = drop_page_cache(files)
    cat = total / min(cat_seconds(files) for _ in range(rounds))
    pread = total / min(pread_seconds(files, threads) for _ in range(rounds))
    return {"cat_bytes_per_s": cat, "pread_bytes_per_s": pread, "bytes_per_s": max(cat, pread), "page_cache": how}
