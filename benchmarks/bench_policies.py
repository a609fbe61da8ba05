"""RAM policies on real routing: record a trace on the trained demo model, replay it at several
budgets through every policy and through Belady's offline optimum, side by side.

Prompts are the starts of the demo model's held-out docstrings (never trained on), each
continued with seeded sampling, one conversation after another as a household would use it.

Rows `ahead_H` measure how much foresight the gap to Belady takes: LFU's counts, except that an
expert the rest of this pass or the next H passes use is never evicted for one they do not (among
those, the one used last goes). A real policy can at best guess the rest of the current pass
(the routers of later layers applied early), which is `ahead_0`; the next tokens are not sampled
yet. If `ahead_0` stays far below Belady, no online policy will close the gap.

    python benchmarks/bench_policies.py [--prompts 24] [--tokens 64] [--budgets 10%,25%,50%]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from expertmesh.assembly import open_model
from expertmesh.devtools.local_hub import HubServer
from expertmesh.devtools.tiny.demo_model import DEMO_DIR, HELDOUT_FILE, REPO_ID, make_demo_model
from expertmesh.node.config import StoreConfig
from expertmesh.node.engine.generation import Generator, SamplingSettings
from expertmesh.node.hub import client as hub_client
from expertmesh.node.hub.pull import pull
from expertmesh.node.observability.routing_trace import Trace, read_trace, replay


def foresight_hit_rate(trace: Trace, slots: int, passes_ahead: int, ageing_period: int | None = None) -> float:
    """LFU (halved every `ageing_period` uses, as the RAM tier's) that knows which experts the rest
    of the current pass and the next `passes_ahead` passes use. O(uses x slots): for bench traces."""
    accesses = [((layer, e), p) for p, layer, experts in trace.calls for e in experts]
    n = len(accesses)
    next_use, seen = [n] * n, {}
    for i in range(n - 1, -1, -1):
        next_use[i] = seen.get(accesses[i][0], n)
        seen[accesses[i][0]] = i
    last_index = {p: i for i, (_, p) in enumerate(accesses)}
    ageing_period = ageing_period or max(1024, 64 * slots)
    counts: dict = {}
    held: dict = {}  # key -> index of its next use
    hits = 0
    for i, (key, p) in enumerate(accesses):
        if (i + 1) % ageing_period == 0:
            counts = {k: c // 2 for k, c in counts.items()}
        counts[key] = counts.get(key, 0) + 1
        hits += key in held
        held[key] = next_use[i]
        if len(held) > slots:
            horizon = last_index.get(p + passes_ahead, n)
            held.pop(min(held, key=lambda k: (1, -held[k]) if held[k] <= horizon else (0, counts.get(k, 0))))
    return hits / n if n else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--budgets", default="10%,25%,50%")
    ap.add_argument("--keep-trace", metavar="FILE", help="also save the recorded trace (for `expertmesh replay`)")
    args = ap.parse_args()

    docs = [d.strip() for d in (DEMO_DIR / HELDOUT_FILE).read_text().split("<|endoftext|>") if len(d.split()) >= 4]
    work = Path(tempfile.mkdtemp(prefix="bench-policies-"))
    make_demo_model(work / "hub" / REPO_ID)
    trace_path = work / "trace.jsonl"
    with HubServer(work / "hub") as hub, hub_client.using_endpoint(hub.url):
        pull(REPO_ID, home=work / "home", progress=False)
        sm = open_model(REPO_ID, home=work / "home", store=StoreConfig(trace_path=trace_path, prefetch=False))
        gen = Generator(sm)
        for i, doc in enumerate(docs[: args.prompts]):
            prompt = " ".join(doc.split()[:6])
            gen.reset()
            for _ in gen.generate(
                sm.tokenizer.encode(prompt), SamplingSettings(max_tokens=args.tokens, temp=0.7, seed=i)
            ):
                pass
        sm.close()
    trace = read_trace(trace_path)
    if args.keep_trace:
        Path(args.keep_trace).write_text(trace_path.read_text())
    slots = [round(trace.total_experts * float(b.strip("%")) / 100) for b in args.budgets.split(",")]
    table = replay(trace, slots)
    for h in (0, 1, 2, 4):
        table[f"ahead_{h}"] = {n: foresight_hit_rate(trace, n, h) for n in slots}
    print(
        f"{REPO_ID}: {min(args.prompts, len(docs))} prompts, {trace.passes} passes, {len(trace.accesses())} expert uses"
    )
    print(
        f"{'policy':<8}"
        + "".join(f"{f'{n} ({100 * n / trace.total_experts:.0f}%)':>14}" for n in slots)
        + "".join(f"{f'vs Belady@{100 * n / trace.total_experts:.0f}%':>16}" for n in slots)
    )
    for name, rates in table.items():
        print(
            f"{name:<8}"
            + "".join(f"{rates[n]:>14.3f}" for n in slots)
            + "".join(f"{rates[n] / table['belady'][n]:>16.2f}" for n in slots)
        )


if __name__ == "__main__":
    main()
