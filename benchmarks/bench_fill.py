"""Idle-link fill against no fill, side by side in one run (issue 4).

The demo model cold, on `expertmesh bench`'s emulated home link (K3's proportions, time scale
0.05), RAM 25 % of the experts: the same prompts with no fill, with fills one expert per request,
and with fills of adjacent experts as runs (the default), each from an empty disk. Prints per
prompt the decode ms/token and the link's use during decode (bytes ÷ bandwidth ÷ decode time), and
the ratios of the first prompt's decode time, where the link has the most left to fetch.

`--stands-for-mb` scales the link as if the demo's expert were that big (K3's 17.5 MB by default):
at 2.4 MB (a 4-bit expert of a 30B-A3B model) the time to first byte is a fifth of an expert's
transfer on one connection, and fills go as runs of adjacent experts (HubSource.run_bytes).

    python benchmarks/bench_fill.py [--tokens 24] [--stands-for-mb 17.5]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from expertmesh.assembly import open_model
from expertmesh.devtools.bench import K3_EXPERT_BYTES, PROMPTS, LinkSettings, _bench_repo, _run_prompts
from expertmesh.devtools.local_hub import HubKnobs, HubServer
from expertmesh.node.config import StoreConfig
from expertmesh.node.hub import client as hub_client
from expertmesh.node.hub.pull import pull
from expertmesh.node.store import fill as idle_fill
from expertmesh.node.store.tiers.hub import DEFAULT_MIN_PIECE_BYTES

CONFIGS = {"off": (False, 1), "one": (True, 1), "runs": (True, idle_fill.FILL_RUN_MAX)}  # fill, run


def run(tokens: int, stands_for: float = K3_EXPERT_BYTES) -> dict[str, list[tuple[float, float, float, float]]]:
    work = Path(tempfile.mkdtemp(prefix="expertmesh-bench-fill-"))
    results: dict[str, list[tuple[float, float, float, float]]] = {}
    run_max = idle_fill.FILL_RUN_MAX
    try:
        repo = _bench_repo("demo", work / "hub")
        with HubServer(work / "hub") as hub, hub_client.using_endpoint(hub.url):
            for name, (fill, fill_run) in CONFIGS.items():
                idle_fill.FILL_RUN_MAX = fill_run
                home = work / name
                pull(repo, home=home, progress=False)
                probe = open_model(repo, home=home, store=StoreConfig(fill=False))
                index, tok = probe.index, probe.tokenizer
                probe.close()
                expert_bytes = max(loc.nbytes for loc in index.experts.values())
                link = LinkSettings.scaled(expert_bytes, 0.05, stands_for)
                hub.knobs = link.knobs()
                cfg = StoreConfig(
                    ram_budget=str(int(len(index.experts) * 0.25) * expert_bytes + expert_bytes // 2),
                    fill=fill,
                    hub_min_piece_bytes=int(DEFAULT_MIN_PIECE_BYTES * expert_bytes / stands_for),
                )
                sm = open_model(repo, home=home, store=cfg)
                runs = _run_prompts(sm, [tok.encode(p) for p in PROMPTS], tokens, hub.bytes_served)
                rows = []
                for run in runs:
                    s = run.summary
                    decode, fetching = s.seconds - s.time_to_first_token_s, run.decode_fetch_s
                    moved = run.decode_link_bytes / link.bandwidth
                    rows.append(
                        (
                            1000 * decode / max(1, s.generated_tokens - 1),
                            moved / decode if decode > 0 else 0.0,
                            moved / fetching if fetching > 0 else 0.0,
                            s.seconds,
                        )
                    )
                results[name] = rows
                print(
                    f"fill {name}: {sm.store.stats.prefetch['filled']} experts filled, "
                    f"{len(sm.disk)} of {len(index.experts)} on disk at the end"
                )
                sm.close()
                hub.knobs = HubKnobs()
    finally:
        idle_fill.FILL_RUN_MAX = run_max
        shutil.rmtree(work, ignore_errors=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument(
        "--stands-for-mb",
        type=float,
        default=K3_EXPERT_BYTES / 1e6,
        help="the expert size the link is scaled to (default K3's)",
    )
    args = ap.parse_args()
    results = run(args.tokens, args.stands_for_mb * 1e6)
    print("ms/tok: decode; link: the link's use over decode / while anything was left to fetch; s: the whole prompt")
    print(
        f"{'prompt':<7}" + "".join(f" {name + ' ms/tok':>13} {name + ' link':>14} {name + ' s':>7}" for name in results)
    )
    for i, rows in enumerate(zip(*results.values())):
        print(
            f"{i:<7}"
            + "".join(f" {ms:>13.1f} {link:>6.2f} / {busy:>5.2f} {wall:>7.2f}" for ms, link, busy, wall in rows)
        )
    first = {name: rows[0][0] for name, rows in results.items()}
    whole = {name: rows[0][3] for name, rows in results.items()}
    print(
        f"first prompt, prefill and decode: {whole['off']:.2f} s without fill, {whole['one']:.2f} s one by one "
        f"({whole['off'] / whole['one']:.2f}x), {whole['runs']:.2f} s in runs ({whole['off'] / whole['runs']:.2f}x)"
    )
    print(
        f"first prompt: fill one by one decodes {first['off'] / first['one']:.2f}x faster than no fill, "
        f"fill in runs {first['off'] / first['runs']:.2f}x (and {first['one'] / first['runs']:.2f}x one by one)"
    )


if __name__ == "__main__":
    main()
