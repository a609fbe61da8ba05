"""The peers tier between two real nodes on loopback: experts come from the household before the
Hub, each crosses the Hub once, the output is the single-node output, and a lying peer is caught."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest
from nodes import joined, serving
from repos import KIMI_K3
from waiting import wait_until

from expertmesh.devtools.local_hub import HubServer
from expertmesh.node.config import StoreConfig
from expertmesh.node.engine.generation import Generator, SamplingSettings
from expertmesh.node.household.membership import Peer, PeerTable, rendezvous_score
from expertmesh.node.hub import client as hub_client
from expertmesh.node.hub.pull import pull
from expertmesh.node.service import NodeService
from expertmesh.node.store import peer_audit
from expertmesh.v1 import node_pb2

SECRET = "peers-test-secret"
PROMPT = "Ask the household first"


@pytest.fixture(scope="module")
def expected(oracle) -> list[int]:
    return oracle.tokens("kimi_k3", PROMPT, 16)


def _node(home: Path, servicer_class=None, node_id: str = "owner"):
    pull(KIMI_K3, home=home, progress=False)
    return serving(KIMI_K3, home, SECRET, node_id=node_id, service_class=servicer_class)


def _client(home: Path, address: str, store: StoreConfig | None = None):
    """A node with no disk budget: it owns nothing, so every expert it lacks comes from peers."""
    pull(KIMI_K3, home=home, progress=False)
    return joined(
        KIMI_K3, home, SECRET, [address], node_id="client", store=store or StoreConfig(prefetch=False, disk_budget="0")
    )


def _generate(node) -> list[int]:
    sm = node.model
    return [t.id for t in Generator(sm).generate(sm.tokenizer.encode(PROMPT), SamplingSettings(max_tokens=16))]


def test_experts_come_from_the_owner_and_cross_the_hub_once(hub: HubServer, expected, tmp_path: Path) -> None:
    owner = _node(tmp_path / "owner")
    client = _client(tmp_path / "client", owner.rpc.address)
    try:
        before = hub.stats()["bytes_served"]
        assert _generate(client) == expected
        stats = client.store.stats
        assert stats.uses["peer"] > 0 and stats.uses["hub"] == 0
        distinct = {(lay, e) for lay, e in client.index.experts if (lay, e) in owner.disk}
        served = hub.stats()["bytes_served"] - before
        # the owner fetched each once; the client checked the owner's first copy against one more
        assert stats.audits["confirmed"] == 1 and stats.audit_bytes > 0
        assert served == sum(owner.index.expert(*k).nbytes for k in distinct) + stats.audit_bytes
        assert _generate(client) == expected  # again: the owner now serves from its disk
        assert hub.stats()["bytes_served"] - before == served
        # its memory plan holds what it keeps for its peers (none asked to compute: checks only)
        expert = max(loc.nbytes for loc in client.index.experts.values())
        assert client.memory.household_bytes == 3 * 2 * expert + 2 * expert
    finally:
        client.close()
        owner.close()


class _LyingNode(NodeService):
    """Flips the bytes it serves but claims the digest of the real ones."""

    def FetchExpert(self, request, context):
        for chunk in super().FetchExpert(request, context):
            if chunk.HasField("progress"):  # an owner's word on its fetch, before any bytes
                yield chunk
                continue
            yield node_pb2.ExpertChunk(size=chunk.size, sha256=chunk.sha256, data=bytes(b ^ 0xFF for b in chunk.data))


def test_a_lying_peer_is_caught_skipped_and_counted(hub: HubServer, expected, tmp_path: Path) -> None:
    liar = _node(tmp_path / "liar", _LyingNode, node_id="liar")
    client = _client(tmp_path / "client", liar.rpc.address)
    try:
        assert _generate(client) == expected  # every bad copy was refused; the Hub filled in
        assert client.peers.errors["bad_digest"] >= 1
        assert client.store.stats.uses["hub"] > 0
    finally:
        client.close()
        liar.close()


class _WrongCopies(NodeService):
    """Serves wrong bytes with their own sha256, as a member whose first Hub fetch was damaged
    would: nothing on the wire tells them from good ones. `honest_first`: that many good copies
    before the wrong ones."""

    honest_first = 0

    def FetchExpert(self, request, context):
        chunks = [c for c in super().FetchExpert(request, context) if not c.HasField("progress")]
        if self.honest_first > 0:
            self.honest_first -= 1
            yield from chunks
            return
        data = bytes(b ^ 0x01 for c in chunks for b in c.data)  # the low bit: finite, plausible, wrong
        digest = hashlib.sha256(data).hexdigest()
        at = 0
        for c in chunks:
            yield node_pb2.ExpertChunk(size=c.size, sha256=digest, data=data[at : at + len(c.data)])
            at += len(c.data)


def test_a_peer_whose_copies_are_all_wrong_is_caught_by_its_first_before_any_token_uses_it(
    hub: HubServer, expected, tmp_path: Path
) -> None:
    wrong = _node(tmp_path / "wrong", _WrongCopies, node_id="wrong")
    client = _client(tmp_path / "client", wrong.rpc.address)
    try:
        before = hub.stats()["bytes_served"]
        assert _generate(client) == expected  # its first copy was checked against the Hub, and failed
        stats = client.store.stats
        assert stats.audits["wrong"] == 1 and stats.uses["peer"] == 0
        peer = client.peers.get("wrong")
        assert not peer.live and client.peer_tier.skip_reason(peer) == "lied" and client.peers.errors["lied"] == 1
        assert client.store.digests.vouched() == {} and client.peers.errors["bad_digest"] == 0
        used = {(lay, e) for lay, e in client.index.experts if client.store.digests.get((lay, e)) is not None}
        # each expert the client used once from the Hub, and the two Hub copies that judged the peer
        assert stats.audit_bytes == 2 * max(client.index.expert(*k).nbytes for k in used)
        assert hub.stats()["bytes_served"] - before >= sum(client.index.expert(*k).nbytes for k in used)
    finally:
        client.close()
        wrong.close()


def test_a_hub_that_is_down_does_not_hold_the_households_tokens_for_the_check(
    hub_root: Path, pulled_home, tmp_path: Path
) -> None:
    """The owner holds what the prompt needs and the Hub is gone: the check of the owner's first
    copy cannot be made, so after a few seconds the copies are used as before the check existed,
    the tokens equal the owner's own, and the check ends as `failed` later, the owner trusted."""
    with HubServer(hub_root) as server, hub_client.using_endpoint(server.url):
        owner = _node(tmp_path / "owner")  # its own Hub, stopped below
        reference = _generate(owner)  # the owner keeps every expert the prompt uses
        owner.disk.flush()
    client = None
    try:
        with hub_client.using_endpoint(server.url):  # the address of a Hub that is no longer there
            home = pulled_home("kimi_k3", tmp_path / "client")  # pulled before: nothing to ask the Hub
            store = StoreConfig(prefetch=False, disk_budget="0")
            client = joined(KIMI_K3, home, SECRET, [owner.rpc.address], node_id="client", store=store)
            origin, gone, held_out = client.store.chain.origin, threading.Event(), threading.Event()
            fetch = origin.fetch

            def after_the_tokens(loc, ctx):  # the dead Hub's answer, held until the tokens are out
                if not gone.wait(60):
                    held_out.set()  # the tokens waited for the check
                return fetch(loc, ctx)

            origin.fetch = after_the_tokens
            assert _generate(client) == reference
            assert not held_out.is_set()  # made while the check had no answer
            stats = client.store.stats
            assert stats.uses["peer"] > 0 and stats.uses["hub"] == 0
            gone.set()
            assert wait_until(lambda: stats.audits["failed"] == 1, timeout_s=120, interval_s=0.2)
            assert client.peers.get("owner").live and client.peers.errors["lied"] == 0
    finally:
        if client is not None:
            client.close()
        owner.close()


