"""`expertmesh bench --configs prompt`: what a prompt costs, measured against its floor.

Decode is measured elsewhere (bench.py, bench_k3.py), each clock starting after the first token;
at a large MoE's shape the prompt is the larger cost by far (its experts are the union of what its
tokens route to), so this bench times the first token. For each prompt length, cold (caches empty)
and with the experts on disk (the disk tier the cold run of the same prompt left, or an untimed run
where there was none; the page cache dropped before the timed one),
a node whose RAM budget is smaller than a layer's union answers one token in a process of its own
(so its peak RSS is its own), and the row says:

    distinct_bytes     the bytes of the distinct experts the prompt routed to, over all layers
    fetched_bytes      expert bytes of the prompt's uses served from every tier (Hub, disk, peers),
                       as the issue counts them (an expert a guess brought to disk counts as a disk use)
    fetch_redundancy   fetched ÷ distinct: 1.0 reads each expert once
    all_reads_redundancy  every byte the Hub sent (wasted guesses too) plus disk and peer reads,
                       ÷ distinct: a guess fetched and read back from disk counts twice
    ttft_s             the first token's time
    floor_s            distinct bytes ÷ the link's rate (cold) or ÷ the disk's parallel-read rate
                       (disk), and never less than the prompt's compute: its first token with every
                       expert of the model in RAM where the model fits (`compute_measured`:
                       "resident"), else the same run's time outside waits for experts
    ttft_over_floor    ttft_s ÷ floor_s
    peak_rss_bytes     the node process's peak resident memory
    plan_bytes         what `doctor --plan` gives the same node (its RAM budget, no prefix cache) with a
                       context of the prompt and its token (`--max-context`): the peak should be within it
    tokens_equal       the first token equals mlx-lm's on the same prompt (with every expert in
                       memory), where mlx-lm was run; at K3 size (tens of GB of experts) it is
                       compared with the cold run's instead (`tokens_reference` says which)

A prompt longer than one prefill chunk is also run with `prefill` "token_major" (chunk by chunk,
as mlx-lm feeds it) beside the default "layer_major" (node/engine/prefill.py), and the table says
how many times fewer bytes and how much sooner the first token layer-major is.

The prompts are token ids drawn with a fixed seed, so every configuration sees the same ones.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROMPT_LENGTHS = (16, 128, 1024, 4096)
CACHES = ("cold", "disk")
PREFILLS = ("layer_major", "token_major")  # token_major only for a prompt of several prefill chunks
MLX_LM_LIMIT_BYTES = 2 << 30  # mlx-lm holds every expert: compare with it only below this


def prompt_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    """`n` token ids below `vocab` (the low ids skipped: specials live there in most tokenizers)."""
    import numpy as np

    low = min(256, vocab // 4)
    return np.random.default_rng(seed).integers(low, vocab, size=n).tolist()


# -- the worker: one (prompt, cache) in its own process ----------------------------------------


def _expert_files(home: Path) -> list[str]:
    return sorted(str(p) for p in (home / "experts").rglob("*.bin"))


def _one_token(spec: dict, home: Path, trace: Path | None) -> dict:
    from expertmesh.assembly import open_model
    from expertmesh.node.config import StoreConfig
    from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings

    sm = open_model(spec["repo_id"], home=home, store=StoreConfig(**spec["store"], trace_path=trace))
    try:
        summary = GenerationSummary()
        ids = prompt_ids(spec["prompt_tokens"], spec["vocab"])
        generator = Generator(sm)
        generator.layer_major_prefill = spec.get("prefill", "layer_major") == "layer_major"
        out = [t.id for t in generator.generate(ids, SamplingSettings(max_tokens=1), summary=summary)]
        sm.store.disk.flush()
        e = summary.experts
        return {
            "token": out[0] if out else None,
            "ttft_s": summary.time_to_first_token_s,
            "wait_s": e.wait_seconds,
            "bytes": dict(e.bytes),
            "uses": dict(e.uses),
            "index": {f"{lay}:{ex}": loc.nbytes for (lay, ex), loc in sm.index.experts.items()},
        }
    finally:
        sm.close()


def _resident(spec: dict, home: Path) -> dict:
    """The prompt's first token with every expert of the model in RAM (an untimed run puts them
    there): its compute floor on this machine."""
    from expertmesh.assembly import open_model
    from expertmesh.node.config import StoreConfig
    from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings

    store = {**spec["store"], "ram_budget": str(2 * spec["all_expert_bytes"])}
    sm = open_model(spec["repo_id"], home=home, store=StoreConfig(**store))
    try:
        ids = prompt_ids(spec["prompt_tokens"], spec["vocab"])
        list(Generator(sm).generate(ids, SamplingSettings(max_tokens=1)))
        summary = GenerationSummary()
        out = [t.id for t in Generator(sm).generate(ids, SamplingSettings(max_tokens=1), summary=summary)]
        return {
            "token": out[0] if out else None,
            "ttft_s": summary.time_to_first_token_s,
            "all_resident": sm.all_resident(),
        }
    finally:
        sm.close()


def worker(spec: dict) -> dict:
    """One row's measurement: the prompt once untimed first where the experts are to be on disk."""
    from expertmesh.devtools.bench_k3 import _hub_bytes, _peak_rss
    from expertmesh.devtools.disk_floor import drop_page_cache, floor_bandwidth
    from expertmesh.node.hub import client as hub_client
    from expertmesh.node.observability.routing_trace import read_trace

    work = Path(spec["work"])
    home = work / "home"
    if spec.get("filled_home"):  # the cold run of this prompt fetched its experts onto that disk
        shutil.move(spec["filled_home"], home)
    else:
        shutil.copytree(spec["template"], home)
    with hub_client.using_endpoint(spec["hub_url"]):
        if spec["cache"] == "resident":
            return {**_resident(spec, home), "peak_rss_bytes": _peak_rss()}
        if spec["cache"] == "disk":
            if not spec.get("filled_home"):
                _one_token({**spec, "store": {**spec["store"], "ram_budget": "0"}}, home, None)
            drop_page_cache(_expert_files(home))
        before = _hub_bytes(spec["hub_url"])
        got = _one_token(spec, home, work / "trace")
        got["hub_moved_bytes"] = _hub_bytes(spec["hub_url"]) - before
    sizes = got.pop("index")
    distinct = {f"{lay}:{ex}" for lay, ex in read_trace(work / "trace").accesses()}
    got["distinct_experts"] = len(distinct)
    got["distinct_bytes"] = sum(sizes[k] for k in distinct)
    if spec["cache"] == "disk":
        got["disk_floor"] = floor_bandwidth(_expert_files(home), rounds=1)  # GBs at K3 size: one cold pass each
    got["peak_rss_bytes"] = _peak_rss()
    return got


