"""How many range requests to keep in flight to the Hub, side by side in one run (issue 4).

`expertmesh bench`'s cold configuration (the demo model, a new node with empty caches for each
prompt, the emulated home link with K3's proportions: 100 MB/s, 12.5 MB/s per connection, 50 ms
to first byte, scaled) with `--hub-connections` at each count, in interleaved rounds so that a
noisy moment hits every count. Prints the medians of decode ms/token, TTFT, and the link's use
over decode and while anything was left to fetch, and each count's ratios to the default.

With exactly as many connections as the link has per-connection shares (8), every first byte
leaves a share idle, so the link cannot fill; too many make the requests contend in the client.

    python benchmarks/bench_connections.py [--counts 4,8,12,16,24] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics

from node import constants
from node.bench import run_bench


def run(counts: list[int], rounds: int, tokens: int) -> dict[int, dict[str, float]]:
    samples: dict[int, list[dict]] = {n: [] for n in counts}
    for r in range(rounds):
        for n in counts:
            doc = run_bench(tokens=tokens, naive_tokens=0, hub_connections=n, progress=lambda _: None)
            cold = next(c for c in doc["configs"] if c["name"] == "cold")
            samples[n].append(cold)
            print(f"round {r + 1}/{rounds}, {n:>2} connections: {cold['s_per_token'] * 1000:.1f} ms/token, link use "
                  f"{cold['link_utilisation']:.2f}, {cold['link_utilisation_while_fetching'] or 0:.2f} while fetching",
                  flush=True)  # fmt: skip
    keys = ("s_per_token", "ttft_s", "link_utilisation", "link_utilisation_while_fetching")
    return {n: {k: statistics.median(c[k] or 0.0 for c in cs) for k in keys} for n, cs in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--counts", default="4,8,12,16,24", help="connection counts to compare")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=24, help="tokens per prompt")
    args = ap.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    base = constants.HUB_CONNECTIONS
    if base not in counts:
        counts.append(base)
    medians = run(counts, args.rounds, args.tokens)
    b = medians[base]
    print(f"\nmedians of {args.rounds} rounds (cold, demo model); ratios are to the default of {base} connections")
    print(f"{'connections':>11} {'ms/token':>9} {'TTFT ms':>8} {'link use':>8} {'while fetching':>14} {'decode vs default':>17}")
    for n in sorted(medians):
        m = medians[n]
        print(f"{n:>11} {m['s_per_token'] * 1000:>9.1f} {m['ttft_s'] * 1000:>8.1f} {m['link_utilisation']:>8.2f} "
              f"{m['link_utilisation_while_fetching']:>14.2f} {m['s_per_token'] / b['s_per_token']:>16.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
