"""`expertmesh lab`: a household of real processes on kernel-shaped links, scenarios side by side.

The Hub (`expertmesh hub`, first-byte delay of a CDN) and N nodes (`expertmesh serve`, each
keeping the experts it owns after `expertmesh warm`) run each in a network namespace of its own
(network.py), joined by a bridge, every link shaped with `tbf`: the nodes' NICs at gigabit
Ethernet, the Hub's at a home link. The generating Mac is node 0: the scenarios run as a further
process in node 0's namespace (worker.py), so it shares node 0's NIC, and what node 0 holds is
one hop away on the same machine. Zeroconf finds the nodes across the bridge.

    alone_cold          node 0's generator alone: no peers, no disk, RAM of a few experts: the Hub
    alone_warm_disk     alone, the prompts' experts on its disk first (untimed)
    fetch_from_owners   the household: every expert's bytes fetched from the node that owns it
    remote              the household: activations sent to the owners, experts computed there
    remote_node_dies    as remote, the last node killed (SIGKILL) after the first decode tokens
    remote_node_joins   as remote without the last node (stopped first), started again after the first
                        decode tokens with its disk as it was; the generator follows zeroconf live, and
                        its next prompt starts once the node is seen (that wait is not decode time)
    prompt_fetch_from_owners  one long prompt (`prompt_tokens`, 128 by default) with the household,
                        its experts' bytes fetched from their owners: the time to its first token
    fetch_from_owners_unchecked  (asked for by name) as fetch_from_owners, with no peer's copy
                        checked against the Hub (`--no-audit`): what that check costs
    prompt_remote       the same prompt, its experts computed where they are (the prompt's rows for
                        each peer in ComputeExperts calls within the message limit, two at a time)

Every configuration generates greedily on the same prompts and must produce the tokens of
alone_cold. The projection (projection.py) turns the remote run's measured per-expert costs into
K3 on 1, 2 and 4 Macs, and the two prompt runs' bytes per row, calls and CPU time per row into a K3
prompt's time to its first token: the prompt's target (>= 5x sooner computed where the experts are)
is about Macs whose compute is far below the link's time, which this host's shared 2 cores are not.

Without root or iproute2 the lab runs on loopback instead and says so in its output and JSON
(`"network": "loopback"`): the Hub's own bandwidth knob for the home link, and each node's LAN
port emulated in its own process (member.py: `serve` with link_emulation's LanInterceptor, 1 ms a
call). The generator's own port is not shaped there, so its NIC is not shared as in a household.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import selectors
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

from expertmesh.devtools.lab import network, projection
from expertmesh.node.sizes import format_size

if TYPE_CHECKING:
    from expertmesh.devtools.tiny.k3_proportions import Proportions

SCENARIOS = (
    "alone_cold",
    "alone_warm_disk",
    "fetch_from_owners",
    "remote",
    "remote_node_dies",
    "remote_node_joins",
    "prompt_fetch_from_owners",
    "prompt_remote",
)
OPTIONAL_SCENARIOS = ("fetch_from_owners_unchecked",)  # run only when named
PROMPT_DECODE_TOKENS = 2  # a long prompt's scenarios time its first token; one more shows decode still runs
PROMPTS = ("Count the experts", "Stream the layer")
WARM_UP = "Warm up:"
START_TIMEOUT_S = 120.0
WORKER_TIMEOUT_S = 1800.0
LOOPBACK_RTT_S = 1e-3  # the emulated LAN's time per call in the loopback fallback (gigabit Ethernet's order)


@dataclass
class LabConfig:
    """What the lab builds and measures. The default model: 2 MoE layers of 32 K3-sized experts
    (17,547,264 bytes; 1.1 GB in all), top-16, so N=4 fits two cores and a few GB of disk."""

    nodes: int = 4
    moe_layers: int = 2
    experts: int = 32
    top_k: int = 16
    latent: int = 3584  # K3's
    intermediate: int = 3072  # K3's
    hidden: int = 256
    tokens: int = 6  # per prompt
    prompt_tokens: int = 128  # the prompt scenarios' one prompt
    prompts: tuple[str, ...] = PROMPTS
    lan_bytes_per_s: float = 118e6  # gigabit Ethernet
    hub_bytes_per_s: float = 100e6  # a home link
    hub_ttfb_s: float = 0.075
    ram_experts: int = 4  # every node's RAM budget, in experts: K3's RAM holds a small share too
    kill_after_token: int = 2
    scenarios: tuple[str, ...] = SCENARIOS
    namespaces: bool | None = None  # None: when available
    cache: Path | None = None  # where the model is made and kept (default $EXPERTMESH_HOME/lab)
    projection_inputs: dict = field(default_factory=dict)  # overrides of ProjectionInputs' assumed inputs

    def proportions(self):
        from expertmesh.devtools.tiny.k3_proportions import Proportions

        return Proportions(
            moe_layers=self.moe_layers,
            experts=self.experts,
            top_k=self.top_k,
            latent=self.latent,
            intermediate=self.intermediate,
            hidden=self.hidden,
        )


class LabError(RuntimeError):
    """A process of the lab failed to start or to finish."""


def _stdout(proc: subprocess.Popen) -> IO[str]:
    """The pipe of a process `Procs.start` started (always with stdout=PIPE, as text)."""
    if proc.stdout is None:
        raise ValueError("the process was started without stdout=PIPE")
    return proc.stdout


def _read_line(proc: subprocess.Popen, pattern: str, timeout_s: float, log: Path | None = None) -> re.Match:
    """The first line of `proc`'s stdout matching `pattern`, within `timeout_s`; then the rest of its
    stdout is drained in the background, so a chatty process never blocks on a full pipe. On failure
    the error carries what it printed and the tail of its stderr (`log`)."""
    stdout = _stdout(proc)
    sel = selectors.DefaultSelector()
    sel.register(stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    seen: list[str] = []
    try:
        while time.monotonic() < deadline and len(seen) < 200:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                break
            line = stdout.readline()
            if not line:
                break
            seen.append(line)
            m = re.search(pattern, line)
            if m:
                threading.Thread(target=_drain, args=(stdout,), daemon=True).start()
                return m
    finally:
        sel.close()
    err = log.read_text(errors="replace")[-2000:] if log is not None and log.exists() else ""
    argv = [str(a) for a in proc.args] if isinstance(proc.args, list) else [str(proc.args)]
    raise LabError(f"`{' '.join(argv[-8:])}` did not start: {''.join(seen)[-1500:]!r}\n{err}")


def _drain(stream) -> None:
    for _ in iter(stream.readline, ""):
        pass


class _Processes:
    """Every process the lab started: terminated (then killed) on close, newest first."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        """Start `argv`, its stderr into `log` (kept for the error message if it fails)."""
        with log.open("w") as err:
            proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self.procs.clear()


class Lab:
    """One run of the lab: `run()` returns the JSON document; every process and namespace is gone after."""

    def __init__(self, config: LabConfig, progress: Callable[[str], None] = print):
        self.config = config
        self.progress = progress
        self.work = Path(tempfile.mkdtemp(prefix="expertmesh-lab-"))
        self.procs = _Processes()
        self.net: network.LabNetwork | None = None
        self.secret = secrets.token_hex(16)
        self.cluster = f"lab{os.getpid()}"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("EXPERTMESH_", "HF_"))}
        self.env["EXPERTMESH_SECRET"] = self.secret

    # -- hosts --------------------------------------------------------------------------------

    def _command(self, host: str, argv: list[str]) -> list[str]:
        return self.net.hosts[host].command(argv) if self.net else argv

    def _address(self, host: str) -> str:
        return self.net.hosts[host].address if self.net else "127.0.0.1"

    def _env(self, home: Path, hub_url: str | None = None) -> dict[str, str]:
        env = {**self.env, "EXPERTMESH_HOME": str(home)}
        if hub_url:
            env["HF_ENDPOINT"] = hub_url
        return env

    def _cli(self) -> list[str]:
        return [sys.executable, "-m", "expertmesh"]

    def _run(self, host: str, argv: list[str], env: dict[str, str], timeout_s: float) -> str:
        r = subprocess.run(self._command(host, argv), env=env, capture_output=True, text=True, timeout=timeout_s)
        if r.returncode != 0:
            # warm prints each node's outcome (why it left one out) on stdout, its progress on stderr
            raise LabError(
                f"`{' '.join(argv[2:6])}` failed (exit {r.returncode}):\n{r.stderr[-3000:]}{r.stdout[-3000:]}"
            )
        return r.stdout

    # -- the run ------------------------------------------------------------------------------

    def run(self) -> dict:
        main = threading.current_thread() is threading.main_thread()
        old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)} if main else {}
        for s in old:  # a kill of the driver unwinds through the finally below, as Ctrl-C does
            signal.signal(s, _raise_interrupt)
        try:
            return self._run_all()
        finally:
            self.procs.close()
            if self.net is not None:
                self.net.down()
            shutil.rmtree(self.work, ignore_errors=True)
            for s, h in old.items():
                signal.signal(s, h)

    def _setup_network(self) -> str:
        c = self.config
        removed = network.remove_leftovers() if network.available() is None else []
        if removed:
            self.progress(f"removed leftovers of earlier labs: {', '.join(removed)}")
        why = network.available()
        if c.namespaces is False:
            why = "namespaces turned off"
        if why is None:
            self.net = network.LabNetwork(c.nodes, c.lan_bytes_per_s, c.hub_bytes_per_s).up()
            self.progress(
                f"network: {c.nodes} node namespaces and a Hub's on a bridge ({self.net.prefix}-*); "
                f"tbf {format_size(c.lan_bytes_per_s)}/s per node NIC each way, "
                f"{format_size(c.hub_bytes_per_s)}/s the Hub's link; zeroconf across the bridge"
            )
            return "namespaces"
        if c.namespaces:
            raise LabError(f"namespaces asked for but not available: {why}")
        self.progress(
            f"network: LOOPBACK FALLBACK ({why}): the Hub's link emulated by its own bandwidth knob, each "
            f"node's LAN port by a token bucket of {format_size(c.lan_bytes_per_s)}/s in its own process "
            f"(link_emulation.LanInterceptor, {LOOPBACK_RTT_S * 1000:.0f} ms a call); the generator's own "
            "port is not shaped. An emulation, not kernel-shaped links"
        )
        return "loopback"

    def _run_all(self) -> dict:
        from expertmesh.devtools import bench_k3
        from expertmesh.node import constants

        c = self.config
        mode = self._setup_network()
        p = c.proportions()
        cache = c.cache or constants.expertmesh_home() / "lab"
        repo_id = f"expertmesh/k3-lab-{p.moe_layers}x{p.experts}x{p.expert_bytes}"
        root = bench_k3._model_dir(cache / "hub", repo_id, p, self.progress)
        self.progress(
            f"model {repo_id}: {p.moe_layers} MoE layers x {p.experts} experts of {p.expert_bytes:,} bytes, "
            f"top-{p.top_k}"
        )
        hub_url = self._start_hub(root.parent.parent, mode)
        template = self.work / "template"
        self._run("n0", [*self._cli(), "pull", repo_id], self._env(template, hub_url), START_TIMEOUT_S)
        nodes = self._start_nodes(repo_id, template, hub_url, p.expert_bytes)
        t0 = time.perf_counter()
        warm_args = ["warm", repo_id, "--cluster", self.cluster, "--interface", self._address("n0"), "--wait", "4"]
        self._run("n0", [*self._cli(), *warm_args], self._env(template, hub_url), WORKER_TIMEOUT_S)
        self.progress(f"warm: each node keeps the experts it owns ({time.perf_counter() - t0:.0f} s)")

        results = []
        for name in c.scenarios:
            t0 = time.perf_counter()
            got = self._scenario(name, repo_id, template, hub_url, p.expert_bytes, nodes)
            results.append(_row(name, got))
            self.progress(
                f"  {name}: {got['s_per_token']:.3f} s/token, found {len(got['peers'])} peers by "
                f"{got['found_by']}, first tokens after {got['ttft_s']} s ({time.perf_counter() - t0:.0f} s, "
                f"load {os.getloadavg()[0]:.2f})"
            )
        short = [r for r in results if not r["name"].startswith("prompt_")]
        ref = next((r for r in short if r["name"] == "alone_cold"), short[0] if short else None)
        long = [r for r in results if r["name"].startswith("prompt_")]  # their own prompt: equal to each other
        for rows, first in ((short, ref), (long, long[0] if long else None)):
            for r in rows:
                r["tokens_equal_alone"] = first is not None and r["outputs"] == first["outputs"]
        remote = next((r for r in results if r["name"] == "remote"), None)
        proj = projection.project(_projection_inputs(remote, c.projection_inputs)) if remote else {}
        prompts = {r["name"]: r for r in long}
        prompt_proj = (
            projection.project_prompt(_prompt_projection_inputs(prompts, p, c.lan_bytes_per_s))
            if {"prompt_remote", "prompt_fetch_from_owners"} <= set(prompts)
            else {}
        )
        return {
            "network": mode,
            "nodes": c.nodes,
            "model": {"repo_id": repo_id, "expert_bytes": p.expert_bytes, **asdict(p)},
            "links": {
                "lan_bytes_per_s": c.lan_bytes_per_s,
                "lan_shaping": "tbf" if mode == "namespaces" else "in-process token bucket (LanInterceptor)",
                "hub_bytes_per_s": c.hub_bytes_per_s,
                "hub_ttfb_s": c.hub_ttfb_s,
            },
            "tokens_per_prompt": c.tokens,
            "prompts": list(c.prompts),
            "prompt_tokens": c.prompt_tokens,
            "load": list(os.getloadavg()),
            "configs": results,
            "projection": proj,
            "prompt_projection": prompt_proj,
        }

    def _start_hub(self, root: Path, mode: str) -> str:
        c = self.config
        argv = [*self._cli(), "hub", str(root), "--host", self._address("hub"), "--port", "0"]
        argv += ["--ttfb", str(c.hub_ttfb_s)]
        if mode == "loopback":
            argv += ["--bandwidth", str(int(c.hub_bytes_per_s))]
        host = "hub" if self.net else "n0"
        log = self.work / "hub.err"
        proc = self.procs.start(self._command(host, argv), self.env, log)
        return _read_line(proc, r"at (http://\S+)", START_TIMEOUT_S, log).group(1)

    def _start_nodes(self, repo_id: str, template: Path, hub_url: str, expert_bytes: int) -> list[dict]:
        c = self.config
        nodes = []
        for i in range(c.nodes):
            home = self.work / f"node{i}"
            shutil.copytree(template, home)
            ip = self._address(f"n{i}")
            argv = [*self._cli(), "serve"]
            if self.net is None:  # loopback: the node's LAN port emulated in its process
                argv = [sys.executable, "-m", "expertmesh.cli.lab_member", str(c.lan_bytes_per_s)]
                argv.append(str(LOOPBACK_RTT_S))
            argv += [repo_id, "--host", ip, "--port", "0", "--cluster", self.cluster]
            argv += ["--interface", ip, "--no-http", "--no-metrics", "--no-fill", "--no-prefetch"]
            argv += ["--ram-budget", str(c.ram_experts * expert_bytes), "--disk-budget", "100%"]
            log = self.work / f"node{i}.err"
            proc = self.procs.start(self._command(f"n{i}", argv), self._env(home, hub_url), log)
            m = _read_line(proc, r"node (\S+) serving .* on (\S+):(\d+)", START_TIMEOUT_S, log)
            nodes.append(
                {
                    "node_id": m.group(1),
                    "address": f"{ip}:{m.group(3)}",
                    "pid": proc.pid,
                    "proc": proc,
                    "argv": self._command(f"n{i}", argv),
                    "env": self._env(home, hub_url),
                }
            )
        self.progress(f"{len(nodes)} nodes serving: {', '.join(n['address'] for n in nodes)}")
        return nodes

    def _scenario(self, name: str, repo_id: str, template: Path, hub_url: str, expert_bytes: int, nodes) -> dict:
        c = self.config
        home = self.work / f"gen-{name}"
        shutil.copytree(template, home)
        ram = str(c.ram_experts * expert_bytes)
        spec: dict = {
            "repo_id": repo_id,
            "home": str(home),
            "hub_url": hub_url,
            "secret": self.secret,
            "prompts": list(c.prompts),
            "tokens": c.tokens,
            "warm_up": WARM_UP,
            "lan_bandwidth": c.lan_bytes_per_s,
            "store": {"ram_budget": ram, "disk_budget": "0", "fill": False},
        }
        if name.startswith("prompt_"):  # one long prompt, its first token timed
            spec.update(prompt_tokens=c.prompt_tokens, tokens=PROMPT_DECODE_TOKENS)
            name = name.removeprefix("prompt_")
        if name.startswith("alone"):
            spec["mode"] = "alone"
            if name == "alone_warm_disk":
                spec["store"]["disk_budget"] = "100%"
                spec["warm_first"] = True
        else:
            spec["mode"] = "fetch" if name.startswith("fetch_from_owners") else "remote"
            if name == "fetch_from_owners_unchecked":
                spec["store"]["audit"] = False
            spec.update(cluster=self.cluster, interface=self._address("n0"), expect_peers=len(nodes))
            if name == "remote_node_dies":
                victim = nodes[-1]
                spec["kill"] = {"pid": victim["pid"], "after_token": c.kill_after_token}
            if name == "remote_node_joins":
                self._stop_node(nodes[-1])
                spec.update(live_discovery=True, expect_peers=len(nodes) - 1)
                spec["join"] = {"after_token": c.kill_after_token}
        argv = [sys.executable, "-m", "expertmesh.devtools.lab.worker", json.dumps(spec)]
        if "join" in spec:
            out = self._run_joining(argv, self._env(home, hub_url), nodes[-1])
        else:
            out = self._run("n0", argv, self._env(home, hub_url), WORKER_TIMEOUT_S)
        shutil.rmtree(home, ignore_errors=True)
        return json.loads(out.strip().splitlines()[-1])

    def _stop_node(self, node: dict) -> None:
        proc = node["proc"]
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)

    def _run_joining(self, argv: list[str], env: dict[str, str], node: dict) -> str:
        """Run the worker; when it prints JOIN, start `node` again (same home, same flags)."""
        log = self.work / "worker-join.err"
        worker = self.procs.start(self._command("n0", argv), env, log)
        lines: list[str] = []
        joined = None
        watchdog = threading.Timer(WORKER_TIMEOUT_S, worker.kill)  # the read below ends when the worker does
        watchdog.start()
        try:
            for line in iter(_stdout(worker).readline, ""):
                lines.append(line)
                if line.strip() == "JOIN" and joined is None:
                    joined = self.procs.start(node["argv"], node["env"], self.work / "node-joined.err")
                    node.update(proc=joined, pid=joined.pid)
        finally:
            watchdog.cancel()
        if worker.wait(60) != 0 or not lines:
            raise LabError(f"remote_node_joins failed:\n{log.read_text(errors='replace')[-3000:]}")
        if joined is not None:
            _read_line(joined, r"node (\S+) serving", START_TIMEOUT_S, self.work / "node-joined.err")
        return "".join(lines)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _raise_interrupt(*_) -> None:
    raise KeyboardInterrupt


def _row(name: str, got: dict) -> dict:
    tokens = max(1, got["tokens"])
    remote = got["remote"]
    activation = remote.get("sent_bytes", 0) + remote.get("received_bytes", 0)
    lan = got["bytes"].get("peer", 0) + activation
    return {
        "name": name,
        "s_per_token": got["s_per_token"],
        "lan_bytes_per_token": lan / tokens,
        "hub_bytes_per_token": got["bytes"].get("hub", 0) / tokens,
        # what the generating node's audits of its peers' copies fetched from the Hub (not uses)
        "audit_bytes": got.get("audit_bytes", 0),
        "tokens_equal_alone": None,  # set against alone_cold
        "tokens": got["tokens"],
        "uses": got["uses"],  # where each use ran / came from
        "placed": got["placed"],  # the cost model's choice per node (`here` = the generating Mac)
        "estimates_s": got["estimates"],  # the last layers' estimated busy seconds per node, as planned
        "activation_bytes_per_token": activation / tokens,
        "expert_bytes_over_lan_per_token": got["bytes"].get("peer", 0) / tokens,
        "call_s": _median([v["call_s"] for v in got.get("links", {}).values() if v.get("call_s") is not None]),
        "wait_s_per_token": got["wait_s"] / tokens,  # layer calls waiting for expert bytes
        "other_s_per_token": (got["decode_s"] - got["wait_s"]) / tokens,  # compute here, remote calls
        "remote": remote,
        "links": got.get("links", {}),
        "warm_up": got.get("warm_up"),  # the untimed warm-up's calls, and what its links had learnt after it
        "killed": got.get("killed"),
        "join_asked": got.get("join_asked"),
        "peers_at_end": got.get("peers_at_end"),
        "join_seen_after_s": got.get("join_seen_after_s"),
        "peers_found": len(got["peers"]),
        "found_by": got["found_by"],
        "outputs": got["outputs"],
        "ttft_s": got.get("ttft_s"),  # per prompt: seconds from its request to its first token
        "prompt_tokens": got.get("prompt_tokens"),
        "prompt_stats": got.get("prompt_stats"),  # per prompt, up to its first token: uses by source, remote calls
        "nodes_uses": got.get("nodes_uses", {}),  # the household nodes' own expert uses by source, measured prompts
    }


def _projection_inputs(remote: dict, overrides: dict) -> projection.ProjectionInputs:
    """The remote run's measured per-expert costs: the peers' service time, the call's time outside
    the peer, and activation bytes per remote use."""
    links = [v for v in remote.get("links", {}).values() if v.get("service_s") is not None]
    service = statistics.median(v["service_s"] for v in links) if links else 0.0
    call = statistics.median(v["call_s"] for v in links if v.get("call_s") is not None) if links else 0.0
    uses = remote["uses"].get("remote", 0)
    act = remote["activation_bytes_per_token"] * remote["tokens"] / uses if uses else 0.0
    ping = _median([v["rtt_s"] for v in links if v.get("rtt_s") is not None]) or None
    return projection.ProjectionInputs(compute_s=service, call_s=call, activation_bytes=act, ping_s=ping, **overrides)


def _prompt_projection_inputs(
    prompts: dict[str, dict], model: Proportions, lan_bytes_per_s: float
) -> projection.PromptInputs:
    """The prompt scenarios' measured figures: LAN bytes per row computed remotely, the calls' time
    outside the peer, and this CPU's time per row through one expert (the fetched prompt's TTFT less
    what it waited for bytes). A row-use is one token's row through one of its top-k experts."""
    remote, fetched = prompts["prompt_remote"], prompts["prompt_fetch_from_owners"]
    tokens = remote["prompt_tokens"]
    row_uses = tokens * model.top_k * model.moe_layers
    stats = remote["prompt_stats"][0]
    uses = stats.get("uses", {})
    share = uses.get("remote", 0) / max(1, sum(uses.values()))
    moved = stats.get("remote", {}).get("sent_bytes", 0) + stats.get("remote", {}).get("received_bytes", 0)
    computing = sum(fetched["ttft_s"]) - fetched["prompt_stats"][0].get("wait_s", 0.0)
    return projection.PromptInputs(
        tokens=tokens,
        row_bytes=moved / (row_uses * share) if share else 0.0,
        call_s=remote["call_s"] or 0.0,
        cpu_row_s=computing / row_uses,
        lab_lan_bytes_per_s=lan_bytes_per_s,
    )