def _mlx_lm_token(repo_dir: str, ids: list[int]) -> int:
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = mlx_lm.load(repo_dir)[:2]
    step = next(iter(mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=1, sampler=make_sampler(0.0))))
    return step.token


# -- the driver -----------------------------------------------------------------------------


def row(
    spec: dict,
    got: dict,
    link_bytes_per_s: float,
    reference: int | None,
    reference_name: str,
    resident_s: float | None = None,
    plan_bytes: int | None = None,
) -> dict:
    """The issue's JSON row of one measurement, with what it was computed from beside it."""
    distinct = got["distinct_bytes"]
    fetched = sum(got["bytes"].get(s, 0) for s in ("hub", "disk", "peer"))
    rate = link_bytes_per_s if spec["cache"] == "cold" else got["disk_floor"]["bytes_per_s"]
    # the prompt's compute: measured with every expert resident where the model fits in RAM, else
    # the run's own time outside waits for experts (what it would take if none were waited for)
    compute_s = resident_s if resident_s is not None else max(0.0, got["ttft_s"] - got["wait_s"])
    floor = max(distinct / rate if rate else 0.0, compute_s)
    return {
        "name": "prompt",
        "prompt_tokens": spec["prompt_tokens"],
        "cache": spec["cache"],
        "prefill": spec.get("prefill", "layer_major"),
        "distinct_bytes": distinct,
        "fetched_bytes": fetched,
        "fetch_redundancy": fetched / distinct if distinct else None,
        "ttft_s": got["ttft_s"],
        "floor_s": floor,
        "ttft_over_floor": got["ttft_s"] / floor if floor else None,
        "peak_rss_bytes": got["peak_rss_bytes"],
        "plan_bytes": plan_bytes,
        "tokens_equal": None if reference is None else got["token"] == reference,
        # what the figures come from
        "tokens_reference": reference_name,
        "distinct_experts": got["distinct_experts"],
        "bytes_by_source": got["bytes"],
        "uses_by_source": got["uses"],
        "hub_moved_bytes": got["hub_moved_bytes"],
        # stricter: every byte the Hub sent (wasted guesses too) plus every disk and peer read, so
        # that a guess fetched from the Hub and read back from disk counts twice
        "all_reads_redundancy": (got["hub_moved_bytes"] + sum(got["bytes"].get(s, 0) for s in ("disk", "peer")))
        / distinct
        if distinct
        else None,
        "wait_s": got["wait_s"],
        "compute_s": compute_s,
        # the bytes alone (no compute): where compute_s is the run's own time outside waits, it
        # holds this machine's work per expert too (reading, checking, placing), which this does not
        "byte_floor_s": distinct / rate if rate else None,
        "ttft_over_byte_floor": got["ttft_s"] / (distinct / rate) if rate and distinct else None,
        "compute_measured": "resident" if resident_s is not None else "ttft minus waits",
        "floor_rate_bytes_per_s": rate,
        "ram_budget": spec["store"]["ram_budget"],
    }


