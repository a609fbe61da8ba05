"""`expertmesh bench`: the same prompts through several configurations in one run, side by side.

The local Hub emulates a home link with Kimi K3's proportions — 100 MB/s for the link, 12.5 MB/s
per connection, 50 ms to first byte, 100 ms to open a connection, for a 17.5 MB expert — scaled
so that one of the bench model's experts takes as long to move, relative to the link's delays,
as a K3 expert does, and then sped up by `time_scale` so the bench ends in minutes. Moving
experts then dominates compute, as it does for K3.

Configurations:
    naive      one expert at a time, a new connection per request, no cache (the reference system's way);
               the first prompt only, as it is slow
    cold       expertmesh with empty caches: a new node for every prompt
    warm_disk  expertmesh with the experts on disk and an empty RAM tier
    warm_ram   expertmesh with every expert already in RAM
    mlx_lm     `mlx_lm.stream_generate` with the whole model in memory
"""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx2

from expertmesh.devtools.local_hub import HubKnobs, HubServer
from expertmesh.node import constants
from expertmesh.node.constants import K3_EXPERT_BYTES
from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings
from expertmesh.node.engine.streamed_model import StreamedModel
from expertmesh.node.hub import client as hub_client
from expertmesh.node.sizes import format_size
from expertmesh.node.store.stats import SOURCES, StoreStats
from expertmesh.node.store.tiers.hub import DEFAULT_CONNECTIONS, DEFAULT_MIN_PIECE_BYTES, DEFAULT_PIECES_PER_EXPERT


class FreshConnectionReader(hub_client.RangeReader):
    """The naive configuration's Hub client: a new connection for every request, as the reference
    system fetches (no keep-alive pool)."""

    @contextlib.contextmanager
    def _session(self):
        with httpx2.Client() as session:
            yield session


K3_LINK = {"bandwidth": 100e6, "per_connection": 12.5e6, "ttfb_s": 0.050, "connection_s": 0.100}
PROMPTS = (
    "Return the number of items in the",
    "Create a new dictionary with keys from",
    "This module provides functions for",
)


@dataclass
class LinkSettings:
    bandwidth: float  # bytes/s of the whole link
    per_connection: float  # bytes/s of one connection
    ttfb_s: float
    connection_s: float
    time_scale: float
    expert_bytes: int

    @classmethod
    def scaled(cls, expert_bytes: int, time_scale: float, stands_for: float = K3_EXPERT_BYTES) -> LinkSettings:
        """K3's home link, with bytes scaled so that this model's expert crosses it as an expert of
        `stands_for` bytes (K3's by default) would, and time sped up by `time_scale`."""
        b = expert_bytes / stands_for
        return cls(
            K3_LINK["bandwidth"] * b / time_scale,
            K3_LINK["per_connection"] * b / time_scale,
            K3_LINK["ttfb_s"] * time_scale,
            K3_LINK["connection_s"] * time_scale,
            time_scale,
            expert_bytes,
        )

    def knobs(self) -> HubKnobs:
        return HubKnobs(
            bandwidth_bytes_per_s=self.bandwidth,
            per_connection_bytes_per_s=self.per_connection,
            ttfb_s=self.ttfb_s,
            connection_cost_s=self.connection_s,
        )

    def describe(self) -> str:
        per_expert = self.expert_bytes / self.per_connection
        return (
            f"link {format_size(self.bandwidth)}/s, {format_size(self.per_connection)}/s per connection, "
            f"first byte {self.ttfb_s * 1000:.1f} ms, new connection {self.connection_s * 1000:.1f} ms; "
            f"a {format_size(self.expert_bytes)} expert takes {per_expert * 1000:.1f} ms on one connection "
            f"(K3: {K3_EXPERT_BYTES / K3_LINK['per_connection']:.1f} s), time scale {self.time_scale}"
        )


