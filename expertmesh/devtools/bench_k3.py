"""`expertmesh bench --model k3-proportions`: the fetch path at Kimi K3's real proportions, honestly.

A K3-proportioned repo (expertmesh/devtools/tiny/k3_proportions.py: 3 MoE layers of 64 experts of
17,547,264 bytes, top-16) is served by `expertmesh hub` in a process of its own, shaped like a
home link with its real numbers and no time scale: 100 MB/s in all, a per-connection cap (12.5, 25
or 100 MB/s), 75 ms to the first byte. The 100 MB/s are the hub process's own token bucket, or with
`--kernel-link` (root, ip and tc) a tbf qdisc on the Hub's interface in a network namespace of its
own, the workers in another (expertmesh/devtools/lab/network.py); the per-connection cap and the first
byte's delay are the hub's knobs either way (tbf cannot cap a connection; netem is unavailable).
Every configuration runs in a process of its own, so its peak RSS and CPU time are its own, on the
same prompts:

    floor          the bytes decode demanded from the link, divided by its bandwidth: no fetch
                   strategy does better
    fair_naive     one keep-alive connection, one expert at a time, no guesses, the same caches as
                   cold: the simplest client a user would write
    deltafin_like  one expert at a time on a new connection per request: the reference system's way
    cold           expertmesh's defaults, caches empty at every prompt
    k3_replay      K3's decode regime without compute: every MoE layer of every token asks for
                   top-k experts not held anywhere (no RAM, no disk), the next layer's true routing
                   given as the guess
    warm_disk      the experts of the prompts on disk (an untimed pass first), RAM empty
    warm_disk_floor  warm_disk with the page cache emptied before each prompt's decode, so every
                   expert not in RAM is read from the disk itself; judged against the disk's own
                   floor: the bytes decode read from disk ÷ the bandwidth `cat` or parallel
                   `preadv` reach on the same files from a cold page cache (devtools/disk_floor.py)
    mlx_lm         mlx-lm with every expert in memory
    core_streamed  the core streamed from the SSD within a quarter of its size (node/engine/
                   streamed_core.py), on a variant whose core has K3's shape of many small layers
                   (12 MoE layers, hidden 1024, 1.6 MB experts: a layer is a few % of the core, as
                   K3's is ~1 %); the prompt runs twice on one node, the second timed with its
                   experts in RAM and the page cache of the core's files dropped; the same on a
                   node holding the core whole gives the tokens it must equal

Decode is measured (after the first token); what the fields count:

    s_per_token                decode seconds per token (k3_replay: seconds per replayed token)
    wait_over_floor            seconds layer calls waited for experts ÷ the floor's seconds
    useful_link_use            the floor's seconds ÷ seconds waited: the link's share that moved
                               bytes a token waited for
    bytes_moved_over_demanded  bytes the Hub sent ÷ bytes of the experts decode took from the link
                               (above 1: wasted guesses, fills, retries)
    peak_rss_bytes             the process's peak resident memory
    node_cpu_s_per_gb          the node process's CPU seconds per GB the Hub sent it
    disk_wait_over_floor       (warm_disk_floor) seconds layer calls waited for experts read from
                               disk ÷ the floor's seconds for the same bytes
    hash_cpu_s_per_gb          (warm_disk_floor) CPU seconds the disk tier's integrity check took
                               per GB it checked
    core_bytes_per_token       (core_streamed) core bytes read from the SSD per decoded token
    core_wait_over_floor       (core_streamed) seconds layers waited for their reads ÷ the core bytes
                               read at the parallel-preadv floor of the same files, cold
    tokens_equal_resident      (core_streamed) the tokens equal those of the core held whole
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from expertmesh.node.errors import ExpertmeshError
from expertmesh.node.sizes import format_size

REPO_ID = "expertmesh/k3-proportions"
LINK_BYTES_PER_S = 100e6
TTFB_S = 0.075
WORKER_NIC_BYTES_PER_S = 1.25e9  # --kernel-link: the workers' NIC, 10 GbE, never the bottleneck
PROMPTS = ("Count the experts", "Stream the layer", "Fetch once, keep it")
FIELDS = (
    "s_per_token",
    "wait_over_floor",
    "useful_link_use",
    "bytes_moved_over_demanded",
    "peak_rss_bytes",
    "node_cpu_s_per_gb",
    "disk_wait_over_floor",
    "hash_cpu_s_per_gb",
)
CORE_FIELDS = ("core_bytes_per_token", "core_wait_over_floor", "tokens_equal_resident")
CORE_BUDGET = "25%"


@dataclass
class Row:
    name: str
    per_connection_bytes_per_s: float
    s_per_token: float
    wait_over_floor: float | None = None
    useful_link_use: float | None = None
    bytes_moved_over_demanded: float | None = None
    peak_rss_bytes: int | None = None
    node_cpu_s_per_gb: float | None = None
    disk_wait_over_floor: float | None = None
    hash_cpu_s_per_gb: float | None = None
    tokens: int = 0
    demanded_bytes: int = 0
    moved_bytes: int = 0
    wait_s: float = 0.0
    disk_bytes: int = 0
    disk_wait_s: float = 0.0
    floor_bytes_per_s: float | None = None
    # the fate of guesses and fills while measured (stats.PREFETCH_OUTCOMES): where moved bytes went
    prefetch: dict[str, int] | None = None
    core_bytes_per_token: float | None = None
    core_wait_over_floor: float | None = None
    tokens_equal_resident: bool | None = None
    core: dict | None = None  # core_streamed: the core, its budget, what was read and waited, the floor
    hub_connections: int | None = None  # the Hub tier's connection count at the end (measured, or fixed)


# -- the worker: one configuration in its own process -----------------------------------------


def _hub_bytes(url: str) -> int:
    with urllib.request.urlopen(f"{url}/_hub/stats", timeout=30) as r:
        return json.load(r)["bytes_served"]


def _peak_rss() -> int:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb * (1 if sys.platform == "darwin" else 1024)  # bytes on macOS, KiB on Linux


class _Phase:
    """What a measured phase consumed: store waits, bytes from the Hub, CPU and wall time."""

    def __init__(self, store, hub_url: str):
        self.store, self.hub_url = store, hub_url
        self.stats = store.stats.snapshot()
        self.hub = _hub_bytes(hub_url)
        self.cpu, self.wall = time.process_time(), time.perf_counter()

    def since(self) -> dict:
        d = self.store.stats.since(self.stats)
        return {
            "wait_s": d.wait_seconds,
            "demanded_bytes": d.bytes["hub"],
            "moved_bytes": _hub_bytes(self.hub_url) - self.hub,
            "cpu_s": time.process_time() - self.cpu,
            "wall_s": time.perf_counter() - self.wall,
            **{f"prefetch_{k}": v for k, v in d.prefetch.items()},
        }


class _DiskWatch:
    """What the warm-disk floor needs from one node, measured from outside the store: wall seconds
    of layer calls that read an expert from disk, and the CPU time of the disk tier's check."""

    def __init__(self, store):
        self.store = store
        self.wait_s = 0.0
        self.hash_cpu_s = 0.0
        self.hash_bytes = 0
        lock = threading.Lock()  # the fetch threads check at once
        finish, check = store._finish, store.chain.digests.check_local

        def timed_finish(layer, *started):  # every layer call and every group of one ends here
            before = store.stats.uses["disk"]
            t0 = time.perf_counter()
            out = finish(layer, *started)
            if store.stats.uses["disk"] != before:
                self.wait_s += time.perf_counter() - t0
            return out

        def timed_check(key, blob):
            t0 = time.thread_time()  # this thread's CPU, not the others'
            ok = check(key, blob)
            cpu = time.thread_time() - t0
            with lock:
                self.hash_cpu_s += cpu
                self.hash_bytes += len(blob)
            return ok

        store._finish, store.chain.digests.check_local = timed_finish, timed_check

    def result(self) -> dict:
        return {"disk_wait_s": self.wait_s, "hash_cpu_s": self.hash_cpu_s, "hash_bytes": self.hash_bytes}


