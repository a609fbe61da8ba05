"""Remote expert execution against fetching experts, side by side in one run (issue 8).

A household on one machine: a full node N and two compute peers P1, P2 that together hold every
expert of the trained demo model (each the experts it owns, as `expertmesh warm` spreads them),
all in this process with real gRPC on loopback. Links are emulated with K3's proportions scaled
to the demo model (see expertmesh/devtools/link_emulation.py and expertmesh/devtools/bench.py): gigabit Ethernet between the
nodes (118 MB/s, 1 ms round trip; an activation row charged so that its ratio to an expert is
K3's), a 12.5 MB/s Hub link, both sped up by `--time-scale`.

    remote     N with no disk, its peers compute the experts they hold (move activations)
    fetch      N with no disk, fetching the same experts' bytes from those peers
    alone      N without peers, a warm disk cache of one third of the experts, the Hub for the rest

Every configuration has the same RAM budget (`--ram-fraction` of the experts) and must produce
the same greedy tokens. Targets: remote >= 5x faster than fetch, faster than alone, and LAN
bytes per token >= 100x fewer than fetch (shown in raw bytes and as K3 would see them).

    python benchmarks/bench_remote.py [--tokens 12] [--time-scale 0.2] [--json out.json]

At K3's real proportions (17.5 MB experts), one process per node and kernel-shaped links instead of
this scaled emulation: `expertmesh lab` (expertmesh/devtools/lab/, docs/lab.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from expertmesh.assembly import build_node, open_model
from expertmesh.devtools.bench import K3_EXPERT_BYTES, PROMPTS, LinkSettings
from expertmesh.devtools.link_emulation import LanInterceptor, k3_lan
from expertmesh.devtools.local_hub import HubServer
from expertmesh.devtools.tiny.demo_model import REPO_ID, make_demo_model
from expertmesh.node.config import HouseholdConfig, NodeConfig, RemoteConfig, RpcConfig, StoreConfig
from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings
from expertmesh.node.household.warm import describe_nodes, warm, warm_order
from expertmesh.node.hub import client as hub_client
from expertmesh.node.hub.pull import pull
from expertmesh.node.sizes import format_size

SECRET = "bench-remote"
K3_HUB = 12.5e6
WARM_UP = "A short untimed generation first:"


def _generate(sm, prompts: list[list[int]], tokens: int) -> list[GenerationSummary]:
    out = []
    for ids in prompts:
        s = GenerationSummary()
        s.ids = [t.id for t in Generator(sm).generate(ids, SamplingSettings(max_tokens=tokens), summary=s)]  # type: ignore[attr-defined]
        out.append(s)
    return out


def _row(name: str, summaries: list[GenerationSummary], lan_scale: float) -> dict:
    tokens = sum(s.generated_tokens for s in summaries)
    uses = {k: sum(s.experts.uses[k] for s in summaries) for k in summaries[0].experts.uses}
    act = sum(s.experts.remote["sent_bytes"] + s.experts.remote["received_bytes"] for s in summaries)
    fetched = sum(s.experts.bytes["peer"] for s in summaries)
    decode = [(s.seconds - s.time_to_first_token_s) / max(1, s.generated_tokens - 1) for s in summaries]
    return {
        "name": name,
        "s_per_token": statistics.median(decode),
        "tokens": tokens,
        "ttft_s": statistics.median(s.time_to_first_token_s for s in summaries),
        "lan_bytes_per_token": (act + fetched) / max(1, tokens),
        "k3_lan_bytes_per_token": (act * lan_scale + fetched) / max(1, tokens),
        "hub_bytes_per_token": sum(s.experts.bytes["hub"] for s in summaries) / max(1, tokens),
        "uses": uses,
        "fallbacks": {
            k: sum(s.experts.remote[k] for s in summaries)
            for k in summaries[0].experts.remote
            if k.startswith("fallback_")
        },
        "outputs": [s.ids for s in summaries],
    }  # type: ignore[attr-defined]


def run(tokens: int, time_scale: float, ram_fraction: float, progress=print) -> dict:
    work = Path(tempfile.mkdtemp(prefix="expertmesh-bench-remote-"))
    closers = []
    try:
        make_demo_model(work / "hub" / REPO_ID)
        with HubServer(work / "hub") as hub, hub_client.using_endpoint(hub.url):
            homes = {}
            for name in ("p1", "p2", "remote", "fetch", "alone"):
                pull(REPO_ID, home=work / name, progress=False)
                homes[name] = work / name
            probe = open_model(REPO_ID, home=homes["p1"], store=StoreConfig(prefetch=False))
            index, tokenizer = probe.index, probe.tokenizer
            block = probe.blocks[0]
            row_bytes = block.input_width * 4  # float32 on the CPU
            probe.close()
            expert_bytes = max(loc.nbytes for loc in index.experts.values())
            ram = str(int(len(index.experts) * ram_fraction) * expert_bytes + expert_bytes // 2)
            lan = k3_lan(expert_bytes, row_bytes, time_scale)
            hub_link = LinkSettings.scaled(expert_bytes, time_scale)
            hub_link.bandwidth = hub_link.per_connection = K3_HUB * expert_bytes / K3_EXPERT_BYTES / time_scale
            progress(
                f"{REPO_ID}: {len(index.experts)} experts of {format_size(expert_bytes)}, activation rows of "
                f"{row_bytes} B; RAM budget {ram_fraction:.0%} of the experts"
            )
            progress(
                f"LAN {format_size(lan.bandwidth)}/s, round trip {lan.rtt_s * 1000:.2f} ms, activations charged "
                f"x{lan.activation_scale:.3f} (K3's row/expert ratio); Hub {format_size(hub_link.bandwidth)}/s, "
                f"first byte {hub_link.ttfb_s * 1000:.1f} ms; time scale {time_scale}"
            )

            peers = []
            for name in ("p1", "p2"):
                config = NodeConfig(
                    REPO_ID,
                    home=homes[name],
                    node_id=name,
                    store=StoreConfig(prefetch=False),
                    household=HouseholdConfig(secret=SECRET),
                    rpc=RpcConfig(host="127.0.0.1", port=0),
                )
                node = build_node(config, interceptors=[LanInterceptor(lan)]).start()
                closers.append(node.close)
                peers.append(node.rpc.address)
            t0 = time.perf_counter()
            nodes, _ = describe_nodes(peers, index, SECRET)
            kept = warm(index, nodes, SECRET)
            progress(
                f"warm: {sum(k.kept for k in kept)} experts spread over the two peers in "
                f"{time.perf_counter() - t0:.1f} s"
            )

            third = warm_order(index)[: len(index.experts) // 3]
            alone = open_model(
                REPO_ID,
                home=homes["alone"],
                store=StoreConfig(prefetch=False, disk_budget=str(len(third) * expert_bytes)),
            )
            for layer in index.moe_layers:  # fetched onto its disk (nothing computed)
                for _ in alone.store.layer_groups(layer, [e for lay, e in third if lay == layer]):
                    pass
            alone.close()

            hub.knobs = hub_link.knobs()  # from here on the Hub is a home link
            prompts = [tokenizer.encode(p) for p in PROMPTS]
            results = []
            for name in ("remote", "fetch", "alone"):
                cfg = StoreConfig(
                    ram_budget=ram, disk_budget="0" if name != "alone" else str(len(third) * expert_bytes)
                )
                household = None
                if name != "alone":  # "remote" takes the LAN as gigabit; "fetch" never runs experts on peers
                    remote = RemoteConfig(lan_bandwidth=lan.bandwidth) if name == "remote" else None
                    household = HouseholdConfig(secret=SECRET, peers=peers, remote=remote)
                config = NodeConfig(REPO_ID, home=homes[name], node_id=f"n-{name}", store=cfg, household=household)
                sm = build_node(config).start().model
                progress(f"  {name} ...")
                _generate(sm, [tokenizer.encode(WARM_UP)], 4)  # connections made, kernels compiled, estimates measured
                t0 = time.perf_counter()
                summaries = _generate(sm, prompts, tokens)
                sm.close()
                results.append(_row(name, summaries, lan.activation_scale))
                progress(
                    f"  {name}: {results[-1]['s_per_token'] * 1000:.1f} ms/token in {time.perf_counter() - t0:.1f} s"
                )
    finally:
        for close in closers:
            close()
        shutil.rmtree(work, ignore_errors=True)
    ref = results[-1]["outputs"]
    for r in results:
        if r["outputs"] != ref:
            raise AssertionError(f"{r['name']} generated other tokens than the node alone: the comparison is void")
    return {
        "model": REPO_ID,
        "tokens_per_prompt": tokens,
        "time_scale": time_scale,
        "ram_fraction": ram_fraction,
        "lan": {"bandwidth": lan.bandwidth, "rtt_s": lan.rtt_s, "activation_scale": lan.activation_scale},
        "configs": results,
    }


def print_table(doc: dict) -> None:
    c = {r["name"]: r for r in doc["configs"]}
    print(f"{'config':<8} {'ms/token':>9} {'LAN B/token':>12} {'K3-equiv LAN B/token':>21} {'hub B/token':>12}  uses")
    for r in doc["configs"]:
        uses = ", ".join(f"{k} {v}" for k, v in r["uses"].items() if v)
        print(
            f"{r['name']:<8} {r['s_per_token'] * 1000:>9.2f} {r['lan_bytes_per_token']:>12.0f} "
            f"{r['k3_lan_bytes_per_token']:>21.0f} {r['hub_bytes_per_token']:>12.0f}  {uses}"
        )
    remote, fetch, alone = c["remote"], c["fetch"], c["alone"]
    print(
        f"remote is {fetch['s_per_token'] / remote['s_per_token']:.1f}x faster than fetch (target >= 5x) and "
        f"{alone['s_per_token'] / remote['s_per_token']:.2f}x faster than alone (target > 1x)"
    )
    print(
        f"LAN bytes per token: {fetch['lan_bytes_per_token'] / max(1.0, remote['lan_bytes_per_token']):.0f}x fewer "
        f"raw, {fetch['k3_lan_bytes_per_token'] / max(1.0, remote['k3_lan_bytes_per_token']):.0f}x fewer as K3 "
        "would see them (target >= 100x)"
    )
    if any(remote["fallbacks"].values()):
        print(f"remote fell back to fetching: {remote['fallbacks']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--time-scale", type=float, default=0.2)
    ap.add_argument("--ram-fraction", type=float, default=0.25)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    doc = run(args.tokens, args.time_scale, args.ram_fraction)
    print_table(doc)
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
