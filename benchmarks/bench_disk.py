"""Disk tier reads against `cat` of the same files, in one run.

Writes COUNT expert files of SIZE bytes through the real DiskCache, then reads them all:
  cat        `cat FILES > /dev/null` (one process, sequential)
  preadv     DiskCache.fetch on a pool of THREADS (positional reads into preallocated buffers)
  +sha256    the same reads plus the digest check the store makes on every disk copy
Page cache: if /proc/sys/vm/drop_caches is writable each pass starts cold, else all are warm
(both sides alike; the script says which).

    python benchmarks/bench_disk.py [--size 17.5MB] [--count 48] [--threads 8]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from expertmesh.node.hub.expert_index import ExpertIndex, ExpertLocation, TensorSlice
from expertmesh.node.sizes import format_size, parse_size
from expertmesh.node.store.integrity import DigestBook, sha256
from expertmesh.node.store.tiers.disk import DiskCache


def _drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=parse_size, default=parse_size("17.5MB"))
    ap.add_argument("--count", type=int, default=48)
    ap.add_argument("--threads", type=int, default=8)
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench-disk-", dir=os.environ.get("TMPDIR", "/tmp")))
    locs = {
        (1, e): ExpertLocation(
            1, e, [TensorSlice(f"e{e}", "U8", (args.size,), "f.safetensors", e * args.size, (e + 1) * args.size)]
        )
        for e in range(args.count)
    }
    index = ExpertIndex("bench/disk", "0" * 40, {"f.safetensors": args.size * args.count}, {}, locs)
    digests = DigestBook(root / "digests.tsv")
    disk = DiskCache(root / "cache", index, budget_bytes=args.size * args.count * 2, digests=digests)
    for key, loc in locs.items():
        blob = os.urandom(args.size)
        digests.record(key, sha256(blob))
        disk.put(loc, blob)
    files = [str(disk._path(*k)) for k in locs]
    total = args.size * args.count

    def timed(fn) -> float:
        cold = _drop_caches()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0, cold

    def cat() -> None:
        subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)

    def pread(check: bool) -> None:
        def one(loc):
            blob = disk.fetch(loc)
            assert blob is not None
            if check:
                assert sha256(blob) == digests.get((loc.layer, loc.expert))

        with ThreadPoolExecutor(args.threads) as pool:
            list(pool.map(one, locs.values()))

    timed(cat)  # warm-up: file system metadata, thread start
    results = {}
    for name, fn in (("cat", cat), ("preadv", lambda: pread(False)), ("preadv+sha256", lambda: pread(True))):
        results[name] = min(timed(fn) for _ in range(3))  # best of 3: the least disturbed pass
    cold = results["cat"][1]
    print(
        f"{args.count} files of {format_size(args.size)} ({format_size(total)}), {args.threads} threads, "
        f"page cache {'dropped before each pass (cold)' if cold else 'warm (drop_caches not writable)'}"
    )
    base = total / results["cat"][0]
    for name, (secs, _) in results.items():
        rate = total / secs
        print(f"  {name:<14} {format_size(rate)}/s   {rate / base:.2f}x cat")
    for f in files:
        os.unlink(f)


if __name__ == "__main__":
    main()