def _run_worker(spec: dict) -> dict:
    import subprocess

    cmd = [sys.executable, "-m", "expertmesh.devtools.bench_prompt", json.dumps(spec)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=4 * 3600)
    if r.returncode != 0:
        raise RuntimeError(f"prompt {spec['prompt_tokens']} {spec['cache']} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run(
    model: str = "demo",
    lengths: tuple[int, ...] = PROMPT_LENGTHS,
    caches: tuple[str, ...] = CACHES,
    prefills: tuple[str, ...] = PREFILLS,
    per_connection: float = 25e6,
    proportions=None,
    ram_experts: int | None = None,
    progress: Callable[[str], None] = print,
    time_scale: float = 1.0,
) -> dict:
    """Every (prompt length, cache) row; returns the JSON document.

    `model`: "k3-proportions" (K3's 17.5 MB experts, `proportions` its shape, the link unscaled:
    100 MB/s, `per_connection` a connection, 75 ms to the first byte) or a bench model of
    bench.py's (the demo: the link scaled so that its expert crosses it as a K3 expert would).
    `ram_experts`: the RAM budget in experts, by default a sixth of a layer's (64 of 384: about the
    1 GB a K3 node's RAM tier gave in the issue's measurement) and at least 8 (so that a small
    model's layer still takes a few groups at once), below the union of any prompt here.
    `prefills`: the orders to run; "token_major" (mlx-lm's chunk by chunk, the comparison) runs
    only for a prompt longer than one prefill chunk.
    `time_scale`: a bench model's link sped up by this factor's inverse (the tests' quick runs)."""
    from expertmesh.devtools import bench_k3
    from expertmesh.devtools.bench import LinkSettings, _bench_repo
    from expertmesh.node import constants
    from expertmesh.node.engine.generation import PREFILL_STEP
    from expertmesh.node.hub import client as hub_client
    from expertmesh.node.hub.pull import pull

    work = Path(tempfile.mkdtemp(prefix="expertmesh-bench-prompt-"))
    try:
        if model == "k3-proportions":
            from dataclasses import asdict

            from expertmesh.devtools.tiny import k3_proportions

            p = proportions or k3_proportions.Proportions(experts=384)
            repo_id = f"{bench_k3.REPO_ID}-{p.moe_layers}x{p.experts}-{p.expert_bytes}"
            repo_id += "-raw-router" if p.router == "raw" else ""
            root = bench_k3._model_dir(constants.expertmesh_home() / "bench" / "hub", repo_id, p, progress)
            link, ttfb, expert_bytes, per_layer = bench_k3.LINK_BYTES_PER_S, bench_k3.TTFB_S, p.expert_bytes, p.experts
            shape: dict[str, Any] = {"repo": repo_id, **asdict(p), "expert_bytes": p.expert_bytes}
        else:
            repo_id = _bench_repo(model, work / "hub")
            root = work / "hub" / repo_id
            shape = {"repo": repo_id}
        hub_root = root.parent.parent
        if model != "k3-proportions":  # the link scaled to the model's experts, as bench.py does
            probe = bench_k3._Hub(hub_root, 1e12, 1e12, 0.0)
            try:
                with hub_client.using_endpoint(probe.url):
                    pull(repo_id, home=work / "probe", progress=False)
            finally:
                probe.close()
            index = _index(work / "probe", repo_id)
            expert_bytes = max(loc.nbytes for loc in index.experts.values())
            per_layer = max(sum(1 for lay, _ in index.experts if lay == layer) for layer in index.moe_layers)
            scaled = LinkSettings.scaled(expert_bytes, time_scale=time_scale, stands_for=constants.K3_EXPERT_BYTES)
            link = scaled.bandwidth
            per_connection = per_connection * expert_bytes / constants.K3_EXPERT_BYTES / time_scale
            ttfb = scaled.ttfb_s
        slots = ram_experts or max(8, per_layer // 6)
        store = {"ram_budget": str(slots * expert_bytes + expert_bytes // 2), "disk_budget": "100%"}
        rows: list[dict] = []
        skipped: list[int] = []
        hub = bench_k3._Hub(hub_root, per_connection, link, ttfb)
        try:
            template = work / "pulled"
            if model == "k3-proportions":
                with hub_client.using_endpoint(hub.url):
                    pull(repo_id, home=template, progress=False)
            else:  # pulled over the unshaped Hub: the scaled link would take minutes for the tokenizer
                (work / "probe").rename(template)
            vocab = _vocab(template, repo_id)
            progress(
                f"{repo_id}: {per_layer} experts a layer of {expert_bytes:,} bytes; RAM budget {slots} experts; "
                f"link {link / 1e6:.2f} MB/s, {per_connection / 1e6:.3f} MB/s per connection"
            )
            context = _context(template, repo_id)
            for n in lengths:
                if context is not None and n >= context:  # no room for the answer: the node refuses it
                    progress(f"  {n} tokens: skipped, the model's context is {context}")
                    skipped.append(n)
                    continue
                firsts: dict[str, int] = {}
                reference: int | None = None
                reference_name = "cold"
                total_expert_bytes = per_layer * expert_bytes * len(_index(template, repo_id).moe_layers)
                plan_bytes = _plan_bytes(template, repo_id, n, store["ram_budget"])
                resident_s: float | None = None
                small = total_expert_bytes < MLX_LM_LIMIT_BYTES
                if small:
                    reference, reference_name = _mlx_lm_token(str(root), prompt_ids(n, vocab)), "mlx_lm"
                # a prompt of several chunks also fed chunk by chunk as mlx-lm feeds it, side by side
                chunked = n > PREFILL_STEP + 1
                orders = [o for o in prefills if o == "layer_major" or chunked]
                runs = [(c, o) for o in orders for c in caches]
                filled: dict[str, str] = {}  # prefill order -> the home its cold run left, for its disk run
                for cache, prefill in ([("resident", "layer_major")] if small else []) + runs:
                    spec: dict[str, Any] = {
                        "repo_id": repo_id,
                        "hub_url": hub.url,
                        "template": str(template),
                        "work": str(work / f"{n}-{cache}-{prefill}"),
                        "prompt_tokens": n,
                        "vocab": vocab,
                        "cache": cache,
                        "prefill": prefill,
                        "store": store,
                        "all_expert_bytes": total_expert_bytes,
                    }
                    if cache == "disk" and prefill in filled:
                        # the same prompt's experts, as an untimed run would put them there, without
                        # computing the prompt again (at K3 size that is most of an hour at 4,096 tokens)
                        spec["filled_home"] = filled.pop(prefill)
                    progress(f"  {n} tokens, {cache}, {prefill} ...")
                    t0 = time.perf_counter()
                    try:
                        got = _run_worker(spec)
                    finally:
                        if cache == "cold" and "disk" in caches and Path(spec["work"], "home").is_dir():
                            filled[prefill] = str(Path(spec["work"], "home"))
                        else:
                            shutil.rmtree(spec["work"], ignore_errors=True)  # a cold run's caches hold GBs
                        if spec.get("filled_home"):
                            shutil.rmtree(Path(spec["filled_home"]).parent, ignore_errors=True)
                    if cache == "resident":
                        resident_s = got["ttft_s"]
                        progress(f"  {n} tokens, every expert resident: TTFT {resident_s:.2f} s")
                        continue
                    firsts.setdefault(cache, got["token"])
                    ref = reference if reference_name == "mlx_lm" else firsts.get("cold")
                    r = row(spec, got, link, ref, reference_name, resident_s, plan_bytes)
                    rows.append(r)
                    progress(
                        f"  {n} tokens, {cache}, {prefill}: {r['distinct_experts']} distinct experts, redundancy "
                        f"{r['fetch_redundancy']:.3f}, TTFT {r['ttft_s']:.1f} s = {r['ttft_over_floor']:.2f}x the floor "
                        f"({time.perf_counter() - t0:.0f} s)"
                    )
        finally:
            hub.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "model": shape,
        "link": {"bytes_per_s": link, "per_connection_bytes_per_s": per_connection, "ttfb_s": ttfb},
        "ram_budget_experts": slots,
        "skipped_prompt_tokens": skipped,
        "load": os.getloadavg(),
        "configs": rows,
    }


def _plan_bytes(home: Path, repo_id: str, tokens: int, ram_budget: str) -> int:
    """The memory plan's total for the bench's node answering a prompt of `tokens` tokens."""
    from expertmesh.node.doctor import plan_model

    planned = plan_model(home, repo_id, max_context=tokens + 1, ram_budget=ram_budget, prefix_cache="0")
    return planned.planner.plan().total_bytes


def _index(home: Path, repo_id: str):
    from expertmesh.node.hub import local_models
    from expertmesh.node.model.expert_index import INDEX_FILENAME, ExpertIndex

    return ExpertIndex.load(local_models.find_pulled(home, repo_id) / INDEX_FILENAME)


def _context(home: Path, repo_id: str) -> int | None:
    from expertmesh.node.hub import local_models

    cfg = json.loads((local_models.find_pulled(home, repo_id) / "config.json").read_text())
    return cfg.get("max_position_embeddings") or cfg.get("text_config", {}).get("max_position_embeddings")


def _vocab(home: Path, repo_id: str) -> int:
    from expertmesh.node.hub import local_models

    cfg = json.loads((local_models.find_pulled(home, repo_id) / "config.json").read_text())
    return int(cfg.get("vocab_size") or cfg.get("text_config", {})["vocab_size"])


def print_table(doc: dict, out=print) -> None:
    out(
        f"{'tokens':>6} {'cache':<5} {'prefill':<11} {'distinct':>9} {'GB':>7} {'redund.':>7} {'TTFT s':>8} {'floor s':>8} "
        f"{'/floor':>6} {'peak RSS':>9} {'plan':>7} {'equal':>5} {'all reads':>9}"
    )
    for r in doc["configs"]:
        out(
            f"{r['prompt_tokens']:>6} {r['cache']:<5} {r.get('prefill', 'layer_major'):<11} {r['distinct_experts']:>9} {r['distinct_bytes'] / 1e9:>7.2f} "
            f"{r['fetch_redundancy'] or 0:>7.3f} {r['ttft_s']:>8.2f} {r['floor_s']:>8.2f} "
            f"{r['ttft_over_floor'] or 0:>6.2f} {r['peak_rss_bytes'] / 1e9:>8.2f}G {(r.get('plan_bytes') or 0) / 1e9:>6.2f}G "
            f"{str(r['tokens_equal']):>5} {r['all_reads_redundancy'] or 0:>9.3f}"
        )
    rows = {(r["prompt_tokens"], r["cache"], r.get("prefill")): r for r in doc["configs"]}
    for (n, cache, prefill), r in rows.items():
        token_major = rows.get((n, cache, "token_major"))
        if prefill == "layer_major" and token_major:
            out(
                f"{n} tokens, {cache}: layer-major reads {token_major['fetch_redundancy'] / r['fetch_redundancy']:.2f}x "
                f"fewer expert bytes and reaches its first token {token_major['ttft_s'] / r['ttft_s']:.2f}x sooner "
                "than mlx-lm's chunk-by-chunk order"
            )
    if doc.get("skipped_prompt_tokens"):
        out(f"skipped (beyond the model's context): {doc['skipped_prompt_tokens']}")
    out(f"load average: {', '.join(f'{x:.2f}' for x in doc['load'])}")


if __name__ == "__main__":
    print(json.dumps(worker(json.loads(sys.argv[1]))))
