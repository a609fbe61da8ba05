"""Speculative decoding on the trained demo model: with and without, side by side in one run.

For each configuration (off, ngram, draft, self) and each kind of prompt (repetitive: code and lists;
prose) it measures, greedy, every expert already in RAM:
  - forward passes of the big model per generated token (decode passes, after the prompt's);
  - s/token (a) as is, warm RAM, and (b) with an emulated fixed cost per forward pass
    (`--pass-cost-ms`, a sleep per pass) standing in for a LAN round trip per layer or a core
    re-read, the costs speculation amortises;
  - expert bytes per generated token (the bytes of the experts each pass used, by the store's
    count): speculation is not expected to save these;
  - whether the output equals the plain path's (greedy, it must, up to ties: the demo's core
    runs in bf16 here, where a pass of k tokens and k passes of one round differently, so a
    top-2 gap of one bf16 step can flip (docs/benchmarks.md records where it did); in float32
    every output is the plain path's, as tests/test_speculative.py says).
Every prompt generates `--tokens` tokens (end-of-text is ignored unless `--stop-at-eos`): a
tiny greedy model then falls into loops, which flatters n-grams on prose too; the first tokens,
before any loop, are in `--stop-at-eos`'s run. `draft` drafts with the demo's draft model
(expertmesh/devtools/tiny/draft/: a 2-layer dense Llama distilled from the demo, about a fifth of its cost per
token); `self` drafts with the demo model itself, loaded by mlx-lm: the upper bound of a draft
model's acceptance, at a draft cost no real draft model has. Targets (issue 7): passes/token
<= 0.6 on repetitive prompts, >= 1.5x faster under (b).

    python benchmarks/bench_speculative.py [--tokens 48] [--pass-cost-ms 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from expertmesh.assembly import open_model
from expertmesh.devtools.local_hub import HubServer
from expertmesh.devtools.tiny.demo_model import DRAFT_DIR, REPO_ID, make_demo_model
from expertmesh.node.config import SpeculationConfig, StoreConfig
from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings
from expertmesh.node.hub import client as hub_client
from expertmesh.node.hub.pull import pull

PROMPTS = {
    "code": [
        "x = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2,",
        "os.path.join(a, b)\nos.path.join(a, c)\nos.path.join(a,",
    ],
    "list": [
        "1. Return the name.\n2. Return the value.\n3. Return the",
        "- alpha\n- beta\n- gamma\n- alpha\n- beta\n-",
    ],
    "prose": ["This module provides functions for", "Create a new dictionary with keys from"],
}


class _CountingGenerator(Generator):
    """A Generator that counts its forward passes and sleeps `pass_cost_s` in each."""

    pass_cost_s = 0.0

    def _forward(self, tokens):
        self.passes = getattr(self, "passes", 0) + 1
        if self.pass_cost_s:
            time.sleep(self.pass_cost_s)
        return super()._forward(tokens)


def _one(sm, spec: SpeculationConfig | None, ids: list[int], tokens: int, pass_cost_s: float, draft_source=None):
    gen = _CountingGenerator(sm, spec, draft_source=draft_source)
    gen.pass_cost_s = pass_cost_s
    summary = GenerationSummary()
    out, at_first, passes_first, t_first = [], None, 0, 0.0
    for t in gen.generate(ids, SamplingSettings(max_tokens=tokens), summary=summary):
        if not out:
            at_first, passes_first, t_first = sm.store.stats.snapshot(), gen.passes, time.perf_counter()
        out.append(t.id)
    t_end = time.perf_counter()
    decode = sm.store.stats.since(at_first)
    n = len(out)
    return {
        "ids": out,
        "tokens": n,
        "passes_per_token": (gen.passes - passes_first) / max(1, n - 1),
        "s_per_token": (t_end - t_first) / max(1, n - 1),
        "expert_bytes_per_token": sum(decode.bytes.values()) / max(1, n - 1),
        "acceptance": summary.speculation.acceptance if summary.speculation else None,
    }


def run(tokens: int, pass_cost_ms: float, modes: list[str], ignore_eos: bool = True) -> dict:
    from expertmesh.node.engine.speculative import ModelDraft

    work = Path(tempfile.mkdtemp(prefix="expertmesh-spec-"))
    rows = []
    try:
        repo_dir = make_demo_model(work / "hub" / REPO_ID)
        with HubServer(work / "hub") as hub, hub_client.using_endpoint(hub.url):
            pull(REPO_ID, home=work / "home", progress=False)
            sm = open_model(REPO_ID, home=work / "home", store=StoreConfig(ram_budget="100%", prefetch=False))
            try:
                if ignore_eos:  # the greedy demo ends most answers within a few tokens
                    sm.tokenizer.eos_token_ids = set()
                prompts = {kind: [sm.tokenizer.encode(p) for p in ps] for kind, ps in PROMPTS.items()}
                for ps in prompts.values():  # warm RAM (and MLX's kernels) with every prompt
                    for ids in ps:
                        _one(sm, None, ids, tokens, 0.0)
                plain = {}
                drafts = {"draft": DRAFT_DIR, "self": repo_dir}  # the draft model; the demo as its own
                for mode in ["off", *modes]:
                    spec = (
                        None
                        if mode == "off"
                        else SpeculationConfig(
                            mode="ngram" if mode == "ngram" else "draft",
                            draft_repo=str(drafts[mode]) if mode in drafts else None,
                        )
                    )
                    source = ModelDraft.load(str(drafts[mode]), sm.tokenizer) if mode in drafts else None
                    for kind, ps in prompts.items():
                        for scenario, cost in (("warm", 0.0), ("pass_cost", pass_cost_ms / 1000)):
                            rs = [_one(sm, spec, ids, tokens, cost, source) for ids in ps]
                            if mode == "off":
                                plain[(kind, scenario)] = [r["ids"] for r in rs]
                            rows.append(
                                {
                                    "mode": mode,
                                    "kind": kind,
                                    "scenario": scenario,
                                    "passes_per_token": statistics.mean(r["passes_per_token"] for r in rs),
                                    "s_per_token": statistics.mean(r["s_per_token"] for r in rs),
                                    "expert_bytes_per_token": statistics.mean(r["expert_bytes_per_token"] for r in rs),
                                    "acceptance": None
                                    if mode == "off"
                                    else statistics.mean(r["acceptance"] for r in rs),
                                    "same_output": [r["ids"] for r in rs] == plain[(kind, scenario)],
                                }
                            )
            finally:
                sm.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "model": REPO_ID,
        "tokens": tokens,
        "pass_cost_ms": pass_cost_ms,
        "ignore_eos": ignore_eos,
        "prompts": PROMPTS,
        "rows": rows,
    }


def print_table(doc: dict) -> None:
    base = {(r["kind"], r["scenario"]): r for r in doc["rows"] if r["mode"] == "off"}
    print(
        f"{doc['model']}, {doc['tokens']} tokens per prompt, greedy, warm RAM; pass_cost = +{doc['pass_cost_ms']} ms "
        "per forward pass"
    )
    print(
        f"{'mode':<6} {'prompts':<6} {'scenario':<9} {'passes/tok':>10} {'ms/tok':>8} {'speed-up':>8} "
        f"{'expert B/tok':>12} {'vs off':>6} {'accept':>6} {'same':>5}"
    )
    for r in doc["rows"]:
        b = base[(r["kind"], r["scenario"])]
        acc = f"{r['acceptance']:.0%}" if r["acceptance"] is not None else "-"
        print(
            f"{r['mode']:<6} {r['kind']:<6} {r['scenario']:<9} {r['passes_per_token']:>10.2f} "
            f"{r['s_per_token'] * 1000:>8.1f} {b['s_per_token'] / r['s_per_token']:>7.2f}x "
            f"{r['expert_bytes_per_token']:>12.0f} {r['expert_bytes_per_token'] / max(1, b['expert_bytes_per_token']):>5.2f}x "
            f"{acc:>6} {'yes' if r['same_output'] else 'NO':>5}"
        )
    if any(r["mode"] == "self" for r in doc["rows"]):
        print("self: the demo model as its own draft, the upper bound of a draft model's acceptance (not a real draft)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--pass-cost-ms", type=float, default=20.0, help="emulated fixed cost per forward pass (b)")
    ap.add_argument(
        "--modes",
        default="ngram,draft,self",
        help="compared with off: ngram, draft (the demo's draft model), self (the demo as its own draft)",
    )
    ap.add_argument(
        "--stop-at-eos",
        action="store_true",
        help="stop at the end-of-text token (the greedy demo then answers in ~5-20 tokens)",
    )
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    doc = run(args.tokens, args.pass_cost_ms, [m for m in args.modes.split(",") if m], not args.stop_at_eos)
    print_table(doc)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