@dataclass
class ConfigResult:
    name: str
    s_per_token: float  # median over prompts of decode seconds per token
    ttft_s: float  # median time to first token
    tokens: int
    hub_bytes_per_token: float
    hub_requests: int = 0  # every request the Hub answered during the configuration (ranges, redirects)
    bytes_by_source: dict[str, int] = field(default_factory=dict)
    # the link's honest share: bytes decode waited for from the Hub / link bandwidth / seconds waited
    # (fills and wasted guesses do not count; 1.0 means every wait lasted exactly the transfer's floor)
    useful_link_use: float | None = None
    wait_over_floor: float | None = None  # seconds decode waited for experts / that floor
    # how busy the link was: every byte the Hub sent during decode (fills and guesses included) /
    # link bandwidth / decode wall time
    link_utilisation: float | None = None
    # the same over the decode time while something was still fetched from the Hub (until the
    # last token after which no more Hub bytes came)
    link_utilisation_while_fetching: float | None = None
    ram_hit_rate: float | None = None
    # uses answered without waiting: RAM hits plus guesses that had arrived before their demand
    # (a prefetching store can pass Belady's optimum for a cache that only keeps what it was asked)
    ready_hit_rate: float | None = None
    disk_hit_rate: float | None = None
    belady_ram_hit_rate: float | None = None
    # Belady's optimum with the staging room of arrived guesses added to the budget (what "ready"
    # uses in memory at most: the RAM budget plus half the fetch workers' experts)
    belady_staged_hit_rate: float | None = None
    outputs: list[list[int]] = field(default_factory=list)


def _bench_repo(model: str, hub_dir: Path) -> str:
    """Write the bench model into the Hub folder; returns its repo id."""
    if model == "demo":
        from expertmesh.devtools.tiny.demo_model import REPO_ID, make_demo_model

        make_demo_model(hub_dir / REPO_ID)
        return REPO_ID
    if model == "wide-kimi_k3":
        from expertmesh.devtools.tiny.kimi_k3 import build_wide

        repo_id = "expertmesh/wide-kimi_k3"
        (hub_dir / repo_id).mkdir(parents=True)
        build_wide(hub_dir / repo_id, seed=0)
        return repo_id
    from expertmesh.devtools.tiny import make_tiny_model

    arch = model.removeprefix("tiny-")
    repo_id = f"expertmesh/tiny-{arch}"
    make_tiny_model(hub_dir / repo_id, arch, seed=0)
    return repo_id


@dataclass
class PromptRun:
    """One prompt's greedy generation in the bench: its summary and tokens, and what its decode
    (from the first token on) asked of the store and the link."""

    summary: GenerationSummary
    ids: list[int]
    decode_experts: StoreStats | None = None  # the store's counters from the first token to the last
    decode_link_bytes: int = 0  # bytes the link carried then (prefill's bytes belong to TTFT)
    # the decode time until the token after which the link carried nothing more (a model fully
    # fetched mid-prompt leaves the link idle for the rest: nothing is left to fetch)
    decode_fetch_s: float = 0.0


def _run_prompts(
    sm: StreamedModel, prompts: list[list[int]], tokens: int, link_bytes: Callable[[], int] = lambda: 0
) -> list[PromptRun]:
    """Greedy generation of each prompt, measured as `PromptRun` says."""
    out = []
    for ids in prompts:
        summary = GenerationSummary()
        ids_out: list[int] = []
        samples: list[tuple[float, int]] = []  # (time, link bytes) after each token
        first: StoreStats | None = None
        for t in Generator(sm).generate(ids, SamplingSettings(max_tokens=tokens), summary=summary):
            ids_out.append(t.id)
            samples.append((time.perf_counter(), link_bytes()))
            if first is None:
                first = sm.store.stats.snapshot()  # decode's waits are counted from here
        run = PromptRun(summary, ids_out, sm.store.stats.since(first) if first else None)
        run.decode_link_bytes = samples[-1][1] - samples[0][1] if samples else 0
        last = next((t for t, b in samples if samples and b == samples[-1][1]), 0.0)
        run.decode_fetch_s = last - samples[0][0] if run.decode_link_bytes else 0.0
        out.append(run)
    return out


def _decode_s_per_token(s: GenerationSummary) -> float:
    decode = s.seconds - s.time_to_first_token_s
    return decode / max(1, s.generated_tokens - 1)


