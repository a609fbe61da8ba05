"""Zeroconf on loopback: nodes of one cluster find each other by advertisement alone, leave when
they stop, ignore other clusters, report a duplicate id — and a generation takes experts from a
node found that way."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from nodes import serve_command
from waiting import wait_until
from zeroconf import ServiceInfo, Zeroconf

from expertmesh.node.devtools.local_hub import HubServer
from expertmesh.node.household.discovery import Advertisement, Discovery
from expertmesh.node.household.membership import PeerTable
from expertmesh.node.hub.expert_index import ExpertIndex
from expertmesh.node.hub.local_models import find_pulled
from expertmesh.node.hub.pull import pull
from expertmesh.node.rpc.auth import call_metadata
from expertmesh.v1 import node_pb2, node_pb2_grpc

LOOPBACK = ["127.0.0.1"]
# cluster names unique to this test run: two runs on one machine (a CI clone beside a checkout)
# must not see each other's nodes on the shared loopback multicast
RUN = f"{os.getpid()}"
CLUSTER, E2E_CLUSTER = f"test-cluster-{RUN}", f"zc-e2e-{RUN}"


def _discovery(node_id: str, cluster: str = CLUSTER, port: int = 1000, compute: bool = True) -> Discovery:
    table = PeerTable(self_id=node_id, self_weight=1.0)
    return Discovery(
        table, Advertisement(node_id, cluster, "full", port, 10**9, compute=compute), "127.0.0.1", LOOPBACK
    )


def test_nodes_of_a_cluster_find_each_other_and_notice_leaving() -> None:
    a, b = _discovery("node-a"), _discovery("node-b", port=1001, compute=False)
    other = _discovery("node-x", f"elsewhere-{RUN}", 1002)
    try:
        assert wait_until(lambda: "node-b" in a.table.peers and "node-a" in b.table.peers)
        assert a.table.peers["node-b"].address == "127.0.0.1:1001" and a.table.peers["node-b"].weight == 10**9
        # whether a node computes experts for others travels in the advertisement
        assert b.table.peers["node-a"].compute and not a.table.peers["node-b"].compute
        time.sleep(1.0)  # time enough for the other cluster's advertisement to arrive too
        assert "node-x" not in a.table.peers and "node-a" not in other.table.peers
        b.close()
        assert wait_until(lambda: "node-b" not in a.table.peers)
    finally:
        for d in (a, other):
            d.close()


def test_a_duplicate_node_id_is_reported_not_joined() -> None:
    a = _discovery("same-id")
    try:  # a second advertiser of the same id under another name, as a copied home folder makes
        zc = Zeroconf(interfaces=LOOPBACK)
        info = ServiceInfo(
            "_expertmesh._tcp.local.",
            "copied-home._expertmesh._tcp.local.",
            port=2000,
            addresses=[socket.inet_aton("127.0.0.1")],
            properties=Advertisement("same-id", CLUSTER, "full", 2000, 1).properties(),
            server="copied.local.",
        )
        zc.register_service(info)
        try:
            assert wait_until(lambda: a.duplicates > 0)
            assert "same-id" not in a.table.peers
        finally:
            zc.unregister_service(info)
            zc.close()
    finally:
        a.close()


def _serve(home: Path, hub: HubServer, *extra: str) -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "EXPERTMESH_HOME": str(home), "EXPERTMESH_SECRET": "zc-secret", "HF_ENDPOINT": hub.url}
    proc = subprocess.Popen(
        serve_command("expertmesh/tiny-kimi_k3", E2E_CLUSTER, "--no-prefetch", "--http-port", "0", *extra),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    out = ""
    while "advertising" not in out and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(proc.stderr.read())
        out += line
    return proc, int(re.search(r"on 127\.0\.0\.1:(\d+)", out).group(1))


def _wait_for_peers(port: int, n: int) -> None:
    """Until the node on `port` knows `n` live peers (advertisements cross in their own time)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = node_pb2_grpc.NodeStub(channel)
        assert wait_until(
            lambda: stub.Info(node_pb2.InfoRequest(), metadata=call_metadata("zc-secret"), timeout=10).live_peers >= n,
            timeout_s=60,
        ), "the nodes did not find each other"


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every node, then each must exit cleanly (and is killed regardless)."""
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            assert proc.wait(timeout=60) == 0
        finally:
            proc.kill()
            proc.stdout.close()
            proc.stderr.close()


@pytest.mark.e2e
def test_a_node_found_by_zeroconf_serves_experts_to_another(hub: HubServer, oracle, tmp_path: Path) -> None:
    for name in ("owner", "client"):
        pull("expertmesh/tiny-kimi_k3", home=tmp_path / name, progress=False)
    owner, _ = _serve(tmp_path / "owner", hub)
    client, port = _serve(tmp_path / "client", hub, "--disk-budget", "0")  # owns nothing: peers first
    try:
        _wait_for_peers(port, 1)
        prompt = "Found by zeroconf"
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            events = list(
                node_pb2_grpc.NodeStub(channel).Generate(
                    node_pb2.GenerateRequest(
                        model=node_pb2.ModelKey(repo_id="expertmesh/tiny-kimi_k3"), prompt=prompt, max_tokens=12
                    ),
                    metadata=call_metadata("zc-secret"),
                    timeout=120,
                )
            )
        tokens = [e.token.id for e in events if e.HasField("token")]
        assert tokens == oracle.tokens("kimi_k3", prompt, 12)
        done = events[-1].done
        assert done.expert_uses["peer"] > 0 and done.expert_uses["hub"] == 0
    finally:
        _stop([client, owner])


@pytest.mark.e2e
def test_a_full_node_and_two_cache_peers_fetch_each_expert_once(hub: HubServer, oracle, tmp_path: Path) -> None:
    """The issue's household: cache peers found by zeroconf alone own the experts between them."""
    repo_id = "expertmesh/tiny-kimi_k3"
    pull(repo_id, home=tmp_path / "full", progress=False)
    for name in ("cache-a", "cache-b"):
        pull(repo_id, home=tmp_path / name, progress=False, index_only=True)
    peers = [_serve(tmp_path / name, hub, "--cache-only", "--disk-budget", "100MB") for name in ("cache-a", "cache-b")]
    full, port = _serve(tmp_path / "full", hub, "--disk-budget", "0")
    procs = [full] + [p for p, _ in peers]
    try:
        _wait_for_peers(port, 2)
        with hub.stats_.lock:
            hub.stats_.reset()  # count only this household's requests
        prompt = "A household of three"
        md = call_metadata("zc-secret")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = node_pb2_grpc.NodeStub(channel)
            events = list(
                stub.Generate(
                    node_pb2.GenerateRequest(model=node_pb2.ModelKey(repo_id=repo_id), prompt=prompt, max_tokens=12),
                    metadata=md,
                    timeout=120,
                )
            )
        tokens = [e.token.id for e in events if e.HasField("token")]
        assert tokens == oracle.tokens("kimi_k3", prompt, 12)
        assert events[-1].done.expert_uses["peer"] > 0 and events[-1].done.expert_uses["hub"] == 0
        assert events[-1].done.expert_uses["remote"] == 0  # cache peers only serve bytes
        held = 0
        for _, peer_port in peers:  # what the two owners keep, between them
            with grpc.insecure_channel(f"127.0.0.1:{peer_port}") as channel:
                stub = node_pb2_grpc.NodeStub(channel)
                info = stub.Info(node_pb2.InfoRequest(), metadata=md, timeout=10)
                assert info.role == "cache" and info.mlx_version == "" and not info.compute
                inventory = stub.GetInventory(node_pb2.InventoryRequest(model=info.models[0]), metadata=md, timeout=10)
                held += sum(bin(b).count("1") for layer in inventory.layers for b in layer.bits)
                with pytest.raises(grpc.RpcError) as e:
                    list(
                        stub.Generate(
                            node_pb2.GenerateRequest(model=info.models[0], prompt="x"), metadata=md, timeout=10
                        )
                    )
                assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        index = ExpertIndex.load(find_pulled(tmp_path / "full", repo_id) / "expert_index.json")
        expert_bytes = next(iter(index.experts.values())).nbytes  # one size for all: the tiny K3's experts
        env = {**os.environ, "EXPERTMESH_SECRET": "zc-secret", "EXPERTMESH_HOME": str(tmp_path / "cli")}
        listing = subprocess.run(
            [
                sys.executable,
                "-m",
                "expertmesh",
                "peers",
                "--interface",
                "127.0.0.1",
                "--cluster",
                E2E_CLUSTER,
                "--wait",
                "4",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert listing.returncode == 0, listing.stderr
        roles = sorted(ln.split()[2] for ln in listing.stdout.splitlines()[1:])
        assert roles == ["cache", "cache", "full"], listing.stdout  # `expertmesh peers` sees the whole household
        expert_ranges = {
            (f, a, b): n
            for f, entry in hub.stats()["files"].items()
            for a, b, n in entry["ranges"]
            if b - a + 1 == expert_bytes
        }
        assert held > 0 and len(expert_ranges) >= held
        assert all(n == 1 for n in expert_ranges.values()), expert_ranges  # each expert crossed the Hub once
    finally:
        _stop(procs)
