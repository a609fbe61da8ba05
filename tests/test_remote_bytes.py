"""LAN bytes of remote execution are reported apart from expert bytes: a requester that holds no
experts runs some on a compute peer (real nodes on loopback, a LAN with K3's proportions so the
cost model sends work there), and its summary and `/metrics` keep activations and experts in
separate columns, each equal to what its own counters say."""

from __future__ import annotations

import pytest
from nodes import serving
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from repos import KIMI_K3

from expertmesh.assembly import build_node
from expertmesh.devtools.link_emulation import LanEmulation, LanInterceptor, k3_lan
from expertmesh.devtools.local_hub import HubServer
from expertmesh.node.config import HouseholdConfig, MetricsConfig, NodeConfig, RemoteConfig, StoreConfig
from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings
from expertmesh.node.sizes import format_size
from expertmesh.node.store.stats import SOURCES

SECRET = "remote-bytes-test-secret"
PROMPT = "Move activations, not experts"
TIME_SCALE = 0.05  # as tests/test_remote_experts.py: a K3 expert's 148 ms on gigabit becomes 7.4 ms


def _generate(node, summary: GenerationSummary | None = None) -> None:
    sm = node.model
    list(Generator(sm).generate(sm.tokenizer.encode(PROMPT), SamplingSettings(max_tokens=10), summary=summary))


@pytest.fixture(scope="module")
def requester(pulled_home, hub: HubServer, tmp_path_factory: pytest.TempPathFactory):
    """A requester with /metrics and no expert of its own, and a compute peer that holds them."""
    root = tmp_path_factory.mktemp("remote-bytes")
    pulled_home("kimi_k3", root / "peer")
    lan = LanInterceptor(LanEmulation(bandwidth=0.0, rtt_s=0.0))
    peer = serving(KIMI_K3, root / "peer", SECRET, node_id="bytes-peer", interceptors=[lan])
    try:
        _generate(peer)  # fills the peer's disk with what PROMPT routes to
        loc = next(iter(peer.index.experts.values()))
        lan.lan = k3_lan(loc.nbytes, peer.model.blocks[0].input_width * 4, TIME_SCALE)
        pulled_home("kimi_k3", root / "me")
        config = NodeConfig(
            KIMI_K3,
            home=root / "me",
            node_id="bytes-me",
            store=StoreConfig(prefetch=False, disk_budget="0", ram_budget="0"),
            household=HouseholdConfig(
                secret=SECRET, peers=[peer.rpc.address], remote=RemoteConfig(deadline_floor_s=0.5)
            ),
            metrics=MetricsConfig("127.0.0.1", 0),
        )
        with build_node(config) as me:
            yield me
    finally:
        peer.close()


def _metrics(node) -> dict[tuple[str, tuple], float]:
    text = generate_latest(node.metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_remote_lan_bytes_are_apart_from_expert_bytes(requester) -> None:
    summary = GenerationSummary()
    _generate(requester, summary)
    d = summary.experts
    assert d.uses["remote"] > 0 and d.remote["sent_bytes"] > 0  # the cost model sent work to the peer
    assert d.bytes["remote"] == 0  # no expert crossed the LAN for them
    # the summary: remote uses without an expert-bytes figure, the LAN bytes on their own line
    uses_line = next(ln for ln in summary.lines() if ln.startswith("expert uses by source"))
    assert f"remote {d.uses['remote']} (on peers)" in uses_line
    remote_line = next(ln for ln in summary.lines() if ln.startswith("remote execution"))
    assert (
        f"LAN bytes of activations {format_size(d.remote['sent_bytes'])} sent, "
        f"{format_size(d.remote['received_bytes'])} received" in remote_line
    )
    # /metrics: expert bytes by the tiers that moved experts; activations in their own counter
    scraped = _metrics(requester)
    assert ("expertmesh_expert_bytes_total", (("source", "remote"),)) not in scraped
    for s in SOURCES:
        if s != "remote":
            assert scraped[("expertmesh_expert_bytes_total", (("source", s),))] == requester.stats.bytes[s], s
    assert scraped[("expertmesh_activation_bytes_total", (("direction", "sent"),))] == d.remote["sent_bytes"]
    assert scraped[("expertmesh_activation_bytes_total", (("direction", "received"),))] == d.remote["received_bytes"]
    assert scraped[("expertmesh_expert_requests_total", (("source", "remote"),))] == d.uses["remote"]
