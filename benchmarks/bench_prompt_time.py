"""Where an approximate prompt's time to first token goes, on the K3-proportioned repo.

The K3 rows of `expertmesh bench --prompt-experts --model k3-proportions` (a 128-token cold prompt,
a random quarter of each layer's experts on disk, the Hub at 100 MB/s, RAM of 8 experts), each
mode in a fresh copy of the same home, in one run, with the prompt's time split by timers around
what the layer-major prefill (node/engine/prefill.py) waits on:

- `core_and_router_s`: each MoE layer's one sync, which evaluates the core (attention, the dense
  layers) and the router up to that layer for every chunk;
- `expert_compute_s`: the expert groups' evaluations (`_by_groups`): the experts' matmuls;
- `fetch_wait_s`: waiting for experts not yet arrived (the link, or the disk);
- `rewrite_s`: the approximation's own rewrite of the routing (engine/prompt_experts.py).

    python benchmarks/bench_prompt_time.py --modes exact,held,keep [--json FILE]

The timers are patched in here, for this run only: nothing in the node is changed by them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from expertmesh.devtools import bench_k3
from expertmesh.devtools import bench_prompt_experts as bench
from expertmesh.devtools.local_hub import HubServer
from expertmesh.devtools.tiny import k3_proportions
from expertmesh.devtools.tiny.demo_model import DEMO_DIR, HELDOUT_FILE
from expertmesh.node import constants
from expertmesh.node.engine import prefill, prompt_experts
from expertmesh.node.hub import client as hub_client
from expertmesh.node.hub.pull import pull
from expertmesh.node.store.store import ExpertStore

SPENT: dict[str, float] = {}


def _add(key: str, seconds: float) -> None:
    SPENT[key] = SPENT.get(key, 0.0) + seconds


class _TimedMx:
    """mlx.core as prefill.py sees it, its `eval` timed by the function that calls it."""

    def __getattr__(self, name: str):
        return getattr(mx, name)

    def eval(self, *args) -> None:
        t0 = time.perf_counter()
        mx.eval(*args)
        caller = sys._getframe(1).f_code.co_name
        _add("core_and_router_s" if caller == "run_layer" else "expert_compute_s", time.perf_counter() - t0)


def _timed(cls, name: str, key: str) -> None:
    inner = getattr(cls, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            _add(key, time.perf_counter() - t0)

    setattr(cls, name, timed)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="exact,held,keep", help="comma-separated --prompt-experts modes")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args()
    prefill.mx = _TimedMx()  # type: ignore[assignment]
    _timed(ExpertStore, "_finish", "fetch_wait_s")
    _timed(prompt_experts.Approximation, "rewrite", "rewrite_s")
    p = k3_proportions.Proportions(experts=bench.K3_EXPERTS, moe_layers=bench.K3_MOE_LAYERS)
    repo = f"{bench_k3.REPO_ID}-{p.moe_layers}x{p.experts}-{p.expert_bytes}"
    hub_root = constants.expertmesh_home() / "bench" / "hub"
    bench_k3._model_dir(hub_root, repo, p, print)
    work = Path(tempfile.mkdtemp(prefix="expertmesh-prompt-time-"))
    rows = []
    try:
        with HubServer(hub_root) as hub, hub_client.using_endpoint(hub.url):
            prepared = work / "prepared"
            pull(repo, home=prepared, progress=False)
            probe = bench._open(prepared, repo, p.expert_bytes)
            ids = probe.tokenizer.encode((DEMO_DIR / HELDOUT_FILE).read_text())[:128]
            probe.close()
            bench._put_on_disk(prepared, repo, p.expert_bytes, 0.25, seed=0)
            hub.knobs.bandwidth_bytes_per_s = bench_k3.LINK_BYTES_PER_S
            prompt_experts.DEFAULT_LINK_BYTES_PER_S = bench_k3.LINK_BYTES_PER_S
            for mode in args.modes.split(","):
                home = work / f"home-{mode}".replace(":", "_")
                shutil.copytree(prepared, home)
                SPENT.clear()
                load = os.getloadavg()[0]
                got = bench._one(home, repo, p.expert_bytes, ids, [0], mode)
                row = {
                    "mode": mode,
                    "ttft_s": got["ttft_s"],
                    "fetched_bytes": got["fetched_bytes"],
                    "uses": got["uses"],
                    "substituted": got["substituted"],
                    **SPENT,
                    "load": [load, os.getloadavg()[0]],
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
                shutil.rmtree(home, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    exact = next((r for r in rows if r["mode"] == "exact"), None)
    for r in rows:
        ratio = f"{r['ttft_s'] / exact['ttft_s']:.2f}x exact" if exact else ""
        parts = ", ".join(f"{k} {r.get(k, 0.0):.1f}" for k in ("expert_compute_s", "fetch_wait_s", "core_and_router_s"))
        print(f"{r['mode']:>10}: TTFT {r['ttft_s']:.1f} s {ratio} ({parts}); {r['fetched_bytes'] / 1e9:.2f} GB fetched")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