def _sampled_client(home: Path, address: str):
    """A client whose audit samples every record (one in 1, not one in 256) and whose RAM holds one
    expert, so every layer asks the store and a generation keeps the audit's thread going."""
    return _client(home, address, StoreConfig(prefetch=False, disk_budget="0", ram_budget="1"))


def test_the_audit_confirms_an_honest_peers_copies_on_the_idle_link(
    hub: HubServer, expected, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(peer_audit, "AUDIT_EVERY", 1)
    owner = _node(tmp_path / "owner")
    client = _sampled_client(tmp_path / "client", owner.rpc.address)
    try:
        stats = client.store.stats
        for _ in range(10):  # bounded: each generation gives the thread idle moments between layers
            assert _generate(client) == expected
            if stats.audits["confirmed"] >= 3:  # the first copy's check, and two of the sample
                break
        assert stats.audits["confirmed"] >= 3 and stats.audits["wrong"] == 0
        assert sum(client.store.digests.verified(k) for k in client.index.experts) >= 3
        assert client.peers.get("owner").live and client.peers.errors["lied"] == 0
    finally:
        client.close()
        owner.close()


def test_a_peer_wrong_only_after_its_first_copies_is_caught_by_the_sample(
    hub: HubServer, expected, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(peer_audit, "AUDIT_EVERY", 1)
    monkeypatch.setattr(_WrongCopies, "honest_first", 3)
    wrong = _node(tmp_path / "wrong", _WrongCopies, node_id="wrong")
    client = _sampled_client(tmp_path / "client", wrong.rpc.address)
    try:
        for _ in range(10):  # bounded, as above
            _generate(client)
            if client.peers.errors["lied"]:
                break
        # the sample, or a Hub copy fetched after one of its copies contradicted an honest record
        assert client.peers.errors["lied"] == 1
        assert client.store.digests.vouched() == {}  # all it vouched for forgotten
        assert not any(k in client.store.ram for k in client.index.experts if client.store.digests.get(k) is None)
        assert _generate(client) == expected  # from the Hub since
    finally:
        client.close()
        wrong.close()


def test_ownership_follows_disk_budgets_and_moves_little() -> None:
    table = PeerTable(self_id="a", self_weight=100.0)
    table.add(Peer("b", "x:1", 100.0))
    table.add(Peer("c", "x:2", 200.0))
    keys = [f"repo@sha/{layer}/{e}" for layer in range(4) for e in range(500)]
    owners = {k: (table.ranked(k)[0].node_id if table.ranked(k)[0] else "a") for k in keys}
    share_c = sum(o == "c" for o in owners.values()) / len(keys)
    assert 0.45 < share_c < 0.55  # half the disk, half the experts
    table.add(Peer("d", "x:3", 100.0))
    moved = sum((table.ranked(k)[0].node_id if table.ranked(k)[0] else "a") != owners[k] for k in keys)
    assert moved / len(keys) < 0.3  # only what the newcomer takes (1/5) moves
    assert rendezvous_score("k", "n", 0.0) == float("-inf")  # no disk, no ownership


@pytest.mark.e2e
def test_run_with_a_peer_takes_its_experts_from_it(pulled_home, hub: HubServer, oracle, tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    owner = _node(tmp_path / "owner")
    try:
        pulled_home("kimi_k3", tmp_path / "client")
        env = {
            **os.environ,
            "EXPERTMESH_HOME": str(tmp_path / "client"),
            "EXPERTMESH_SECRET": SECRET,
            "HF_ENDPOINT": hub.url,
        }
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "expertmesh",
                "run",
                KIMI_K3,
                PROMPT,
                "--max-tokens",
                "16",
                "--disk-budget",
                "0",
                "--no-prefetch",
                "--peer",
                owner.rpc.address,
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout == oracle.text("kimi_k3", PROMPT, 16) + "\n"  # the single-node text
        line = next(ln for ln in r.stderr.splitlines() if "expert uses by source" in ln)
        assert " peer " in line and "hub 0 " in line
        bad = subprocess.run(
            [sys.executable, "-m", "expertmesh", "run", KIMI_K3, PROMPT, "--peer", owner.rpc.address],
            env={**env, "EXPERTMESH_SECRET": "wrong"},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert bad.returncode != 0 and "secret" in bad.stderr and SECRET not in bad.stderr
    finally:
        owner.close()


@pytest.mark.e2e
def test_a_cache_peer_killed_mid_generation_changes_the_sources_only(
    pulled_home, hub: HubServer, expected, tmp_path: Path
) -> None:
    """kill -9 of the peer that serves every expert: the generation goes on from the Hub, same tokens."""
    import os
    import re
    import subprocess
    import sys
    import time

    peer_home = tmp_path / "peer"
    pulled_home("kimi_k3", peer_home, index_only=True)
    env = {**os.environ, "EXPERTMESH_HOME": str(peer_home), "EXPERTMESH_SECRET": SECRET, "HF_ENDPOINT": hub.url}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "expertmesh",
            "serve",
            "--cache-only",
            KIMI_K3,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--no-discovery",
            "--no-metrics",
            "--no-http",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        port, deadline = None, time.monotonic() + 120
        while port is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "the cache peer exited before serving"
            m = re.search(r"on 127\.0\.0\.1:(\d+)", line)
            port = int(m.group(1)) if m else None
        assert port is not None, "the cache peer did not start in 120 s"
        pulled_home("kimi_k3", tmp_path / "client")
        # no disk and a 1-byte RAM tier: every use is a fetch, so the sources after the kill show
        client = _client(
            tmp_path / "client", f"127.0.0.1:{port}", StoreConfig(prefetch=False, disk_budget="0", ram_budget="1")
        )
        try:
            sm = client.model
            gen = Generator(sm).generate(sm.tokenizer.encode(PROMPT), SamplingSettings(max_tokens=16))
            tokens = [next(gen).id for _ in range(4)]
            at_kill = client.store.stats.snapshot()
            assert at_kill.uses["peer"] > 0 and at_kill.uses["hub"] == 0
            proc.kill()
            proc.wait(timeout=30)
            tokens += [t.id for t in gen]
            assert tokens == expected  # the single-node output
            after = client.store.stats.since(at_kill)
            assert after.uses["hub"] > 0 and after.uses["peer"] == 0
            assert sum(client.peers.errors.values()) >= 1  # the dead peer was counted and skipped
        finally:
            client.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def test_peers_follow_grpc_health(hub: HubServer, tmp_path: Path) -> None:
    """A peer whose health service says NOT_SERVING (or that stops answering) is skipped; one that
    is SERVING again is used at once, not after its skip runs out."""
    from grpc_health.v1 import health_pb2

    owner = _node(tmp_path / "owner")
    client = _client(tmp_path / "client", owner.rpc.address)
    try:
        source = client.peer_tier
        (peer,) = client.peers.all()
        source.check_health()
        assert peer.live
        owner.rpc.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        source.check_health()
        assert not peer.live and client.peers.errors["not_serving"] == 1
        owner.rpc.health.set("", health_pb2.HealthCheckResponse.SERVING)
        source.check_health()
        assert peer.live
        owner.rpc.stop(0)
        source.check_health()
        assert not peer.live and client.peers.errors["health_unavailable"] == 1
    finally:
        client.close()
        owner.close()


def test_an_owner_slow_to_fetch_from_the_hub_is_waited_for_not_fetched_around(hub: HubServer, tmp_path: Path) -> None:
    """On a slow household link the owner's Hub fetch outlasts the time a peer's expert takes over
    the LAN: the asking node waits for it rather than fetch the expert from the Hub as well while
    the owner goes on fetching, which would send it over the one internet link twice."""
    owner = _node(tmp_path / "owner")
    client = _client(tmp_path / "client", owner.rpc.address)
    keys = sorted(client.index.experts)[:2]
    distinct = sum(client.index.expert(*k).nbytes for k in keys)
    client.peer_tier.deadline_s = 0.2  # what an expert may take over the LAN, scaled down
    hub.knobs.bandwidth_bytes_per_s = distinct  # the owner's fetch of one takes longer: 0.5 s at least
    try:
        with hub.stats_.lock:
            hub.stats_.reset()
        results = [client.store.chain.fetch(k, keep_now=True, decode=False) for k in keys]
        assert all(r.source == "peer" for r in results), results
        assert "deadline_exceeded" not in client.peers.errors  # the owner was not taken for a failing one
        stats = client.store.stats
        assert stats.uses["hub"] == 0
        assert hub.stats()["bytes_served"] == distinct + stats.audit_bytes  # each expert crossed once
    finally:
        hub.knobs.bandwidth_bytes_per_s = 0
        client.close()
        owner.close()
