"""`expertmesh hub` at real size: concurrent range reads from a multi-GB shard, without and with a cap.

A household mirror serves K3's 2.4 GB shards to a dozen connections at once. This runs the hub in
a process of its own over the K3-proportioned repo (expertmesh/devtools/tiny/k3_proportions.py, made and
kept under $EXPERTMESH_HOME/bench/hub by `expertmesh bench --model k3-proportions`, or here) and
reads 12 ranges of 4.4 MB (a K3 expert's quarter: one piece) at once from its largest shard, over
keep-alive connections, twice: with no bandwidth cap (what the hub itself can serve) and with the
emulated home link's cap (100 MB/s), which it must hold.

    python benchmarks/bench_local_hub.py [--rounds 3] [--cap 100MB] [--json FILE]

Prints MB/s of each round and the medians: the uncapped rate over the cap (target >= 5x) and the
capped rate over the cap (target within 5%).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2

from expertmesh.devtools.bench_k3 import REPO_ID, _model_dir
from expertmesh.devtools.tiny import k3_proportions
from expertmesh.node import constants
from expertmesh.node.sizes import parse_size

PIECE = 17_547_264 // 4
READS = 12


def _hub(root: Path, cap: float) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "expertmesh", "hub", str(root), "--port", "0"]
    if cap:
        cmd += ["--bandwidth", str(int(cap))]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    m = re.search(r"at (http://\S+)", proc.stdout.readline())
    if not m:
        proc.kill()
        raise RuntimeError("the hub did not start")
    return proc, m.group(1)


def _round(url: str, shard: str, size: int, round_no: int, curl: bool) -> float:
    """12 concurrent 4.4 MB ranges spread over the shard; returns MB/s.

    What the hub can serve is read by `curl` processes when curl is installed: 12 Python threads on
    these 2 cores cap out near 250-400 MB/s in the client itself (the GIL, 64 kB reads), which would
    measure httpx, not the hub. Whether the cap holds is read as a node reads it: httpx keep-alive
    connections opened beforehand (curl's process start and connect would count against the cap)."""
    location = f"{url}/{REPO_ID}/resolve/main/{shard}"
    starts = [(i * 997 + round_no * 131) % (size // PIECE - 1) * PIECE for i in range(READS)]
    ranges = [f"{s}-{s + PIECE - 1}" for s in starts]
    if curl:
        t0 = time.perf_counter()
        procs = [
            subprocess.Popen(
                ["curl", "-sS", "-L", "-r", r, "-o", "/dev/null", "-w", "%{http_code} %{size_download}", location],
                stdout=subprocess.PIPE,
                text=True,
            )
            for r in ranges
        ]
        outs = [p.communicate(timeout=120)[0] for p in procs]
        seconds = time.perf_counter() - t0
        for i, out in enumerate(outs):
            if out.split() != ["206", str(PIECE)]:
                raise RuntimeError(f"read {i}: curl said {out!r}")
        return READS * PIECE / seconds / 1e6
    clients = [httpx2.Client(timeout=120) for _ in range(READS)]

    def read(i: int) -> int:
        r = clients[i].get(location, headers={"Range": f"bytes={ranges[i]}"}, follow_redirects=True)
        if r.status_code != 206 or len(r.content) != PIECE:
            raise RuntimeError(f"read {i}: HTTP {r.status_code}, {len(r.content)} bytes")
        return len(r.content)

    for i in range(READS):  # connections open and the CDN redirect known, as a node's would be
        clients[i].head(location)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(READS) as pool:
        moved = sum(pool.map(read, range(READS)))
    seconds = time.perf_counter() - t0
    for c in clients:
        c.close()
    return moved / seconds / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cap", default="100MB", help="the emulated link (default %(default)s)")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    cap = float(parse_size(args.cap))
    root = _model_dir(constants.expertmesh_home() / "bench" / "hub", REPO_ID, k3_proportions.Proportions(), print)
    shard = max(root.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    size = shard.stat().st_size
    print(f"{shard.name}: {size / 1e9:.2f} GB; {READS} concurrent reads of {PIECE / 1e6:.1f} MB each")
    doc = {"shard_bytes": size, "reads": READS, "piece_bytes": PIECE, "cap_bytes_per_s": cap, "load": os.getloadavg()}
    has_curl = shutil.which("curl") is not None
    for name, limit in (("uncapped", 0.0), ("capped", cap)):
        proc, url = _hub(root.parent.parent, limit)
        try:
            rates = [_round(url, shard.name, size, n, curl=not limit and has_curl) for n in range(args.rounds)]
        finally:
            proc.terminate()
            proc.wait(30)
        doc[name] = rates
        print(f"{name:>9}: " + ", ".join(f"{r:.1f}" for r in rates) + " MB/s")
    uncapped = statistics.median(doc["uncapped"])
    capped = statistics.median(doc["capped"])
    doc["client"] = "curl" if has_curl else "httpx threads (a lower bound)"
    print(
        f"medians: uncapped {uncapped / (cap / 1e6):.1f}x the cap (target >= 5x); "
        f"capped {capped / (cap / 1e6):.3f} of it (within 5%); uncapped readers: {doc['client']}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