def _sum(parts: list[dict]) -> dict:
    """The phases of several prompts together (the connection count: the last one's)."""
    out = {k: sum(p[k] for p in parts) for k in parts[0] if k != "hub_connections"} if parts else {}
    if parts and "hub_connections" in parts[-1]:
        out["hub_connections"] = parts[-1]["hub_connections"]
    return out


def _open(spec: dict, home: Path):
    from expertmesh.assembly import open_model
    from expertmesh.node.config import StoreConfig

    reader = None
    if spec.get("fresh_connections"):
        from expertmesh.devtools.bench import FreshConnectionReader

        reader = FreshConnectionReader()
    return open_model(spec["repo_id"], home=home, store=StoreConfig(**spec["store"]), hub_reader=reader)


def _generate(spec: dict, home: Path, prompt: str) -> dict:
    """One prompt on a new node: its decode phase measured."""
    from expertmesh.node.engine.generation import Generator, SamplingSettings

    sm = _open(spec, home)
    try:
        ids = sm.tokenizer.encode(prompt)
        phase, tokens, watch = None, 0, None
        for _ in Generator(sm).generate(ids, SamplingSettings(max_tokens=spec["tokens"])):
            tokens += 1
            if phase is None:
                sm.store.disk.flush()  # the prefill's writes are not decode's
                if spec.get("cold_disk"):  # decode reads the disk itself, not the page cache
                    from expertmesh.devtools.disk_floor import drop_page_cache

                    drop_page_cache(_expert_files(home))
                    watch = _DiskWatch(sm.store)
                phase = _Phase(sm.store, spec["hub_url"])
        if phase is None:
            return {}
        d = sm.store.stats.since(phase.stats)
        return {
            **phase.since(),
            "tokens": tokens - 1,
            "disk_bytes": d.bytes["disk"],
            "hub_connections": sm.store.chain.runs.connections,
            **(watch.result() if watch else {}),
        }
    finally:
        sm.close()


