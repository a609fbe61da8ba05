"""A node's Hub connections on a full, slow link: the speed floor as shipped beside no floor at all,
side by side in one run.

A home link shared by a node's dozen connections (or a household's nodes) gives each less than
the speed floor (64 kB/s) although nothing is broken: one node's 12 connections on a 0.6 MB/s
link get 50 kB/s each. The floor is there for a broken CDN edge that drips bytes; on a full link
it must cost nothing (node/hub/speed.py). Each configuration reads `--pieces` K3 pieces (4.4 MB,
an expert's quarter) at once from `expertmesh hub` capped at `--rate`, and the bench prints the
time, the connections given up, retries, and the bytes the Hub sent against the distinct bytes.

    python benchmarks/bench_shared_link.py [--rate 600KB] [--pieces 12]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

from expertmesh.devtools.local_hub import HubKnobs, HubServer
from expertmesh.node import constants
from expertmesh.node.fetching import FetchContext
from expertmesh.node.hub import client as hub_client
from expertmesh.node.hub.client import RangeReader, RemoteFile
from expertmesh.node.sizes import parse_size

PIECE_BYTES = 4_386_816  # a K3 expert (17,547,264 bytes) in the Hub tier's four pieces
REPO = "bench/shared-link"


def _read_all(hub: HubServer, reader: RangeReader, pieces: int) -> dict:
    """Every piece on its own connection at once; what it cost."""
    remote = RemoteFile(REPO, "main", "data.bin")
    errors: list[str] = []

    def one(i: int) -> None:
        start = i * PIECE_BYTES
        try:
            out = memoryview(bytearray(PIECE_BYTES))
            reader.read_into(remote, start, start + PIECE_BYTES, out, FetchContext(deadline=reader.deadline()))
        except Exception as e:  # noqa: BLE001 - counted and shown: a failed piece is the finding
            errors.append(f"{type(e).__name__}: {str(e)[-120:]}")

    with hub.stats_.lock:
        hub.stats_.reset()
    t0 = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(pieces)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with hub.stats_.lock:
        served = hub.stats_.bytes_served
    return {
        "seconds": time.monotonic() - t0,
        "given_up": reader.slow_responses,
        "retries": reader.retries,
        "hub_bytes": served,
        "failed": len(errors),
        "first_error": errors[0] if errors else "",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", default="600KB", help="the Hub's link, bytes/s (default %(default)s)")
    ap.add_argument("--pieces", type=int, default=constants.HUB_CONNECTIONS, help="pieces read at once")
    args = ap.parse_args()
    rate = float(parse_size(args.rate))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / REPO
        folder.mkdir(parents=True)
        (folder / "data.bin").write_bytes(os.urandom(args.pieces * PIECE_BYTES))
        with (
            HubServer(Path(tmp), knobs=HubKnobs(bandwidth_bytes_per_s=rate)) as hub,
            hub_client.using_endpoint(hub.url),
        ):
            rows = {
                "floor (shipped)": _read_all(hub, RangeReader(), args.pieces),
                "no floor": _read_all(hub, RangeReader(min_bytes_per_s=0), args.pieces),
            }
    distinct = args.pieces * PIECE_BYTES
    print(
        f"{args.pieces} pieces of {PIECE_BYTES:,} bytes at once, the Hub's link {rate / 1e6:.2f} MB/s "
        f"({rate / args.pieces / 1024:.0f} kB/s a connection, floor {constants.HUB_MIN_BYTES_PER_S / 1024:.0f} kB/s)"
    )
    print(f"{'config':<16} {'seconds':>8} {'given up':>9} {'retries':>8} {'Hub bytes / distinct':>21} {'failed':>7}")
    for name, r in rows.items():
        print(
            f"{name:<16} {r['seconds']:>8.1f} {r['given_up']:>9} {r['retries']:>8} "
            f"{r['hub_bytes'] / distinct:>21.3f} {r['failed']:>7}  {r['first_error']}"
        )
    a, b = rows["floor (shipped)"], rows["no floor"]
    print(
        f"floor / no floor: {a['seconds'] / b['seconds']:.2f}x the time, {a['hub_bytes'] / max(1, b['hub_bytes']):.2f}x the Hub bytes"
    )


if __name__ == "__main__":
    main()
