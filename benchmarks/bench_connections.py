"""How many range requests to keep in flight to the Hub, and into how many pieces to split an
expert, side by side in one run (issue 4).

`expertmesh bench`'s cold configuration (the demo model, a new node with empty caches for each
prompt, the emulated home link with K3's proportions: 100 MB/s, 12.5 MB/s per connection, 50 ms
to first byte, scaled) with `--hub-connections` at each count and experts split into at most each of `--pieces`, in
interleaved rounds so that a noisy moment hits every setting. Prints the medians of decode ms/token, TTFT, and the link's use
over decode and while anything was left to fetch, and each setting's ratios to the defaults.

With exactly as many connections as the link has per-connection shares (8), every first byte
leaves a share idle, so the link cannot fill; too many make the requests contend in the client.

    python benchmarks/bench_connections.py [--counts 4,8,12,16,24] [--pieces 4] [--rounds 3] [--model demo]
"""

from __future__ import annotations

import argparse
import statistics

from expertmesh.devtools.bench import run_bench
from expertmesh.node import constants
from expertmesh.node.store.tiers.hub import DEFAULT_PIECES_PER_EXPERT

Setting = tuple[int, int]  # (connections, pieces per expert)


def run(settings: list[Setting], rounds: int, tokens: int, model: str = "demo") -> dict[Setting, dict[str, float]]:
    samples: dict[Setting, list[dict]] = {s: [] for s in settings}
    for r in range(rounds):
        for n, pieces in settings:
            doc = run_bench(
                model=model,
                tokens=tokens,
                naive_tokens=0,
                hub_connections=n,
                pieces_per_expert=pieces,
                progress=lambda _: None,
            )
            cold = next(c for c in doc["configs"] if c["name"] == "cold")
            samples[n, pieces].append(cold)
            print(
                f"round {r + 1}/{rounds}, {n:>2} connections, {pieces} pieces: {cold['s_per_token'] * 1000:.1f} ms/token, "
                f"TTFT {cold['ttft_s'] * 1000:.0f} ms, link use "
                f"{cold['link_utilisation']:.2f}, {cold['link_utilisation_while_fetching'] or 0:.2f} while fetching",
                flush=True,
            )
    keys = ("s_per_token", "ttft_s", "link_utilisation", "link_utilisation_while_fetching")
    return {s: {k: statistics.median(c[k] or 0.0 for c in cs) for k in keys} for s, cs in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--counts", default="4,8,12,16,24", help="connection counts to compare")
    ap.add_argument("--pieces", default=str(DEFAULT_PIECES_PER_EXPERT), help="pieces per expert to compare")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=24, help="tokens per prompt")
    ap.add_argument("--model", default="demo", help="as `expertmesh bench --model` (default %(default)s)")
    args = ap.parse_args()
    base = (constants.HUB_CONNECTIONS, DEFAULT_PIECES_PER_EXPERT)
    counts = {int(c) for c in args.counts.split(",")} | {base[0]}
    pieces = {int(p) for p in args.pieces.split(",")} | {base[1]}
    medians = run(sorted((n, p) for n in counts for p in pieces), args.rounds, args.tokens, args.model)
    b = medians[base]
    print(
        f"\nmedians of {args.rounds} rounds (cold, {args.model} model); ratios are to the defaults: {base[0]} connections, "
        f"{base[1]} pieces"
    )
    print(
        f"{'connections':>11} {'pieces':>6} {'ms/token':>9} {'TTFT ms':>8} {'link use':>8} {'while fetching':>14} "
        f"{'decode vs default':>17} {'TTFT vs default':>15}"
    )
    for (n, p), m in sorted(medians.items()):
        print(
            f"{n:>11} {p:>6} {m['s_per_token'] * 1000:>9.1f} {m['ttft_s'] * 1000:>8.1f} {m['link_utilisation']:>8.2f} "
            f"{m['link_utilisation_while_fetching']:>14.2f} {m['s_per_token'] / b['s_per_token']:>16.2f}x "
            f"{m['ttft_s'] / b['ttft_s']:>14.2f}x"
        )


if __name__ == "__main__":
    main()