def print_table(doc: dict, out: Callable[[str], None] = print) -> None:
    out(f"network: {doc['network']}; {doc['nodes']} nodes; load average {', '.join(f'{x:.2f}' for x in doc['load'])}")
    out(
        f"{'config':<18} {'s/token':>8} {'LAN B/token':>12} {'Hub B/token':>12} {'wait s/t':>9} {'other s/t':>9} "
        f"{'= alone':>7}  where the uses ran"
    )
    for r in doc["configs"]:
        uses = ", ".join(f"{k} {v}" for k, v in r["uses"].items() if v)
        placed = ", ".join(f"{k} {v}" for k, v in sorted(r["placed"].items()))
        out(
            f"{r['name']:<18} {r['s_per_token']:>8.3f} {r['lan_bytes_per_token']:>12,.0f} "
            f"{r['hub_bytes_per_token']:>12,.0f} {r['wait_s_per_token']:>9.3f} {r['other_s_per_token']:>9.3f} "
            f"{'yes' if r['tokens_equal_alone'] else 'NO':>7}  {uses}; placed: {placed}"
        )
    for r in doc["configs"]:
        fetched = {k: sum(u.get(k, 0) for u in r.get("nodes_uses", {}).values()) for k in ("peer", "hub")}
        if any(fetched.values()):  # an owner lacked what it was asked to compute or send
            out(
                f"  {r['name']}: the nodes themselves fetched {fetched['peer']} experts from each other, {fetched['hub']} from the Hub"
            )
    c = {r["name"]: r for r in doc["configs"]}
    if "fetch_from_owners" in c and "fetch_from_owners_unchecked" in c:
        # a peer's first copy is checked in the warm-up, the first prompt of the run: its first
        # token is the one that pays
        f, u = c["fetch_from_owners"], c["fetch_from_owners_unchecked"]
        fw, uw = f.get("warm_up") or {}, u.get("warm_up") or {}
        if fw.get("ttft_s") and uw.get("ttft_s"):
            out(
                f"checking peers' first copies against the Hub: the run's first token after {fw['ttft_s']:.2f} s "
                f"against {uw['ttft_s']:.2f} s unchecked ({fw['ttft_s'] / uw['ttft_s']:.2f}x), "
                f"{format_size(fw.get('audit_bytes', 0) + f['audit_bytes'])} from the Hub for the checks; "
                f"then {f['s_per_token'] / max(1e-9, u['s_per_token']):.2f}x the s/token"
            )
    if "remote" in c and "fetch_from_owners" in c:
        f, r = c["fetch_from_owners"], c["remote"]
        out(
            f"remote is {f['s_per_token'] / r['s_per_token']:.1f}x faster than fetch_from_owners (target >= 10x); "
            f"LAN bytes per token {f['lan_bytes_per_token'] / max(1.0, r['lan_bytes_per_token']):.0f}x fewer "
            "(target >= 200x)"
        )
        # the CPU's compute stands in for Metal's and dominates here: the same runs with compute taken out
        f_net = f["wait_s_per_token"]
        r_net = r["wait_s_per_token"] + r["remote"].get("calls", 0) / max(1, r["tokens"]) * r["call_s"]
        out(
            f"with compute taken out (fetch: seconds waiting for expert bytes; remote: waiting + calls x their "
            f"measured time outside the peer): {f_net:.3f} vs {r_net:.3f} s/token, {f_net / max(r_net, 1e-9):.0f}x"
        )
    if "prompt_remote" in c and "prompt_fetch_from_owners" in c:
        f, r = c["prompt_fetch_from_owners"], c["prompt_remote"]
        ft, rt = sum(f["ttft_s"]), sum(r["ttft_s"])
        out(
            f"a prompt of {r['prompt_tokens']} tokens: first token after {rt:.2f} s with the experts computed where "
            f"they are, {ft:.2f} s fetched from their owners: {ft / max(rt, 1e-9):.1f}x sooner (target >= 5x); "
            f"tokens equal: {r['tokens_equal_alone']}; the prompt's uses {f['prompt_stats'][0].get('uses')} fetched, "
            f"{r['prompt_stats'][0].get('uses')} computed where they are, in "
            f"{r['prompt_stats'][0].get('remote', {}).get('calls', 0)} remote calls"
        )
    if "remote_node_dies" in c:
        d = c["remote_node_dies"]
        falls = {k: v for k, v in d["remote"].items() if k.startswith("fallback_") and v}
        out(
            f"remote_node_dies: killed {d['killed']}; tokens equal alone: {d['tokens_equal_alone']}; "
            f"experts recomputed here: {falls or 'none'}"
        )
    if "remote_node_joins" in c:
        j = c["remote_node_joins"]
        out(
            f"remote_node_joins: node started after token {(j['join_asked'] or {}).get('after_token')} with "
            f"{(j['join_asked'] or {}).get('peers')} peers known, {j['peers_at_end']} at the end (seen "
            f"{j['join_seen_after_s']} s after the first prompt); tokens equal "
            f"alone: {j['tokens_equal_alone']}; placed: {j['placed']}"
        )
    if doc.get("projection"):
        out(projection.format_projection(doc["projection"]))
    if doc.get("prompt_projection"):
        out(projection.format_prompt_projection(doc["prompt_projection"]))