def _result(name: str, runs: list[PromptRun], hub_bytes: int, link: LinkSettings, belady: float | None) -> ConfigResult:
    summaries = [r.summary for r in runs]
    tokens = sum(s.generated_tokens for s in summaries)
    uses = {k: sum(s.experts.uses[k] for s in summaries) for k in SOURCES}
    total = sum(uses.values()) or 1
    decode_wall = sum(s.seconds - s.time_to_first_token_s for s in summaries)
    decode_bytes = sum(r.decode_link_bytes for r in runs)
    fetching = sum(r.decode_fetch_s for r in runs)
    decode = [r.decode_experts for r in runs if r.decode_experts is not None]
    waited_floor = sum(d.bytes["hub"] for d in decode) / link.bandwidth
    waited = sum(d.wait_seconds for d in decode)
    return ConfigResult(
        name=name,
        s_per_token=statistics.median(_decode_s_per_token(s) for s in summaries),
        ttft_s=statistics.median(s.time_to_first_token_s for s in summaries),
        tokens=tokens,
        hub_bytes_per_token=hub_bytes / max(1, tokens),
        bytes_by_source={k: sum(s.experts.bytes[k] for s in summaries) for k in SOURCES},
        useful_link_use=waited_floor / waited if waited > 0 else None,
        wait_over_floor=waited / waited_floor if waited_floor > 0 else None,
        link_utilisation=decode_bytes / link.bandwidth / decode_wall if decode_wall > 0 else None,
        link_utilisation_while_fetching=decode_bytes / link.bandwidth / fetching if fetching > 0 else None,
        ram_hit_rate=uses["ram"] / total,
        ready_hit_rate=(uses["ram"] + sum(s.experts.prefetch["ready"] for s in summaries)) / total,
        disk_hit_rate=uses["disk"] / total,
        belady_ram_hit_rate=belady,
        outputs=[r.ids for r in runs],
    )


def _belady(trace_paths: list[Path], slots: int) -> float:
    """Belady's hit rate over traces of separate nodes (each starts empty), weighted by uses."""
    from expertmesh.node.observability.routing_trace import read_trace
    from expertmesh.node.store.policies import belady_hit_rate

    hits = uses = 0.0
    for path in trace_paths:
        accesses = read_trace(path).accesses()
        hits += belady_hit_rate(accesses, slots) * len(accesses)
        uses += len(accesses)
    return hits / uses if uses else 0.0


