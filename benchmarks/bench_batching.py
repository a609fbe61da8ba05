"""Continuous batching (node/engine/batching.py) against one request at a time, side by side in one run.

For each model and regime, four requests arrive at once (four different prompts, greedy,
`--tokens` each: end-of-text is ignored unless `--stop-at-eos`, as in bench_speculative.py) and are
served
  - batch1: one after another, each alone on a fresh `Generator` (a node with `--max-batch 1`,
    no speculation);
  - batch4: together, in one `BatchEngine` of four rows (a node with `--max-batch 4`).
Per configuration: aggregate tokens/s (every request's tokens over the time until the last one
ended), p95 time to first token (from the common arrival, so batch1's queue counts, as a user
sees it), expert reads per generated token (the store's expert uses: batch1 sums every request's
reads, batch4 reads the union of the rows' experts once per step) and whether each request's
tokens equal its batch1 tokens. Then the target on joining: p95 time to first token of a short
request that arrives while a long generation runs in the batch, against the same request alone.

Regimes: warm_ram (every expert already in the RAM tier) and warm_disk (as `expertmesh bench`
defines it: a new node for each configuration, the experts on its disk, its RAM tier empty). Models: the tiny and the wide random
Kimi K3 (warm RAM); the trained demo model and Kimi K3's proportions (warm disk; K3's proportions
in the SMALL variant of expertmesh/devtools/tiny/k3_proportions.py, ~1.6 MB experts, unless `--k3-full`:
17.5 MB experts, 3.4 GB written first).

    python benchmarks/bench_batching.py [--tokens 32] [--models tiny,wide,demo,k3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from expertmesh.assembly import open_model
from expertmesh.devtools.local_hub import HubServer
from expertmesh.node.config import StoreConfig
from expertmesh.node.engine.batching import BatchEngine
from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings
from expertmesh.node.hub import client as hub_client
from expertmesh.node.hub.pull import pull
from expertmesh.node.store.stats import SOURCES

PROMPTS = (
    "Return a new dictionary with the keys",
    "This module provides functions for",
    "Create a list of the values in",
    "The household had one laptop and",
    # more, for `--more-sizes` up to 8
    "Read the configuration file from",
    "Raise an error if the value",
    "Return the number of items in",
    "Write the data to the stream",
)
MAIN = 4  # the batch: four requests at once
LATE_PROMPT = "Open the file and"
MODELS = {  # name -> (regime, how to write its repo)
    "tiny": "warm_ram",
    "wide": "warm_ram",
    "demo": "warm_disk",
    "k3": "warm_disk",
}


@dataclass
class Config:
    name: str
    model: str
    regime: str
    aggregate_tokens_per_s: float
    p95_ttft_s: float
    expert_reads_per_token: float
    tokens: int = 0
    seconds: float = 0.0
    same_tokens_as_batch1: bool = True
    sources: dict = field(default_factory=dict)


def _write_repo(model: str, hub_dir: Path, k3_full: bool) -> str:
    if model == "tiny":
        from expertmesh.devtools.tiny import make_tiny_model

        make_tiny_model(hub_dir / "expertmesh/tiny-kimi_k3", "kimi_k3", seed=0)
        return "expertmesh/tiny-kimi_k3"
    if model == "wide":
        from expertmesh.devtools.tiny.kimi_k3 import build_wide

        (hub_dir / "expertmesh/wide-kimi_k3").mkdir(parents=True)
        build_wide(hub_dir / "expertmesh/wide-kimi_k3", seed=0)
        return "expertmesh/wide-kimi_k3"
    if model == "demo":
        from expertmesh.devtools.tiny.demo_model import REPO_ID, make_demo_model

        make_demo_model(hub_dir / REPO_ID)
        return REPO_ID
    from expertmesh.devtools.tiny import k3_proportions

    repo_id = "expertmesh/k3-proportions"
    (hub_dir / repo_id).mkdir(parents=True)
    (k3_proportions.build if k3_full else k3_proportions.build_small)(hub_dir / repo_id, seed=0)
    return repo_id


def _uses(sm) -> int:
    stats = sm.store.stats.snapshot()
    return sum(stats.uses[s] for s in SOURCES)


def _p95(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(0.95 * (len(values) - 1)))]


def _one_at_a_time(sm, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], list[float], float]:
    """batch1: the requests one after another; (tokens, TTFT from the common arrival, seconds)."""
    outs, ttfts = [], []
    t0 = time.perf_counter()
    for ids in prompts:
        out = []
        for t in Generator(sm).generate(ids, SamplingSettings(max_tokens=tokens), summary=GenerationSummary()):
            if not out:
                ttfts.append(time.perf_counter() - t0)
            out.append(t.id)
        outs.append(out)
    return outs, ttfts, time.perf_counter() - t0


def _together(engine: BatchEngine, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], list[float], float]:
    """batch4: the requests at once in the engine, each read on a thread of its own."""
    outs: list[list[int]] = [[] for _ in prompts]
    ttfts: list[float] = [0.0] * len(prompts)
    errors: list[BaseException] = []
    t0 = time.perf_counter()

    def run(i: int) -> None:
        try:
            for t in engine.generate(prompts[i], SamplingSettings(max_tokens=tokens)):
                if not outs[i]:
                    ttfts[i] = time.perf_counter() - t0
                outs[i].append(t.id)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3600)
    if errors:
        raise errors[0]
    return outs, ttfts, time.perf_counter() - t0


def _ttft_joining(sm, engine: BatchEngine, tokenizer, long_tokens: int, repeats: int) -> dict:
    """p95 TTFT of a short request alone in the engine, and arriving while a long one decodes."""
    late = tokenizer.encode(LATE_PROMPT)
    settings = SamplingSettings(max_tokens=1)

    def ttft() -> float:
        t0 = time.perf_counter()
        next(iter(engine.generate(late, settings)))
        return time.perf_counter() - t0

    alone = [ttft() for _ in range(repeats)]
    during = []
    for _ in range(repeats):
        started, measured = threading.Event(), threading.Event()

        def long_run(started: threading.Event = started, measured: threading.Event = measured) -> None:
            ids = tokenizer.encode(PROMPTS[0])
            for n, _t in enumerate(engine.generate(ids, SamplingSettings(max_tokens=long_tokens))):
                if n == 2:
                    started.set()
                if measured.is_set():  # the late request has its first token: the long one may go
                    break

        runner = threading.Thread(target=long_run, daemon=True)
        runner.start()
        started.wait(600)
        during.append(ttft())
        measured.set()
        runner.join(3600)
    return {
        "alone_p95_ttft_s": _p95(alone),
        "during_long_p95_ttft_s": _p95(during),
        "ratio": _p95(during) / _p95(alone),
    }


def _measure(
    name: str, model: str, regime: str, sm, engine, prompts, tokens: int, base
) -> tuple[Config, list[list[int]]]:
    before, stats0 = _uses(sm), sm.store.stats.snapshot()
    if engine is None:
        outs, ttfts, seconds = _one_at_a_time(sm, prompts, tokens)
    else:
        outs, ttfts, seconds = _together(engine, prompts, tokens)
    n = sum(len(o) for o in outs)
    since = sm.store.stats.since(stats0)
    return Config(
        name,
        model,
        regime,
        n / seconds,
        _p95(ttfts),
        (_uses(sm) - before) / n,
        n,
        seconds,
        base is None or outs == base,
        {s: since.uses[s] for s in SOURCES if since.uses[s]},
    ), outs


def _bench_model(
    model: str, repo_id: str, root: Path, tokens: int, repeats: int, ignore_eos: bool = True, more: tuple = ()
) -> tuple[list[Config], dict]:
    """batch1 then batch4 on `model`, and the joining TTFT. warm_ram: one node whose RAM tier holds
    every expert the prompts use; warm_disk (as `expertmesh bench` defines it): a new node for each
    configuration, its disk holding those experts and its RAM tier empty."""
    regime = MODELS[model]
    home = root / f"home-{model}"
    pull(repo_id, home=home, progress=False)

    def node():
        sm = open_model(repo_id, home=home, store=StoreConfig(prefetch=False, fill=False))
        if ignore_eos:  # the greedy demo ends most answers within a few tokens: a batch of one
            sm.tokenizer.eos_token_ids = set()
        return sm

    sm = node()
    every = [sm.tokenizer.encode(p) for p in PROMPTS[: max((MAIN, *more))]]
    prompts = every[:MAIN]
    _one_at_a_time(sm, every, tokens)  # every expert these requests use: in RAM, and on disk
    configs = []
    if regime == "warm_disk":
        sm.close()  # publishes every expert on the disk tier
        sm = node()
    one, base = _measure("batch1", model, regime, sm, None, prompts, tokens, None)
    configs.append(one)
    if regime == "warm_disk":
        sm.close()
        sm = node()
    engine = BatchEngine(sm, max_batch=4)
    try:
        four, _ = _measure(f"batch{MAIN}", model, regime, sm, engine, prompts, tokens, base)
        configs.append(four)
        joining = _ttft_joining(sm, engine, sm.tokenizer, 4 * tokens, repeats)
    finally:
        engine.close()
        sm.close()
    for n in more:  # other batch sizes, for the default: n requests of their own
        sm = node()
        if regime == "warm_ram":
            _one_at_a_time(sm, every, tokens)
        engine = BatchEngine(sm, max_batch=n)
        try:
            configs.append(_measure(f"batch{n}", model, regime, sm, engine, every[:n], tokens, None)[0])
        finally:
            engine.close()
            sm.close()
    return configs, {"model": model, "regime": regime, **joining}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32, help="tokens per request (default %(default)s)")
    ap.add_argument("--models", default="tiny,wide,demo,k3", help="comma-separated of " + ",".join(MODELS))
    ap.add_argument("--repeats", type=int, default=5, help="arrivals timed for the joining TTFT (default %(default)s)")
    ap.add_argument("--k3-full", action="store_true", help="K3's real 17.5 MB experts instead of the SMALL variant")
    ap.add_argument(
        "--stop-at-eos", action="store_true", help="end a request at its end-of-text (default: --tokens each)"
    )
    ap.add_argument(
        "--more-sizes", default="", metavar="N,M", help=f"also batches of these sizes (2..{len(PROMPTS)}), e.g. 2,8"
    )
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    more = tuple(int(n) for n in args.more_sizes.split(",") if n)
    if any(not 2 <= n <= len(PROMPTS) for n in more):
        ap.error(f"--more-sizes must be within 2..{len(PROMPTS)}")
    models = [m for m in args.models.split(",") if m]
    unknown = set(models) - set(MODELS)
    if unknown:
        ap.error(f"unknown models: {', '.join(sorted(unknown))}")
    root = Path(tempfile.mkdtemp(prefix="bench-batching-"))
    configs: list[Config] = []
    joins: list[dict] = []
    try:
        hub_dir = root / "hub"
        repos = {model: _write_repo(model, hub_dir, args.k3_full) for model in models}
        with HubServer(hub_dir) as hub, hub_client.using_endpoint(hub.url):
            for model in models:
                c, j = _bench_model(model, repos[model], root, args.tokens, args.repeats, not args.stop_at_eos, more)
                configs += c
                joins.append(j)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"uptime: {os.popen('uptime').read().strip()}")
    print(
        f"{'model':6} {'regime':9} {'config':6} {'tokens':>6} {'tok/s':>8} {'p95 TTFT s':>10} "
        f"{'reads/token':>11} {'same':>5}"
    )
    for c in configs:
        print(
            f"{c.model:6} {c.regime:9} {c.name:6} {c.tokens:6d} {c.aggregate_tokens_per_s:8.2f} "
            f"{c.p95_ttft_s:10.3f} {c.expert_reads_per_token:11.2f} {str(c.same_tokens_as_batch1):>5}"
        )
    print()
    ratios = []
    for model in models:
        one, four = (next(c for c in configs if c.model == model and c.name == n) for n in ("batch1", "batch4"))
        ratio = {
            "model": model,
            "regime": one.regime,
            "tokens_per_s_ratio": four.aggregate_tokens_per_s / one.aggregate_tokens_per_s,
            "reads_per_token_ratio": four.expert_reads_per_token / one.expert_reads_per_token,
        }
        ratios.append(ratio)
        print(
            f"{model:6} {one.regime:9} batch4/batch1: {ratio['tokens_per_s_ratio']:.2f}x tokens/s, "
            f"{ratio['reads_per_token_ratio']:.2f}x expert reads per token"
        )
        for c in configs:
            if c.model == model and c.name not in ("batch1", "batch4"):
                print(
                    f"{model:6} {one.regime:9} {c.name}/batch1: "
                    f"{c.aggregate_tokens_per_s / one.aggregate_tokens_per_s:.2f}x tokens/s, "
                    f"{c.expert_reads_per_token / one.expert_reads_per_token:.2f}x expert reads per token"
                )
    for j in joins:
        print(
            f"{j['model']:6} joining: p95 TTFT alone {j['alone_p95_ttft_s']:.3f} s, during a long generation "
            f"{j['during_long_p95_ttft_s']:.3f} s ({j['ratio']:.2f}x)"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"configs": [asdict(c) for c in configs], "ratios": ratios, "joining": joins}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