def _expert_files(home: Path) -> list[str]:
    return sorted(str(p) for p in (home / "experts").glob("*/*/*/*.bin"))


def _take(store, layer: int, experts: list[int], guess=None) -> None:
    """A layer's experts as a block takes them: each group placed in RAM-tier slots (MLX thread)."""
    from expertmesh.node.engine.model_thread import model_thread

    for group in store.layer_groups(layer, experts, guess=guess):
        model_thread().call(_place, group)


def _place(group) -> None:
    """Into slots and written, as a layer's kernels would make them written before reading them:
    the replay pays each kept expert's copy into its slot as decode does. Left lazy, writes that no
    kernel ever reads pile up one graph holding every expert replayed, whose memory is never
    reused (every decode then faults in fresh pages: CPU the fetch path does not spend)."""
    import mlx.core as mx

    with group.placed() as placed:
        if placed.slots:
            stacks = group.ram.pool(group.layer).arrays or {}
            mx.eval([a for arrays in stacks.values() for a in arrays.values()])


def _replay(spec: dict, home: Path) -> dict:
    """K3's regime without compute: top-k fresh experts a layer, the true next routing as the guess."""
    import numpy as np

    sm = _open(spec, home)
    try:
        store, index = sm.store, sm.index
        layers = index.moe_layers
        per_layer = {layer: sum(1 for lay, _ in index.experts if lay == layer) for layer in layers}
        rng = np.random.default_rng(0)
        plan = [[rng.choice(per_layer[layer], spec["top_k"], replace=False).tolist() for layer in layers]]
        for _ in range(spec["tokens"]):
            plan.append([rng.choice(per_layer[layer], spec["top_k"], replace=False).tolist() for layer in layers])
        flat = [(layer, experts) for token in plan for layer, experts in zip(layers, token)]
        _take(store, *flat[0])  # untimed: connections made, the first layer's experts in flight
        phase = _Phase(store, spec["hub_url"])
        for (layer, experts), nxt in zip(flat[1:], [*flat[2:], None]):
            _take(store, layer, experts, guess=nxt)
        return {**phase.since(), "tokens": spec["tokens"], "hub_connections": store.chain.runs.connections}
    finally:
        sm.close()