def run_bench(
    model: str = "demo",
    tokens: int = 24,
    time_scale: float = constants.BENCH_TIME_SCALE,
    ram_fraction: float = 0.25,
    naive_tokens: int = 8,
    hub_connections: int = DEFAULT_CONNECTIONS,
    coalesce: bool = True,
    pieces_per_expert: int = DEFAULT_PIECES_PER_EXPERT,
    stands_for: float = K3_EXPERT_BYTES,
    progress=print,
) -> dict:
    """Run every configuration; returns the JSON document (also printed as a table by the CLI).

    `stands_for`: the expert size the link is scaled to (K3's by default; a smaller one makes the
    time to first byte weigh more against an expert's transfer, as for a smaller model's experts).
    """
    import mlx_lm

    from expertmesh.assembly import open_model
    from expertmesh.node.config import StoreConfig
    from expertmesh.node.hub.pull import pull

    work = Path(tempfile.mkdtemp(prefix="expertmesh-bench-"))
    try:
        repo_id = _bench_repo(model, work / "hub")
        with HubServer(work / "hub") as hub, hub_client.using_endpoint(hub.url):
            pulled = work / "pulled"
            pull(repo_id, home=pulled, progress=False)
            probe = open_model(repo_id, home=pulled, store=StoreConfig(prefetch=False))
            index, tokenizer = probe.index, probe.tokenizer
            probe.close()
            expert_bytes = max(loc.nbytes for loc in index.experts.values())
            all_bytes = sum(loc.nbytes for loc in index.experts.values())
            ram_slots = int(len(index.experts) * ram_fraction)
            ram_budget = str(ram_slots * expert_bytes + expert_bytes // 2)
            link = LinkSettings.scaled(expert_bytes, time_scale, stands_for)
            min_piece = int(DEFAULT_MIN_PIECE_BYTES * expert_bytes / stands_for)  # K3's pieces, scaled
            hub.knobs = link.knobs()
            prompts = [tokenizer.encode(p) for p in PROMPTS]
            progress(
                f"{repo_id}: {len(index.experts)} experts of {format_size(expert_bytes)} "
                f"({format_size(all_bytes)}); RAM budget {ram_fraction:.0%} of them ({ram_slots} experts)"
            )
            progress(link.describe())

            def home(name: str) -> Path:
                h = work / name
                shutil.copytree(pulled, h)
                return h

            def measured(
                name: str,
                open_node: Callable[[int, Path | None], StreamedModel],
                n_tokens: int,
                traced: bool,
                fresh_per_prompt: bool = False,
                n_prompts: int = len(prompts),
            ) -> ConfigResult:
                """`open_node(i, trace)` opens the node for prompt i. `fresh_per_prompt`: a node per
                prompt, each closed after it; else the first node answers every prompt."""
                progress(f"  {name} ...")
                before = hub.stats()
                t0 = time.perf_counter()
                runs: list[PromptRun] = []
                traces: list[Path] = []
                sm: StreamedModel | None = None
                for i, ids in enumerate(prompts[:n_prompts]):
                    if sm is None or fresh_per_prompt:
                        if sm is not None:
                            sm.close()
                        trace = work / f"{name}-{i}.trace" if traced else None
                        traces += [trace] if trace else []
                        sm = open_node(i, trace)
                    runs += _run_prompts(sm, [ids], n_tokens, hub.bytes_served)
                if sm is None:
                    raise ValueError(f"bench: {name} ran no prompt")
                sm.close()
                after = hub.stats()
                belady = _belady(traces, ram_slots) if traces else None
                r = _result(name, runs, after["bytes_served"] - before["bytes_served"], link, belady)
                r.hub_requests = after["requests"] - before["requests"]
                if traces:
                    r.belady_staged_hit_rate = _belady(traces, ram_slots + max(1, sm.store.fetch_workers // 2))
                progress(f"  {name}: {r.s_per_token * 1000:.1f} ms/token in {time.perf_counter() - t0:.1f} s")
                return r

            def expertmesh_node(home_dir: Path, trace: Path | None = None) -> StreamedModel:
                cfg = StoreConfig(
                    ram_budget=ram_budget,
                    trace_path=trace,
                    hub_min_piece_bytes=min_piece,
                    hub_connections=hub_connections,
                    hub_max_connections=hub_connections,  # the count asked for, as the sweeps compare counts
                    hub_pieces_per_expert=pieces_per_expert,
                    coalesce=coalesce,
                )
                return open_model(repo_id, home=home_dir, store=cfg)

            results = []
            if naive_tokens > 0:
                naive_cfg = StoreConfig(ram_budget="0", disk_budget="0", fetch_concurrency=1, prefetch=False)
                naive_home = home("naive")
                results.append(
                    measured(
                        "naive",
                        lambda i, _: open_model(
                            repo_id,
                            home=naive_home,
                            store=naive_cfg,
                            hub_reader=FreshConnectionReader(),
                        ),
                        naive_tokens,
                        traced=False,
                        n_prompts=1,
                    )
                )  # one prompt: it is slow
            # cold: a new node for every prompt, so every measured token is decoded with caches that
            # started empty, as every token of a K3 reply is (no reply warms 1.56 TB of experts)
            results.append(
                measured(
                    "cold",
                    lambda i, trace: expertmesh_node(home(f"cold-{i}"), trace),
                    tokens,
                    traced=True,
                    fresh_per_prompt=True,
                )
            )
            # warm_disk: the disk of a node that has answered these prompts once before (not timed)
            cached = home("cached")
            session = expertmesh_node(cached)
            _run_prompts(session, prompts, tokens)
            session.close()
            results.append(measured("warm_disk", lambda i, trace: expertmesh_node(cached, trace), tokens, traced=True))
            sm = open_model(repo_id, home=home("warm_ram"), store=StoreConfig(ram_budget=str(2 * all_bytes)))
            _run_prompts(sm, prompts, tokens)  # fill RAM
            results.append(measured("warm_ram", lambda i, _: sm, tokens, traced=False))

            ref, ref_tok = mlx_lm.load(str(work / "hub" / repo_id))[:2]  # (model, tokenizer): no config asked for
            mlx_runs = []
            for ids in prompts:
                from mlx_lm.sample_utils import make_sampler

                t0 = time.perf_counter()
                out: list[int] = []
                ttft = 0.0
                for step in mlx_lm.stream_generate(ref, ref_tok, ids, max_tokens=tokens, sampler=make_sampler(0.0)):
                    if not out:
                        ttft = time.perf_counter() - t0
                    if step.finish_reason != "stop":
                        out.append(step.token)
                s = GenerationSummary(
                    prompt_tokens=len(ids),
                    generated_tokens=len(out),
                    time_to_first_token_s=ttft,
                    seconds=time.perf_counter() - t0,
                )
                mlx_runs.append(PromptRun(s, out))
            mlx = _result("mlx_lm", mlx_runs, 0, link, None)
            mlx.link_utilisation = mlx.ram_hit_rate = mlx.ready_hit_rate = mlx.disk_hit_rate = None
            results.append(mlx)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    reference = results[-1].outputs
    for r in results:
        if any(o[: len(ref)] != ref[: len(o)] for o, ref in zip(r.outputs, reference)):  # the shorter a prefix
            raise AssertionError(f"bench: {r.name} generated other tokens than mlx-lm: the comparison is void")
    return {
        "model": repo_id,
        "tokens_per_prompt": tokens,
        "prompts": list(PROMPTS),
        "ram_fraction": ram_fraction,
        "hub_connections": hub_connections,
        "pieces_per_expert": pieces_per_expert,
        "coalesce": coalesce,
        "link": asdict(link),
        "configs": [asdict(r) for r in results],
    }


def print_table(doc: dict, out=print) -> None:
    configs = {c["name"]: c for c in doc["configs"]}
    out(
        f"{'config':<10} {'ms/token':>9} {'vs mlx_lm':>9} {'TTFT s':>7} {'hub B/token':>11} {'useful':>6} "
        f"{'busy':>5} {'RAM hit':>7} {'Belady':>7} {'ready':>7} {'disk hit':>8}"
    )

    def f(v, fmt):
        return format(v, fmt) if v is not None else "-"

    base = configs["mlx_lm"]["s_per_token"]
    for c in doc["configs"]:
        out(
            f"{c['name']:<10} {c['s_per_token'] * 1000:>9.2f} {c['s_per_token'] / base:>8.2f}x {c['ttft_s']:>7.3f} "
            f"{c['hub_bytes_per_token']:>11.0f} {f(c.get('useful_link_use'), '.2f'):>6} "
            f"{f(c['link_utilisation'], '.2f'):>5} {f(c['ram_hit_rate'], '.3f'):>7} "
            f"{f(c['belady_ram_hit_rate'], '.3f'):>7} {f(c.get('ready_hit_rate'), '.3f'):>7} "
            f"{f(c['disk_hit_rate'], '.3f'):>8}"
        )
    for name in ("cold", "warm_disk"):
        c = configs.get(name)
        if c and c.get("ready_hit_rate") is not None and c.get("belady_staged_hit_rate"):
            out(
                f"{name}: RAM hits {c['ram_hit_rate'] / c['belady_ram_hit_rate']:.2f}x Belady's; uses answered "
                f"without waiting {c['ready_hit_rate'] / c['belady_staged_hit_rate']:.2f}x Belady's with the same "
                f"memory (budget + staged guesses)"
            )
    out(
        "useful: bytes decode waited for from the Hub / link bandwidth / seconds it waited; "
        "busy: every byte the Hub sent during decode (fills, guesses) / bandwidth / decode time"
    )
    for c in doc["configs"]:
        if c.get("link_utilisation_while_fetching"):
            out(
                f"{c['name']}: link busy {c['link_utilisation']:.2f} over decode, "
                f"{c['link_utilisation_while_fetching']:.2f} while anything was left to fetch"
            )
    if "naive" in configs and "cold" in configs:
        out(
            f"cold is {configs['naive']['s_per_token'] / configs['cold']['s_per_token']:.1f}x faster than naive; "
            f"warm_ram is {configs['warm_ram']['s_per_token'] / base:.2f}x mlx_lm"
        )


def write_json(doc: dict, path: Path) -> None:
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")
