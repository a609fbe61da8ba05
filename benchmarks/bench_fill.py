"""Idle-link fill against no fill, side by side in one run (issue 4).

The demo model cold, on `expertmesh bench`'s emulated home link (K3's proportions, time scale
0.05), RAM 25 % of the experts: the same prompts with `fill=False` and `fill=True`, each from an
empty disk. Prints per prompt the decode ms/token and the link's use during decode (bytes ÷
bandwidth ÷ decode time), and the ratio of the first prompt's decode time, where the link has the
most left to fetch.

    python benchmarks/bench_fill.py [--tokens 24]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from node import hub_client
from node.bench import K3_EXPERT_BYTES, PROMPTS, LinkSettings, _bench_repo, _run_prompts
from node.hub_server import HubKnobs, HubServer
from node.hub_source import DEFAULT_MIN_PIECE_BYTES
from node.pull import pull
from node.streamed_model import StoreConfig, open_model


def run(tokens: int) -> dict[bool, list[tuple[float, float]]]:
    work = Path(tempfile.mkdtemp(prefix="expertmesh-bench-fill-"))
    results: dict[bool, list[tuple[float, float]]] = {}
    try:
        repo = _bench_repo("demo", work / "hub")
        with HubServer(work / "hub") as hub, hub_client.using_endpoint(hub.url):
            for fill in (False, True):
                home = work / f"fill-{fill}"
                pull(repo, home=home, progress=False)
                probe = open_model(repo, home=home, store_config=StoreConfig(fill=False))
                index, tok = probe.index, probe.tokenizer
                probe.close()
                expert_bytes = max(loc.nbytes for loc in index.experts.values())
                link = LinkSettings.scaled(expert_bytes, 0.05)
                hub.knobs = link.knobs()
                cfg = StoreConfig(ram_budget=str(int(len(index.experts) * 0.25) * expert_bytes + expert_bytes // 2),
                                  fill=fill, hub_min_piece_bytes=int(DEFAULT_MIN_PIECE_BYTES * expert_bytes / K3_EXPERT_BYTES))  # fmt: skip
                sm = open_model(repo, home=home, store_config=cfg)
                summaries = _run_prompts(sm, [tok.encode(p) for p in PROMPTS], tokens, lambda: hub.stats()["bytes_served"])
                rows = []
                for s in summaries:
                    decode = s.seconds - s.time_to_first_token_s
                    rows.append((1000 * decode / max(1, s.generated_tokens - 1),
                                 s.decode_link_bytes / link.bandwidth / decode if decode > 0 else 0.0))  # type: ignore[attr-defined]  # fmt: skip
                results[fill] = rows
                print(f"fill={'on' if fill else 'off'}: {sm.store.stats.prefetch['filled']} experts filled, "
                      f"{len(sm.disk)} of {len(index.experts)} on disk at the end")  # fmt: skip
                sm.close()
                hub.knobs = HubKnobs()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=24)
    results = run(ap.parse_args().tokens)
    print(f"{'prompt':<7} {'off ms/tok':>10} {'off link':>8} {'on ms/tok':>10} {'on link':>8}")
    for i, (off, on) in enumerate(zip(results[False], results[True])):
        print(f"{i:<7} {off[0]:>10.1f} {off[1]:>8.2f} {on[0]:>10.1f} {on[1]:>8.2f}")
    print(f"first prompt: fill decodes {results[False][0][0] / results[True][0][0]:.2f}x faster")


if __name__ == "__main__":
    main()
