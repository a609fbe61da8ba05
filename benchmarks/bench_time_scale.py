"""Which time scale `expertmesh bench` can emulate the home link at faithfully, side by side (issue 4).

The bench speeds the emulated link up by `--time-scale` so it ends in minutes. The emulated Hub
runs in the bench's own process, beside the node, and every range request costs both of them CPU
that the real Hub and a real link never charge. Sped up too far, that CPU (hundreds of requests
per real second on 2 cores, beside MLX) and not the link is what the cold configuration waits
for. This runs `expertmesh bench`'s cold configuration at each scale and prints the link's use
over decode and while anything was left to fetch, the Hub requests per real second, the CPU the
process used per wall second, and decode time per token in K3 seconds (ms/token / scale: equal
across scales where the emulation is faithful), with ratios to the default scale.

    python benchmarks/bench_time_scale.py [--scales 0.05,0.1,0.2,0.5] [--tokens 24]
"""

from __future__ import annotations

import argparse
import time

from expertmesh.devtools.bench import run_bench
from expertmesh.node import constants


def run(scale: float, tokens: int) -> dict[str, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    doc = run_bench(tokens=tokens, naive_tokens=0, time_scale=scale, progress=lambda _: None)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    cold = next(c for c in doc["configs"] if c["name"] == "cold")
    cold_wall = len(doc["prompts"]) * cold["ttft_s"] + cold["tokens"] * cold["s_per_token"]  # about
    return {
        "link": cold["link_utilisation"],
        "fetching": cold["link_utilisation_while_fetching"] or 0.0,
        "requests_per_s": cold["hub_requests"] / cold_wall,
        "cpu_per_s": cpu / wall,
        "k3_s_per_token": cold["s_per_token"] / scale,
        "ms_per_token": cold["s_per_token"] * 1000,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scales", default="0.05,0.1,0.2,0.5", help="time scales to compare")
    ap.add_argument("--tokens", type=int, default=24, help="tokens per prompt")
    args = ap.parse_args()
    scales = sorted({float(s) for s in args.scales.split(",")} | {constants.BENCH_TIME_SCALE})
    rows = {}
    for s in scales:
        rows[s] = run(s, args.tokens)
        r = rows[s]
        print(f"time scale {s}: link use {r['link']:.2f} over decode, {r['fetching']:.2f} while fetching", flush=True)
    base = rows[constants.BENCH_TIME_SCALE]
    print(f"\ncold configuration, demo model; ratios are to the default time scale {constants.BENCH_TIME_SCALE}")
    print(
        f"{'scale':>6} {'link use':>8} {'while fetching':>14} {'Hub req/s':>9} {'CPU/s':>6} {'ms/token':>9} "
        f"{'K3 s/token':>10} {'vs default':>10}"
    )
    for s, r in rows.items():
        print(
            f"{s:>6} {r['link']:>8.2f} {r['fetching']:>14.2f} {r['requests_per_s']:>9.0f} {r['cpu_per_s']:>6.2f} "
            f"{r['ms_per_token']:>9.1f} {r['k3_s_per_token']:>10.2f} {r['k3_s_per_token'] / base['k3_s_per_token']:>9.2f}x"
        )


if __name__ == "__main__":
    main()
