"""Demanded experts lying back to back fetched as one run, against one by one, side by side (issue 4).

`expertmesh bench`'s cold configuration (the demo model, empty caches, the emulated home link
with K3's proportions, scaled) with demand coalescing on and off, in interleaved rounds so that a
noisy moment hits both. Prints the medians of TTFT (prefill routes a prompt's tokens to most of a
layer's experts, so its demands lie back to back), decode ms/token, and Hub requests, and the
ratios. Idle-link fill coalesces either way.

A run stays within one request's piece (HubSource.min_piece_bytes, 2 MB at K3's scale): an
expert of a piece or more is split across connections already (K3's 17.5 MB experts, or the
2.4 MB of a 4-bit 30B-A3B expert, never go as runs), so the link is scaled as if the demo's
expert were `--stands-for-mb` big (default 0.5 MB: four experts to a request).

    python benchmarks/bench_coalesce.py [--rounds 3] [--tokens 24] [--stands-for-mb 0.5]
"""

from __future__ import annotations

import argparse
import statistics

from expertmesh.devtools.bench import run_bench

MODES = {"runs": True, "one_by_one": False}


def run(rounds: int, tokens: int, stands_for: float) -> dict[str, dict[str, float]]:
    samples: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(rounds):
        for mode, coalesce in MODES.items():
            doc = run_bench(
                tokens=tokens, naive_tokens=0, coalesce=coalesce, stands_for=stands_for, progress=lambda _: None
            )
            cold = next(c for c in doc["configs"] if c["name"] == "cold")
            samples[mode].append(cold)
            print(
                f"round {r + 1}/{rounds}, {mode}: TTFT {cold['ttft_s'] * 1000:.1f} ms, "
                f"{cold['s_per_token'] * 1000:.1f} ms/token, {cold['hub_requests']} Hub requests",
                flush=True,
            )
    keys = ("ttft_s", "s_per_token", "hub_requests", "link_utilisation_while_fetching")
    return {m: {k: statistics.median(c[k] or 0.0 for c in cs) for k in keys} for m, cs in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=24, help="tokens per prompt")
    ap.add_argument("--stands-for-mb", type=float, default=0.5, help="the expert size the link is scaled to")
    args = ap.parse_args()
    m = run(args.rounds, args.tokens, args.stands_for_mb * 1e6)
    a, b = m["one_by_one"], m["runs"]
    print(f"\nmedians of {args.rounds} rounds (cold, demo model, link scaled to {args.stands_for_mb} MB experts)")
    print(f"{'demands':>11} {'TTFT ms':>8} {'ms/token':>9} {'Hub requests':>12} {'link while fetching':>19}")
    for mode, v in m.items():
        print(
            f"{mode:>11} {v['ttft_s'] * 1000:>8.1f} {v['s_per_token'] * 1000:>9.1f} {v['hub_requests']:>12.0f} "
            f"{v['link_utilisation_while_fetching']:>19.2f}"
        )
    print(
        f"runs vs one by one: TTFT {a['ttft_s'] / b['ttft_s']:.2f}x faster, decode {a['s_per_token'] / b['s_per_token']:.2f}x, "
        f"{b['hub_requests'] / a['hub_requests']:.2f}x the Hub requests"
    )


if __name__ == "__main__":
    main()