def _mlx_lm(spec: dict) -> dict:
    import mlx_lm

    model, tokenizer = mlx_lm.load(spec["repo_dir"])[:2]  # (model, tokenizer): no config asked for
    per_token = []
    for prompt in spec["prompts"]:
        last = None
        for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=spec["tokens"]):
            last = r
        per_token.append(1 / last.generation_tps if last and last.generation_tps else 0.0)
    return {"s_per_token": sorted(per_token)[len(per_token) // 2], "tokens": spec["tokens"]}


def _core_run(spec: dict, home: Path, core_budget: str | None) -> dict:
    """The prompt twice on one node: untimed (its experts into RAM), then timed from its first token
    with the page cache of the core's files dropped."""
    from expertmesh.assembly import build_node
    from expertmesh.devtools.disk_floor import drop_page_cache
    from expertmesh.node.config import NodeConfig, StoreConfig
    from expertmesh.node.engine.generation import Generator, SamplingSettings
    from expertmesh.node.engine.streamed_core import core_files
    from expertmesh.node.hub import local_models

    store = StoreConfig(**spec["store"])
    node = build_node(NodeConfig(spec["repo_id"], home=home, store=store, core_budget=core_budget)).start()
    try:
        sm, prompt = node.require_model(), spec["prompts"][0]
        ids = sm.tokenizer.encode(prompt)
        settings = SamplingSettings(max_tokens=spec["tokens"])
        list(Generator(sm).generate(ids, settings))  # untimed: the experts of these tokens into RAM
        sm.store.disk.flush()
        files = core_files(local_models.find_pulled(home, spec["repo_id"]))
        drop_page_cache(files)
        core = sm.core_stream
        tokens: list[int] = []
        t0: float | None = None
        before = (0, 0.0)  # the core's bytes read and seconds waited at the first token
        for t in Generator(sm).generate(ids, settings):
            tokens.append(t.id)
            if t0 is None:  # decode is measured: the prefill reads the core as often as its passes
                t0 = time.perf_counter()
                before = (core.stats.read_bytes, core.stats.wait_s) if core else (0, 0.0)
        if t0 is None:
            raise ExpertmeshError(f"{spec['name']}: the prompt gave no token to time")
        wall = time.perf_counter() - t0
        out = {"tokens_list": tokens, "tokens": len(tokens) - 1, "wall_s": wall, "files": [str(f) for f in files]}
        if core is not None:
            out.update(
                core_read_bytes=core.stats.read_bytes - before[0],
                core_wait_s=core.stats.wait_s - before[1],
                core_bytes=core.layout.core_bytes,
                core_budget_bytes=node.memory.core_held_bytes if node.memory is not None else None,
                largest_layer_bytes=core.layout.largest_layer_bytes,
                resident_bytes=core.layout.resident_bytes,
                pinned_layers=core.split.pinned,
                read_ahead_layers=core.split.ahead,
                peak_held_bytes=core.stats.peak_held_bytes,
            )
        return out
    finally:
        node.close()


def _core_streamed(spec: dict, work: Path) -> dict:
    """One side of core_streamed in this process (its peak RSS its own): the core streamed within
    CORE_BUDGET, then the disk's floor on the core's files; or (`resident`) the core held whole."""
    from expertmesh.devtools.disk_floor import floor_bandwidth

    home = work / "home"
    shutil.copytree(spec["template"], home)
    out = _core_run(spec, home, None if spec.get("resident") else CORE_BUDGET)
    out["peak_rss_bytes"] = _peak_rss()
    if not spec.get("resident"):
        out["core_floor"] = floor_bandwidth(out["files"])
    return out


def worker(spec: dict) -> dict:
    from expertmesh.node.hub import client as hub_client

    work = Path(spec["work"])
    out: dict
    with hub_client.using_endpoint(spec["hub_url"]):
        if spec["mode"] == "core_streamed":
            return _core_streamed(spec, work)
        if spec["mode"] == "mlx_lm":
            out = _mlx_lm(spec)
        elif spec["mode"] == "replay":
            home = work / "home"
            shutil.copytree(spec["template"], home)
            out = _replay(spec, home)
        else:
            home = work / "home"
            if spec["mode"] == "warm":  # fill the disk with the prompts' experts first, untimed
                shutil.copytree(spec["template"], home)
                for prompt in spec["prompts"]:
                    _generate({**spec, "store": {**spec["store"], "ram_budget": "0"}}, home, prompt)
            parts = []
            for n, prompt in enumerate(spec["prompts"]):
                if spec["mode"] != "warm":  # caches empty at every prompt
                    home = work / f"home-{n}"
                    shutil.copytree(spec["template"], home)
                parts.append(_generate(spec, home, prompt))
            out = _sum([p for p in parts if p])
            if spec.get("cold_disk"):  # the disk's own floor on the same files, cold
                from expertmesh.devtools.disk_floor import floor_bandwidth

                out["floor"] = floor_bandwidth(_expert_files(home))
    out["peak_rss_bytes"] = _peak_rss()
    return out


# -- the driver -----------------------------------------------------------------------------


def prompt_bench_repo(p, progress: Callable[[str], None] = print) -> tuple[str, Path]:
    """The repo id and folder of the K3-proportioned repo `p` under the bench's Hub (made once), as
    the prompt bench and the prompt scripts in benchmarks/ use it."""
    from expertmesh.node import constants

    repo_id = f"{REPO_ID}-{p.moe_layers}x{p.experts}-{p.expert_bytes}"
    return repo_id, _model_dir(constants.expertmesh_home() / "bench" / "hub", repo_id, p, progress)


def _model_dir(cache: Path, repo_id: str, p, progress: Callable[[str], None]) -> Path:
    from expertmesh.devtools.tiny import k3_proportions

    repo = cache / repo_id
    made = repo.with_name(repo.name + ".made.json")  # what the repo was made as (beside it, not served)
    wanted = json.dumps({"maker": k3_proportions.MAKER_VERSION, **asdict(p)}, sort_keys=True)
    if not (repo / "config.json").is_file() or not made.is_file() or made.read_text() != wanted:
        progress(f"making {repo_id}: {p.moe_layers} MoE layers of {p.experts} experts of {p.expert_bytes:,} bytes")
        staging = repo.with_name(repo.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        k3_proportions.build(staging, 0, p)
        shutil.rmtree(repo, ignore_errors=True)  # made by another maker: its router or shape differ
        staging.rename(repo)
        made.write_text(wanted)
    from expertmesh.devtools.local_hub import HubServer

    hub = HubServer(repo.parent.parent)  # its shards' sha256 now, once, so the hub's hasher never competes with a run
    if any(hub.digests.get(f) is None for f in hub.large_files()):
        progress("hashing the shards once (kept for later runs)")
        hub.digests.hash_all(hub.large_files())
    hub.httpd.server_close()
    return repo


class _Hub:
    """`expertmesh hub` in its own process, shaped like a home link.

    With `net` (a network.LabNetwork) it runs in the namespace of the net's "hub" host and listens on
    its address; the link's bandwidth is then the tbf qdisc on that host's interface, so the hub is
    not given `--bandwidth`. The per-connection cap and the first-byte delay stay the hub's own knobs
    either way: tbf shapes an interface, not a connection, and netem is not available here.
    """

    def __init__(self, root: Path, per_connection: float, link: float, ttfb: float, net=None):
        cmd = [sys.executable, "-m", "expertmesh", "hub", str(root), "--port", "0"]
        cmd += ["--per-connection-bandwidth", str(int(per_connection)), "--ttfb", str(ttfb)]
        if net is None:
            cmd += ["--bandwidth", str(int(link))]
        else:
            cmd = net.hosts["hub"].command([*cmd, "--host", net.hosts["hub"].address])
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        stdout = self.proc.stdout  # a pipe: stdout=PIPE
        line = stdout.readline() if stdout is not None else ""
        m = re.search(r"at (http://\S+)", line)
        if not m:
            self.proc.kill()
            self.proc.wait(30)
            raise RuntimeError(f"the hub did not start: {line!r}")
        self.url = m.group(1)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)


def _run_worker(spec: dict, net=None) -> dict:
    """One config in a process of its own; with `net`, in the namespace of the net's node "n0"."""
    cmd = [sys.executable, "-m", "expertmesh.devtools.bench_k3", json.dumps(spec)]
    r = subprocess.run(
        net.hosts["n0"].command(cmd) if net else cmd,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if r.returncode != 0:
        raise RuntimeError(f"{spec['name']} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _row(name: str, cap: float, link: float, got: dict) -> Row:
    floor = got.get("demanded_bytes", 0) / link
    wait = got.get("wait_s", 0.0)
    tokens = max(1, got.get("tokens", 1))
    moved = got.get("moved_bytes", 0)
    floor_bw = got.get("floor", {}).get("bytes_per_s")
    disk_floor_s = got.get("disk_bytes", 0) / floor_bw if floor_bw else 0.0
    if "core_floor" in got:
        core_bw = got["core_floor"]["pread_bytes_per_s"]  # the parallel-preadv floor: how the core is read
        core_floor_s = got.get("core_read_bytes", 0) / core_bw if core_bw else 0.0
        return Row(
            name,
            cap,
            s_per_token=got["wall_s"] / tokens,
            peak_rss_bytes=got.get("peak_rss_bytes"),
            tokens=got.get("tokens", 0),
            core_bytes_per_token=got.get("core_read_bytes", 0) / tokens,
            core_wait_over_floor=got.get("core_wait_s", 0.0) / core_floor_s if core_floor_s else None,
            tokens_equal_resident=got["tokens_equal_resident"],
            core={
                k: got[k]
                for k in got
                if k.startswith(("core_", "largest", "resident", "pinned", "read_ahead", "peak_held"))
            },
        )
    return Row(
        name,
        cap,
        s_per_token=got["s_per_token"] if "s_per_token" in got else got["wall_s"] / tokens,
        wait_over_floor=wait / floor if floor else None,
        useful_link_use=floor / wait if wait else None,
        bytes_moved_over_demanded=moved / got["demanded_bytes"] if got.get("demanded_bytes") else None,
        peak_rss_bytes=got.get("peak_rss_bytes"),
        node_cpu_s_per_gb=got["cpu_s"] / (moved / 1e9) if moved else None,
        tokens=got.get("tokens", 0),
        demanded_bytes=got.get("demanded_bytes", 0),
        moved_bytes=moved,
        wait_s=wait,
        disk_wait_over_floor=got["disk_wait_s"] / disk_floor_s if disk_floor_s else None,
        hash_cpu_s_per_gb=got["hash_cpu_s"] / (got["hash_bytes"] / 1e9) if got.get("hash_bytes") else None,
        disk_bytes=got.get("disk_bytes", 0),
        disk_wait_s=got.get("disk_wait_s", 0.0),
        floor_bytes_per_s=floor_bw,
        prefetch={k.removeprefix("prefetch_"): v for k, v in got.items() if k.startswith("prefetch_")} or None,
        hub_connections=got.get("hub_connections"),
    )


class KernelLinkUnavailable(ExpertmeshError):
    """`--kernel-link` asked for where network namespaces cannot be made."""


def _require_namespaces() -> None:
    from expertmesh.devtools.lab import network

    why = network.available()
    if why:
        raise KernelLinkUnavailable(f"--kernel-link needs network namespaces: {why}")


def _kernel_link(link: float, progress: Callable[[str], None]):
    """The Hub's namespace and one for the workers on the lab's bridge; the Hub's link `link` B/s
    by tbf both ways, the workers' NIC far faster so that only the Hub's link binds."""
    from expertmesh.devtools.lab import network

    _require_namespaces()
    removed = network.remove_leftovers()
    if removed:
        progress(f"removed leftovers of earlier runs: {', '.join(removed)}")
    net = network.LabNetwork(1, lan_bytes_per_s=WORKER_NIC_BYTES_PER_S, hub_bytes_per_s=link).up()
    progress(f"network: the Hub and the workers in namespaces {net.prefix}-hub, {net.prefix}-n0 on a bridge")
    return net


def _pull_in(net, repo_id: str, home: Path, hub_url: str) -> None:
    """`expertmesh pull` inside the workers' namespace (the driver cannot reach the Hub's address)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EXPERTMESH_", "HF_"))}
    env.update(EXPERTMESH_HOME=str(home), HF_ENDPOINT=hub_url)
    cmd = [sys.executable, "-m", "expertmesh", "pull", repo_id, "--no-progress"]
    r = subprocess.run(net.hosts["n0"].command(cmd), env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"pull over the kernel link failed:\n{r.stderr[-3000:]}")


def _raise_interrupt(*_) -> None:
    raise KeyboardInterrupt


def _interrupt_on_signals() -> dict:
    """SIGTERM and SIGHUP unwind through `run`'s finally as Ctrl-C does (namespaces removed);
    returns the old handlers. Only the main thread may set handlers: elsewhere, none are set."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    for s in old:
        signal.signal(s, _raise_interrupt)
    return old


# the configurations a run has by default, in the order they run (`--configs` picks others)
CONFIGS = ("cold", "fair_naive", "deltafin_like", "k3_replay", "warm_disk", "warm_disk_floor", "mlx_lm")
# and those run only when asked: cold and k3_replay with the Hub's connection count fixed at its
# start, to set beside the measured count (`--configs k3_replay,k3_replay_fixed`), and the core
# streamed from the disk within a quarter of its size (`--configs core_streamed`)
ALL_CONFIGS = (*CONFIGS, "k3_replay_fixed", "cold_fixed", "core_streamed")


def run(
    per_connection: list[float],
    tokens: int = 4,
    link: float = LINK_BYTES_PER_S,
    ttfb: float = TTFB_S,
    configs: tuple[str, ...] = CONFIGS,
    progress: Callable[[str], None] = print,
    proportions=None,
    cache: Path | None = None,
    kernel_link: bool = False,
) -> dict:
    """Every configuration at every per-connection cap; returns the JSON document.

    `proportions` (k3_proportions.Proportions) defaults to K3's; `cache` (where the model is made
    and kept) to $EXPERTMESH_HOME/bench. `kernel_link`: the Hub in one network namespace and every
    config's worker in another, joined by a bridge, the link a tbf qdisc on the Hub's interface
    both ways (the lab's network module); every namespace is removed afterwards, also on error,
    Ctrl-C or SIGTERM.

    Raises:
        KernelLinkUnavailable: `kernel_link` asked for where namespaces cannot be made (not root,
            no ip/tc); there is no silent fallback to the hub's own shaping.
    """
    from expertmesh.devtools.tiny import k3_proportions
    from expertmesh.node import constants
    from expertmesh.node.hub import client as hub_client
    from expertmesh.node.hub.pull import pull

    if kernel_link:
        _require_namespaces()  # before anything is made or started
    p = proportions or k3_proportions.Proportions()
    repo_id = REPO_ID if p == k3_proportions.Proportions() else f"{REPO_ID}-{p.moe_layers}x{p.experts}-{p.expert_bytes}"
    repo_id += "-raw-router" if p.router == "raw" else ""
    cache = cache or constants.expertmesh_home() / "bench"
    only_core = set(configs) == {"core_streamed"}  # then the 17.5 MB-expert model is neither made nor pulled
    root = cache / "hub" / repo_id if only_core else _model_dir(cache / "hub", repo_id, p, progress)
    core_p = core_repo = None
    if "core_streamed" in configs:  # its own shape: many layers, each a small share of the core, as K3's
        # K3's proportions of core to layer (many layers, each a small share), experts small (what it
        # measures is the core), a core of a few hundred MB so that cold reads are measurable
        core_shape = k3_proportions.Proportions(
            moe_layers=12, experts=16, top_k=4, latent=1024, intermediate=1024, hidden=1024
        )
        core_p = p if p != k3_proportions.Proportions() else core_shape
        core_repo = f"{REPO_ID}-core-{core_p.moe_layers}x{core_p.hidden}"
        _model_dir(cache / "hub", core_repo, core_p, progress)
    work = Path(tempfile.mkdtemp(prefix="expertmesh-bench-k3-"))
    ram = str(4 * p.expert_bytes)  # a few experts: K3's RAM holds a small share of its experts too
    store = {"ram_budget": ram, "disk_budget": "100%"}
    replay = {"ram_budget": "0", "disk_budget": "0", "fill": False}
    sequential = {**store, "fetch_concurrency": 1, "hub_connections": 1, "hub_max_connections": 1}
    sequential["hub_pieces_per_expert"] = 1
    sequential.update(prefetch=False, fill=False, coalesce=False)
    specs: dict[str, dict[str, Any]] = {  # what each worker process is told (JSON)
        "cold": {"mode": "generate", "store": store},
        "fair_naive": {"mode": "generate", "store": sequential, "prompts": PROMPTS[:1]},
        "deltafin_like": {"mode": "generate", "store": sequential, "prompts": PROMPTS[:1], "fresh_connections": True},
        "k3_replay": {"mode": "replay", "store": replay},
        # the same with the connection count fixed at its start, as before it was measured
        "k3_replay_fixed": {"mode": "replay", "store": {**replay, "hub_max_connections": constants.HUB_CONNECTIONS}},
        "cold_fixed": {"mode": "generate", "store": {**store, "hub_max_connections": constants.HUB_CONNECTIONS}},
        "warm_disk": {"mode": "warm", "store": store},
        "warm_disk_floor": {"mode": "warm", "store": store, "cold_disk": True},
        "mlx_lm": {"mode": "mlx_lm", "store": store},
        # experts in RAM after the untimed pass (all of the variant's fit), so only the core reads the disk
        "core_streamed": {
            "mode": "core_streamed",
            "store": {"ram_budget": "2GB", "disk_budget": "100%", "fill": False},
        },
    }
    rows: list[Row] = []
    net = None
    restore = _interrupt_on_signals() if kernel_link else {}
    try:
        if kernel_link:
            net = _kernel_link(link, progress)
        for cap in per_connection:
            hub = _Hub(root.parent.parent, cap, link, ttfb, net)
            try:
                template = work / f"pulled-{int(cap)}"
                if only_core:
                    pass
                elif net is None:
                    with hub_client.using_endpoint(hub.url):
                        pull(repo_id, home=template, progress=False)
                else:  # the Hub is reachable only from inside the bridge
                    _pull_in(net, repo_id, template, hub.url)
                if core_repo is not None and cap == per_connection[0]:
                    if net is None:
                        with hub_client.using_endpoint(hub.url):
                            pull(core_repo, home=template, progress=False)
                    else:
                        _pull_in(net, core_repo, template, hub.url)
                progress(
                    f"link {format_size(link)}/s ({'kernel tbf' if net else 'hub process'}), "
                    f"{format_size(cap)}/s per connection, first byte {ttfb * 1000:.0f} ms"
                )
                for name in configs:
                    if name == "core_streamed" and cap != per_connection[0]:
                        continue  # the core is read from this machine's SSD: the link does not matter
                    work_dir = str(work / f"{name}-{int(cap)}")
                    spec: dict[str, Any] = {
                        "name": name,
                        "repo_id": repo_id,
                        "repo_dir": str(root),
                        "hub_url": hub.url,
                        "template": str(template),
                        "work": work_dir,
                        "tokens": tokens,
                        "top_k": p.top_k,
                        "prompts": list(PROMPTS),
                        **specs[name],
                    }
                    if name == "core_streamed" and core_p is not None:
                        spec.update(repo_id=core_repo, top_k=core_p.top_k, tokens=max(tokens, 8))
                    progress(f"  {name} ...")
                    t0 = time.perf_counter()
                    try:
                        got = _run_worker(spec, net)
                        if name == "core_streamed":  # the core held whole, in a process of its own
                            resident = _run_worker({**spec, "resident": True, "work": work_dir + "-resident"}, net)
                            got.update(
                                tokens_equal_resident=got.pop("tokens_list") == resident["tokens_list"],
                                resident_s_per_token=resident["wall_s"] / max(1, resident["tokens"]),
                                resident_peak_rss_bytes=resident["peak_rss_bytes"],
                            )
                        row = _row(name, cap, link, got)
                    finally:
                        shutil.rmtree(
                            work_dir + "-resident", ignore_errors=True
                        )  # a cold config's caches can hold GBs: a long run must not fill the disk
                        shutil.rmtree(work_dir, ignore_errors=True)
                    rows.append(row)
                    progress(f"  {name}: {row.s_per_token:.2f} s/token ({time.perf_counter() - t0:.0f} s)")
                cold = next((r for r in rows if r.name == "cold" and r.per_connection_bytes_per_s == cap), None)
                if cold and cold.tokens:
                    rows.append(Row("floor", cap, s_per_token=cold.demanded_bytes / link / cold.tokens))
            finally:
                hub.close()  # before the namespaces go: a namespace outlives its deletion while in use
                shutil.rmtree(work / f"pulled-{int(cap)}", ignore_errors=True)
        qdisc = net.qdiscs("hub").strip() if net else None
    finally:
        if net is not None:
            net.down()
        shutil.rmtree(work, ignore_errors=True)
        for sig, handler in restore.items():
            signal.signal(sig, handler)
    return {
        "model": {"repo": repo_id, **asdict(p), "expert_bytes": p.expert_bytes},
        **({"core_streamed_model": {"repo": core_repo, **asdict(core_p)}} if core_p is not None else {}),
        "link": {
            "bytes_per_s": link,
            "ttfb_s": ttfb,
            "shaped_by": "kernel tbf" if kernel_link else "hub process",
            "per_connection_shaped_by": "hub process",  # tbf shapes an interface, not a connection
            **({"hub_qdisc": qdisc} if qdisc else {}),
        },
        "tokens_per_prompt": tokens,
        "load": os.getloadavg(),
        "configs": [asdict(r) for r in rows],
    }


def print_table(doc: dict, out=print) -> None:
    out(f"{'config':<15} {'cap MB/s':>8} {'s/token':>8} {'wait/floor':>10} {'link use':>8} {'moved/dem':>9} "
        f"{'peak RSS':>10} {'CPU s/GB':>8} {'disk/floor':>10} {'hash s/GB':>9}")  # fmt: skip
    for r in doc["configs"]:

        def f(v, fmt):
            return "-" if v is None else format(v, fmt)

        rss = format_size(r["peak_rss_bytes"]) if r["peak_rss_bytes"] else "-"
        out(
            f"{r['name']:<15} {r['per_connection_bytes_per_s'] / 1e6:>8.1f} {r['s_per_token']:>8.2f} "
            f"{f(r['wait_over_floor'], '.2f'):>10} {f(r['useful_link_use'], '.2f'):>8} "
            f"{f(r['bytes_moved_over_demanded'], '.2f'):>9} {rss:>10} {f(r['node_cpu_s_per_gb'], '.2f'):>8} "
            f"{f(r.get('disk_wait_over_floor'), '.2f'):>10} {f(r.get('hash_cpu_s_per_gb'), '.3f'):>9}"
        )
        if r.get("prefetch") and r["moved_bytes"]:
            out(f"{'':<15} guesses and fill: " + ", ".join(f"{k} {v}" for k, v in r["prefetch"].items()))
        if r.get("core"):
            c = r["core"]
            out(f"{'':<15} core {format_size(c['core_bytes'])} within {format_size(c['core_budget_bytes'])} "
                f"({c['pinned_layers']} layers pinned, {c['read_ahead_layers']} read ahead): "
                f"{format_size(r['core_bytes_per_token'])} read a token, waits {f(r['core_wait_over_floor'], '.2f')}x "
                f"the preadv floor ({format_size(c['core_floor']['pread_bytes_per_s'])}/s cold); "
                f"held at most {format_size(c['peak_held_bytes'])} (budget + one layer: "
                f"{format_size(c['core_budget_bytes'] + c['largest_layer_bytes'])}); "
                f"tokens equal to the core held whole: {r['tokens_equal_resident']}; held whole: "
                f"{c['resident_s_per_token']:.2f} s/token, peak RSS {format_size(c['resident_peak_rss_bytes'])}")  # fmt: skip
        if r.get("floor_bytes_per_s"):
            out(f"{'':<15} read {format_size(r['disk_bytes'])} from disk in {r['disk_wait_s']:.2f} s of waits; "
                f"the disk's floor {format_size(r['floor_bytes_per_s'])}/s (cat or parallel preadv, cold)")  # fmt: skip
    by = {(r["name"], r["per_connection_bytes_per_s"]): r for r in doc["configs"]}
    for (name, cap), r in by.items():
        fixed = by.get((f"{name}_fixed", cap))
        if fixed and r.get("useful_link_use") and fixed.get("useful_link_use"):
            out(
                f"at {cap / 1e6:.1f} MB/s per connection {name} fills {r['useful_link_use']:.2f} of the link on "
                f"{r.get('hub_connections')} connections (measured), {fixed['useful_link_use']:.2f} on "
                f"{fixed.get('hub_connections')} (fixed): waits {r['wait_over_floor']:.2f}x the floor against "
                f"{fixed['wait_over_floor']:.2f}x"
            )
        if name != "cold":
            continue
        for base in ("fair_naive", "deltafin_like"):
            b = by.get((base, cap))
            if b and r["s_per_token"]:
                out(f"at {cap / 1e6:.1f} MB/s per connection cold is {b['s_per_token'] / r['s_per_token']:.2f}x {base}")
    out(f"load average: {', '.join(f'{x:.2f}' for x in doc['load'])}")


if __name__ == "__main__":
    print(json.dumps(worker(json.loads(sys.argv[1]))))
