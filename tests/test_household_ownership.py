"""The household's invariant (issue 21): while the household's disks hold the model, the Hub serves
each expert at most once, whatever generations run.

Three real `serve` processes found by zeroconf on loopback — a full node with a small disk, a full
node with a large one, and a cache peer — behind one local Hub. `expertmesh warm` puts every expert
on its owner; then several chat completions through the small node's OpenAI-compatible API use
experts the other nodes own. Its disk must not let those copies push out the experts it owns (else
its next use of one of its own goes to the Hub again), so the Hub's per-range counts show every
expert byte sent once in all: by the warm, and never again."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from lazy_import import lazy_import
from nodes import serve_command
from prometheus_client.parser import text_string_to_metric_families
from repos import KIMI_K3
from waiting import wait_until

from expertmesh.devtools.local_hub import HubServer
from expertmesh.node.hub.local_models import find_index
from expertmesh.node.model.expert_index import ExpertIndex
from expertmesh.node.rpc.auth import call_metadata, node_method
from expertmesh.v1 import node_pb2, node_pb2_grpc

openai = lazy_import("openai")  # on first use, not at collection (tests/lazy_import.py)

SECRET = "ownership-secret"
# unique to this run: another run on this machine shares the loopback multicast
CLUSTER = f"ownership-{os.getpid()}"
START_S = 90.0  # a `serve` imports MLX and loads the core: generous on a loaded 2-core machine
PROMPTS = [
    "What does a household keep?",
    "Name three colours of the sea.",
    "Count from one to ten, slowly.",
    "Why do caches evict?",
    "Write a short line about experts on a shelf.",
]


class Served:
    """A `serve` subprocess, its output in files (no pipe to fill), its addresses parsed from them."""

    def __init__(self, name: str, home: Path, hub: HubServer, logs: Path, *extra: str):
        self.extra = extra
        self.name = name
        self.out, self.err = logs / f"{name}.out", logs / f"{name}.err"
        env = {**os.environ, "EXPERTMESH_HOME": str(home), "EXPERTMESH_SECRET": SECRET, "HF_ENDPOINT": hub.url}
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                serve_command(KIMI_K3, CLUSTER, *extra),
                env=env,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
            )
        self.port = 0
        self.api_url = ""
        self.metrics_url = ""

    def wait_started(self) -> None:
        # serve prints its API's address after "advertising": a node with an API is started once
        # both are out, or the address may be read before it is printed
        wanted = ["advertising"] + (["OpenAI-compatible API on"] if "--http-port" in self.extra else [])

        def advertising() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.proc.returncode}: {self.err.read_text()[-3000:]}")
            out = self.out.read_text()
            return all(w in out for w in wanted)

        assert wait_until(advertising, timeout_s=START_S, interval_s=0.2), f"{self.name} did not start"
        out, err = self.out.read_text(), self.err.read_text()
        self.port = int(re.search(r"on 127\.0\.0\.1:(\d+)", out).group(1))
        if m := re.search(r"OpenAI-compatible API on (\S+)", out):
            self.api_url = m.group(1)
        if m := re.search(r"metrics on (\S+)", err):
            self.metrics_url = m.group(1)

    def live_peers(self) -> int:
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            info = node_pb2_grpc.NodeStub(channel).Info(
                node_pb2.InfoRequest(), metadata=call_metadata(SECRET, node_method("Info")), timeout=10
            )
        return info.live_peers

    def _counters(self, name: str) -> dict[str, float]:
        """label value -> count of the counter family `name`, from the node's /metrics."""
        url = self.metrics_url.rstrip("/")
        url = url if url.endswith("/metrics") else url + "/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            if family.name == name:
                for s in family.samples:
                    if s.name.endswith("_total"):
                        out[next(iter(s.labels.values()), "")] = s.value
        return out

    def expert_uses(self) -> dict[str, float]:
        """source -> expert uses."""
        return self._counters("expertmesh_expert_requests")

    def audit_bytes(self) -> float:
        """What the node's audits of peers' copies fetched from the Hub."""
        return self._counters("expertmesh_peer_audit_bytes").get("", 0.0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def _sent(stats: dict, index: ExpertIndex) -> dict[tuple[int, int], tuple[int, int]]:
    """(layer, expert) -> (fewest, most) times the Hub sent one of its bytes, from the per-range
    counts (a coalesced request covers several experts, pieces may split one)."""
    ranges = {name: entry["ranges"] for name, entry in stats["files"].items()}
    out = {}
    for key, loc in index.experts.items():
        fewest, most = None, 0
        for t in loc.tensors:
            events = []
            for a, b, n in ranges.get(f"{index.repo_id}/{t.file}", []):
                lo, hi = max(a, t.start), min(b + 1, t.end)  # a range [a, b] is inclusive
                if lo < hi:
                    events += [(lo, n), (hi, -n)]
            level, at = 0, t.start
            for pos, delta in sorted(events):
                if pos > at:  # [at, pos) was sent `level` times
                    fewest = level if fewest is None else min(fewest, level)
                    most = max(most, level)
                    at = pos
                level += delta
            if at < t.end:  # the tail no range reached
                fewest = 0
        out[key] = (fewest or 0, most)
    return out


@pytest.mark.e2e
def test_the_hub_serves_each_expert_at_most_once_whatever_the_small_disk_node_generates(
    hub: HubServer, pulled_home, tmp_path: Path
) -> None:
    for name in ("cache", "cli"):
        pulled_home("kimi_k3", tmp_path / name, index_only=True)
    index = ExpertIndex.load(find_index(tmp_path / "cli", KIMI_K3, None) / "expert_index.json")
    model_bytes = sum(loc.nbytes for loc in index.experts.values())
    logs = tmp_path / "logs"
    logs.mkdir()
    # the small node can hold about a third of the model; by disk-weighted rendezvous it owns about
    # a seventh, so its own experts fit and the rest of its disk is room that peers' copies compete for
    small_budget, large_budget = int(model_bytes * 0.35), int(model_bytes * 1.05)
    nodes: list[Served] = []
    try:
        small = Served(
            "small",
            pulled_home("kimi_k3", tmp_path / "small"),
            hub,
            logs,
            "--disk-budget",
            str(small_budget),
            "--remote-compute",
            "off",  # it fetches every expert it uses: the most its disk can be asked to take
            "--http-port",
            "0",
        )
        nodes.append(small)
        large_home = pulled_home("kimi_k3", tmp_path / "large")
        nodes.append(Served("large", large_home, hub, logs, "--disk-budget", str(large_budget), "--no-http"))
        cache_flags = ("--cache-only", "--disk-budget", str(large_budget), "--no-http")
        nodes.append(Served("cache", tmp_path / "cache", hub, logs, *cache_flags))
        for node in nodes:
            node.wait_started()
        for node in nodes:  # every node must see the whole household, or they disagree on owners
            assert wait_until(lambda node=node: node.live_peers() >= 2, timeout_s=60, interval_s=0.2), (
                f"{node.name} did not find the other nodes"
            )
        with hub.stats_.lock:
            hub.stats_.reset()  # count the household's requests only, from the warm on

        env = {**os.environ, "EXPERTMESH_HOME": str(tmp_path / "cli"), "EXPERTMESH_SECRET": SECRET}
        warmed = subprocess.run(
            [sys.executable, "-m", "expertmesh", "warm", KIMI_K3, "--cluster", CLUSTER, "--interface", "127.0.0.1"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert warmed.returncode == 0, warmed.stdout + warmed.stderr
        lines = [ln for ln in warmed.stdout.splitlines() if "owns" in ln]
        assert len(lines) == 3 and all(ln.endswith("done") and " left       0" in ln for ln in lines), warmed.stdout
        small_line = next(ln for ln in lines if f":{small.port} " in ln)
        assert int(re.search(r"owns\s+(\d+)", small_line).group(1)) > 0, warmed.stdout  # it owns some
        after_warm = hub.stats()
        # the warm put every expert in the household, each crossing the Hub once
        once = _sent(after_warm, index)
        assert all(n == (1, 1) for n in once.values()), {k: n for k, n in once.items() if n != (1, 1)}
        assert after_warm["bytes_served"] == model_bytes, after_warm["bytes_served"]

        before = small.expert_uses()  # the warm's keeps count as its Hub uses: compare from here
        client = openai.OpenAI(base_url=small.api_url, api_key="unused", max_retries=0, timeout=120)
        for prompt in PROMPTS:
            reply = client.chat.completions.create(
                model=KIMI_K3,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=16,
                temperature=0,
            )
            assert reply.choices[0].finish_reason in ("length", "stop")
            assert reply.usage.completion_tokens > 0

        stats = hub.stats()
        # beyond the one copy of each expert, only the small node's audits of its peers' copies
        # (store/peer_audit.py: a few experts, each fetched once more, twice if it disagreed)
        more = {k: most for k, (_, most) in sorted(_sent(stats, index).items()) if most > 1}
        audited = small.audit_bytes()
        assert sum((n - 1) * index.expert(*k).nbytes for k, n in more.items()) == audited, (
            f"experts the Hub sent more than once (layer, expert) -> times: {more}; "
            f"bytes {stats['bytes_served']} for a model of {model_bytes}, {audited} of them the audits'"
        )
        assert stats["bytes_served"] == model_bytes + audited and audited < model_bytes / 10
        uses = small.expert_uses()
        # the test could fail: the small node used experts others own, fetched from its peers, and
        # its own from its disk, never from the Hub
        assert uses.get("peer", 0) - before.get("peer", 0) > 0, (before, uses)
        assert uses.get("hub", 0) == before.get("hub", 0), (before, uses)
    finally:
        for node in nodes:
            node.stop()
