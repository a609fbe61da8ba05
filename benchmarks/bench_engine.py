"""Streamed generation against mlx-lm with the whole model in memory, side by side in one run.

Measures on a tiny fixture (default kimi_k3):
  1. s/token of expertmesh with every expert already in RAM against `mlx_lm.stream_generate`
     on the same repo (the same prompt, greedy, the same number of tokens), as a ratio;
  2. on a cold cache, the expert bytes the Hub served per token against the bytes of the
     distinct experts the generation used (1.0x means every expert crossed the link once).

    python benchmarks/bench_engine.py [--arch kimi_k3] [--tokens 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm
from mlx_lm.sample_utils import make_sampler

from expertmesh.assembly import open_model
from expertmesh.devtools.local_hub import HubServer
from expertmesh.devtools.tiny import make_tiny_model
from expertmesh.node.config import StoreConfig
from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings
from expertmesh.node.hub import client as hub_client
from expertmesh.node.hub.pull import pull

PROMPT = "In the beginning the household had one laptop and a model far too large for it, so"


def _time_expertmesh(gen: Generator, ids: list[int], tokens: int) -> tuple[float, list[int]]:
    gen.reset()
    t0 = time.perf_counter()
    out = [t.id for t in gen.generate(ids, SamplingSettings(max_tokens=tokens))]
    return time.perf_counter() - t0, out


def _time_mlx_lm(model, tokenizer, ids: list[int], tokens: int) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    out = []
    for r in mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=tokens, sampler=make_sampler(0.0)):
        if r.finish_reason in (None, "length"):  # its last response repeats the last token, or is the eos
            out.append(r.token)
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="kimi_k3")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-engine-"))
    repo_id = f"expertmesh/tiny-{args.arch}"
    repo = make_tiny_model(work / "hub" / repo_id, args.arch, seed=0)
    with HubServer(work / "hub") as hub, hub_client.using_endpoint(hub.url):
        pull(repo_id, home=work / "home", progress=False)
        sm = open_model(repo_id, home=work / "home", store=StoreConfig(ram_budget="2GB"))
        ids = sm.tokenizer.encode(PROMPT)
        gen = Generator(sm)

        # cold: every expert comes from the Hub once
        served_before = hub.stats().get("bytes_served", 0)
        summary = GenerationSummary()
        cold = [t.id for t in gen.generate(ids, SamplingSettings(max_tokens=args.tokens), summary=summary)]
        hub_bytes = hub.stats().get("bytes_served", 0) - served_before
        distinct = sm.store.ram.keys()  # the budget holds them all: nothing was evicted
        assert sm.store.ram.evictions == 0
        distinct_bytes = sum(sm.index.expert(layer, e).nbytes for layer, e in distinct)

        model, tokenizer = mlx_lm.load(str(repo))
        if not mx.metal.is_available() and args.arch == "qwen3_moe":
            model.set_dtype(mx.float32)  # as the streamed model does on CPU for dense experts
        ours, theirs = [], []
        for _ in range(args.repeats):  # interleaved, so drift in machine load hits both alike
            t, out = _time_expertmesh(gen, ids, args.tokens)
            ours.append(t)
            assert out == cold
            t, ref = _time_mlx_lm(model, tokenizer, ids, args.tokens)
            theirs.append(t)
        sm.close()

    if ref != cold:
        diverge = next(i for i, (x, y) in enumerate(zip(ref, cold)) if x != y)
        raise SystemExit(f"expertmesh and mlx-lm disagree from token {diverge}: {cold} vs {ref}")
    n = len(cold)
    a, b = statistics.median(ours) / n, statistics.median(theirs) / n
    print(f"{args.arch}, prompt {len(ids)} tokens, {n} generated, median of {args.repeats} runs")
    print(
        f"  warm RAM  expertmesh {a * 1000:8.2f} ms/token   mlx-lm (whole model) {b * 1000:8.2f} ms/token"
        f"   ratio {a / b:.2f}x"
    )
    print(
        f"  cold      Hub bytes {hub_bytes} for {len(distinct)} distinct experts of {distinct_bytes} bytes"
        f"   ratio {hub_bytes / distinct_bytes:.3f}x   ({hub_bytes / n:.0f} Hub bytes/token)"
    )
    print(f"  cold run  {summary.lines()[0]}")


if __name__ == "__main__":
    main()
