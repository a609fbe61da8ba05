"""Where a prompt's node process keeps its memory, against `doctor --plan` (issue 46).

The K3-proportioned repo of `expertmesh bench --model k3-proportions` (2 MoE layers, 384 experts
of 17,547,264 bytes a layer unless told), `expertmesh hub` at 100 MB/s, 25 MB/s a connection, 75 ms
to the first byte; a node with an empty home and a RAM budget of 64 experts (the prompt bench's)
answers one token of a prompt in a process of its own, as the prompt bench's rows do. With `--cache
disk` an untimed process puts the prompt's experts on disk first (RAM budget 0) and the measured
process reads them from there.

The measured process notes its resident memory (Linux's /proc/self/status: VmRSS split into
anonymous, file-backed and shared, VmHWM the peak) after the interpreter starts, after MLX, after
transformers and the rest of expertmesh are imported, after the model is opened (core, tokenizer,
store), and after the prompt; and every 20 ms during the prompt, beside MLX's active and cached
bytes, the disk tier's pooled and queued buffers and glibc's account of its heaps (what is in use,
and the freed space it keeps), so that the peak can be split into parts. The buffer pool's blocks
are shared anonymous mappings (`mmap.mmap(-1, n)`): they count as RssShmem, not RssAnon.
Printed beside it: the plan `doctor --plan` makes for the same node with a context of the prompt
and its one token (`--max-context`): the context and the prompt's expert outputs at that length;
with `--household`, and what the node holds for its peers (node/household/planned_memory.py), as
a node that joins a household plans.

With `--household` the measured node has a compute peer: a node in this (unmeasured) process
that holds every expert on its disk, on loopback, with the same secret; and every expert the
measured node lacks in RAM is placed at that peer (RemoteExperts.plan replaced: on loopback the
cost model would fetch instead). A layer then hands all of its prompt's rows to the peer in calls
and waits for their answers: the most a household prompt's layer holds at once.

    python benchmarks/bench_prompt_memory.py [--tokens 16] [--moe-layers 2] [--experts 384] [--cache cold]
        [--intermediate 3072] [--household]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

LINK, PER_CONNECTION, TTFB_S, RAM_EXPERTS = 100e6, 25e6, 0.075, 64
SECRET = "bench-prompt-memory"


def _status() -> dict[str, int]:
    """This process's VmRSS, RssAnon, RssFile and VmHWM in bytes (Linux)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _glibc_heap() -> dict[str, int]:
    """glibc's own account of its heaps (mallinfo2, glibc >= 2.33): what the program holds in
    them, the free space they keep, and the blocks mapped on their own; {} elsewhere. MLX's arrays
    on the CPU, numpy's and Python's large objects all come from here."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in (
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            )
        ]

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
    except (OSError, AttributeError):
        return {}
    m = libc.mallinfo2()
    return {"glibc_in_use": m.uordblks + m.hblkhd, "glibc_free_kept": m.fordblks, "glibc_mapped": m.hblkhd}


def child(spec: dict) -> dict:
    """The measured process: phases, then the prompt sampled."""
    phases = {"started": _status()}
    import mlx.core as mx

    phases["mlx imported"] = _status()
    import transformers  # noqa: F401 - the tokenizer's loader; imported by open_model anyway

    phases["transformers imported"] = _status()
    from expertmesh.assembly import open_model
    from expertmesh.devtools import bench_prompt
    from expertmesh.node.config import StoreConfig
    from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings
    from expertmesh.node.hub import client as hub_client
    from expertmesh.node.store import buffers

    phases["the package imported"] = _status()
    with hub_client.using_endpoint(spec["hub_url"]):
        if spec.get("peer"):
            sm = _with_peer(spec)
        else:
            sm = open_model(spec["repo_id"], home=Path(spec["home"]), store=StoreConfig(**spec["store"]))
        phases["model opened"] = _status()
        disk = sm.store.disk
        samples: list[dict] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                s = _status()
                s.update(
                    mlx_active=mx.get_active_memory(),
                    mlx_cache=mx.get_cache_memory(),
                    pool_idle=buffers.shared_pool().idle_bytes,
                    disk_queued=getattr(disk, "_pending_bytes", 0) if disk is not None else 0,
                    ram_tier=sm.store.ram.nbytes if hasattr(sm.store.ram, "nbytes") else 0,
                    **_glibc_heap(),
                )
                samples.append(s)
                time.sleep(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        ids = bench_prompt.prompt_ids(spec["tokens"], spec["vocab"])
        summary = GenerationSummary()
        list(Generator(sm).generate(ids, SamplingSettings(max_tokens=1), summary=summary))
        if disk is not None:
            disk.flush()
        stop.set()
        sampler.join()
        phases["prompt answered"] = _status()
        peak = max(samples, key=lambda s: s["VmRSS"]) if samples else {}
        sm.close()
    return {
        "phases": phases,
        "at_peak": peak,
        "mlx_peak": mx.get_peak_memory(),
        "ttft_s": summary.time_to_first_token_s,
        "remote": dict(summary.experts.remote),  # calls, bytes and fallbacks to the peer (--household)
    }


def _with_peer(spec: dict):
    """The measured node, joined to the peer at `spec["peer"]`, every expert it lacks in RAM placed
    there."""
    from expertmesh.assembly import build_node
    from expertmesh.node.config import HouseholdConfig, NodeConfig, StoreConfig
    from expertmesh.node.household.remote_experts import Placement, RemoteExperts

    def at_the_peer(self, layer: int, experts: list[int], row_bytes: dict[int, int]) -> Placement:
        peer = self._compute_peers()[0]
        self._link(peer)  # pinged, as the cost model would
        remote = {e: peer for e in experts if (layer, e) not in self.store.ram}
        return Placement(remote=remote, estimate_s={peer.node_id: 600.0})  # deadlines no measurement cuts short

    RemoteExperts.plan = at_the_peer  # type: ignore[method-assign]
    household = HouseholdConfig(secret=SECRET, peers=[spec["peer"]])
    config = NodeConfig(
        spec["repo_id"],
        home=Path(spec["home"]),
        node_id="measured",
        store=StoreConfig(**spec["store"]),
        household=household,
    )
    return build_node(config).start().require_model()


def _peer(repo_id: str, home: Path):
    """The compute peer: a node of this process serving gRPC on loopback, its experts on its disk."""
    from expertmesh.assembly import build_node
    from expertmesh.node.config import HouseholdConfig, NodeConfig, RpcConfig, StoreConfig

    config = NodeConfig(
        repo_id,
        home=home,
        node_id="peer",
        store=StoreConfig(prefetch=False),
        household=HouseholdConfig(secret=SECRET),
        rpc=RpcConfig(host="127.0.0.1", port=0),
    )
    return build_node(config).start()


def _run_child(spec: dict) -> dict:
    cmd = [sys.executable, __file__, "--child", json.dumps(spec)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--moe-layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument(
        "--intermediate",
        type=int,
        default=None,
        help="the experts' intermediate width (K3's 3,072 unless told): a narrower one computes a long "
        "prompt in minutes with the same rows and outputs, so its activations can be split quickly",
    )
    ap.add_argument("--cache", choices=("cold", "disk"), default="cold")
    ap.add_argument(
        "--household",
        action="store_true",
        help="a compute peer that holds every expert computes every one the node lacks (see above)",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    from expertmesh.devtools import bench_k3, bench_prompt
    from expertmesh.devtools.tiny import k3_proportions
    from expertmesh.node.config import HouseholdConfig
    from expertmesh.node.doctor import plan_model
    from expertmesh.node.household.planned_memory import household_buffer_bytes
    from expertmesh.node.hub import client as hub_client
    from expertmesh.node.hub.pull import pull

    p = k3_proportions.Proportions(experts=args.experts, moe_layers=args.moe_layers)
    if args.intermediate:
        p = dataclasses.replace(p, intermediate=args.intermediate)
    repo_id, root = bench_k3.prompt_bench_repo(p)
    eb = p.expert_bytes
    store = {"ram_budget": str(RAM_EXPERTS * eb + eb // 2), "disk_budget": "100%"}
    work = Path(tempfile.mkdtemp(prefix="expertmesh-memory-"))
    hub = bench_k3._Hub(root.parent.parent, PER_CONNECTION, LINK, TTFB_S)
    try:
        with hub_client.using_endpoint(hub.url):
            pull(repo_id, home=work / "home", progress=False)
            vocab = bench_prompt._vocab(work / "home", repo_id)
            # the plan of a node whose context holds this prompt and its token, as `--max-context` would set it
            planned = plan_model(
                work / "home", repo_id, max_context=args.tokens + 1, ram_budget=store["ram_budget"], prefix_cache="0"
            )
        plan = planned.planner.plan()
        spec = {"repo_id": repo_id, "hub_url": hub.url, "home": str(work / "home"), "tokens": args.tokens}
        spec.update(vocab=vocab, store=store)
        if args.cache == "disk":
            _run_child({**spec, "store": {**store, "ram_budget": "0"}})
            from expertmesh.devtools.disk_floor import drop_page_cache

            drop_page_cache(sorted(str(f) for f in (work / "home" / "experts").rglob("*.bin")))
        peer = None
        if args.household:
            with hub_client.using_endpoint(hub.url):
                pull(repo_id, home=work / "peer", progress=False)
            _run_child({**spec, "home": str(work / "peer"), "store": {**store, "ram_budget": "0"}})  # onto its disk
            with hub_client.using_endpoint(hub.url):
                peer = _peer(repo_id, work / "peer")
            spec.update(peer=peer.rpc.address, store={**store, "disk_budget": "0"})
            # the measured node is in a household: its plan holds what it keeps for its peers
            planned.planner.household_bytes = household_buffer_bytes(
                HouseholdConfig(secret=SECRET, peers=[peer.rpc.address]), eb
            )
            plan = planned.planner.plan()
        try:
            got = _run_child(spec)
        finally:
            if peer is not None:
                peer.close()
    finally:
        hub.close()
        shutil.rmtree(work, ignore_errors=True)
    gb = 1e9
    where = "; every expert it lacks computed by a peer" if args.household else ""
    print(f"{repo_id}, {args.tokens}-token prompt, {args.cache}; RAM budget {RAM_EXPERTS} experts{where}")
    print(f"plan: {plan.parts()}")
    print(f"{'phase':<22} {'RSS':>8} {'anon':>8} {'file':>8} {'peak':>8}")
    for name, s in got["phases"].items():
        print(
            f"{name:<22} {s['VmRSS'] / gb:>7.3f}G {s['RssAnon'] / gb:>7.3f}G "
            f"{s['RssFile'] / gb:>7.3f}G {s['VmHWM'] / gb:>7.3f}G"
        )
    peak = got["at_peak"]
    if peak:
        print("at the sampled peak: " + ", ".join(f"{k} {v / gb:.3f}G" for k, v in peak.items() if k != "VmHWM"))
    print(f"MLX's own peak: {got['mlx_peak'] / gb:.3f}G; the first token after {got['ttft_s']:.2f} s")
    if args.household:
        print("remote execution: " + ", ".join(f"{k} {v:,}" for k, v in got["remote"].items()))
    print(json.dumps({"plan": plan.as_json(), **got}))


if __name__ == "__main__":
    main()
