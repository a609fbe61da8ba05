"""Where a cold prompt's time goes at K3 proportions: a timeline of one prompt in one process, a
layer's groups as half the hold limit ("even") beside the last group in halves ("tapered",
store.layer_groups), side by side in one run (issue 46).

The K3-proportioned repo of `expertmesh bench --model k3-proportions` (384 experts of
17,547,264 bytes a layer), `expertmesh hub` at 100 MB/s, 25 MB/s a connection, 75 ms to the
first byte, a node with an empty home and a RAM budget of 64 experts answers one token. The Hub's
served bytes are sampled every 0.2 s, and each group's start, wait and compute are noted. Printed
per setting: the time to first token and over the distinct bytes ÷ the link (the byte floor), how
long the link ran below half its rate, and per layer the compute left after its last byte came
(the link idles through it: the next layer's experts are known only after it).

    python benchmarks/bench_prompt_timeline.py [--tokens 16] [--moe-layers 2] [--settings even,tapered]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time
from pathlib import Path

from expertmesh.devtools import bench_k3, bench_prompt
from expertmesh.devtools.tiny import k3_proportions
from expertmesh.node.hub import client as hub_client
from expertmesh.node.hub.pull import pull

LINK, PER_CONNECTION, TTFB_S, RAM_EXPERTS = 100e6, 25e6, 0.075, 64


def one(repo_id: str, template: Path, hub_url: str, tokens: int, vocab: int, setting: str, eb: int) -> dict:
    from expertmesh.assembly import open_model
    from expertmesh.node.config import StoreConfig
    from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings
    from expertmesh.node.store import store as store_module

    work = Path(tempfile.mkdtemp(prefix="expertmesh-timeline-"))
    tapered = store_module._tapered
    if setting == "even":
        store_module._tapered = lambda groups: groups
    try:
        shutil.copytree(template, work / "home")
        sm = open_model(repo_id, home=work / "home", store=StoreConfig(ram_budget=str(RAM_EXPERTS * eb + eb // 2)))
        events: list[tuple[float, str, int]] = []  # (time, what, layer)
        finish = type(sm.store)._finish

        def timed(store, layer, started):
            group = finish(store, layer, started)
            events.append((time.perf_counter(), "bytes", layer))
            return group

        sm.store._finish = timed.__get__(sm.store)  # type: ignore[method-assign]
        samples: list[tuple[float, int]] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                samples.append((time.perf_counter(), bench_k3._hub_bytes(hub_url)))
                time.sleep(0.2)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        generator = Generator(sm)
        generator.prefill_progress = lambda p: events.append((time.perf_counter(), "computed", p.layer))
        summary = GenerationSummary()
        t0 = time.perf_counter()
        list(
            generator.generate(bench_prompt.prompt_ids(tokens, vocab), SamplingSettings(max_tokens=1), summary=summary)
        )
        t1 = time.perf_counter()
        stop.set()
        sampler.join()
        distinct = sum(summary.experts.bytes.values())
        idle = sum(
            b[0] - a[0]
            for a, b in zip(samples, samples[1:])
            if t0 <= a[0] <= t1 and (b[1] - a[1]) / (b[0] - a[0]) < LINK / 2
        )
        layers = sorted({layer for _, what, layer in events if what == "bytes"})
        tails = []
        for i, layer in enumerate(layers):
            last_bytes = max(t for t, what, lay in events if what == "bytes" and lay == layer)
            computed = max(t for t, what, lay in events if what == "computed" and lay == i)
            tails.append(round(computed - last_bytes, 3))
        sm.close()
        return {
            "setting": setting,
            "ttft_s": t1 - t0,
            "over_byte_floor": (t1 - t0) / (distinct / LINK),
            "link_below_half_s": idle,
            "tail_s": tails,
        }
    finally:
        store_module._tapered = tapered
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--moe-layers", type=int, default=2)
    ap.add_argument("--settings", default="even,tapered")
    args = ap.parse_args()
    p = k3_proportions.Proportions(experts=384, moe_layers=args.moe_layers)
    repo_id, root = bench_k3.prompt_bench_repo(p)
    work = Path(tempfile.mkdtemp(prefix="expertmesh-timeline-"))
    hub = bench_k3._Hub(root.parent.parent, PER_CONNECTION, LINK, TTFB_S)
    try:
        with hub_client.using_endpoint(hub.url):
            pull(repo_id, home=work / "pulled", progress=False)
            vocab = bench_prompt._vocab(work / "pulled", repo_id)
            for setting in args.settings.split(","):
                r = one(repo_id, work / "pulled", hub.url, args.tokens, vocab, setting, p.expert_bytes)
                print(
                    f"{r['setting']:<9} TTFT {r['ttft_s']:.2f} s = {r['over_byte_floor']:.3f}x the byte floor; "
                    f"link below half {r['link_below_half_s']:.1f} s; compute after each layer's last byte {r['tail_s']} s",
                    flush=True,
                )
    finally:
        hub.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
