"""An owner fetching an expert for a peer says how it goes (FetchExpert's `progress`), between two
real nodes on loopback and the local Hub.

The asking node waits for the owner while the owner's fetch moves, however long it queues behind
other peers' fetches, so the expert crosses the household's internet link once; it gives up
within a stall once the owner's links receive nothing, instead of waiting the longest the owner's
fetch could run (minutes for a K3 expert on a slow link); an owner too old to say still gets that
bound; and an owner does not fetch for a caller that gave up while it waited its turn. Times are
scaled down: the bounds are set on the nodes, never measured against the clock.
"""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import pytest
from nodes import joined, serving
from repos import KIMI_K3
from waiting import wait_until

from expertmesh.devtools.local_hub import HubServer
from expertmesh.node.config import StoreConfig
from expertmesh.node.rpc import fetch_progress
from expertmesh.node.rpc.client import NodeClient, model_key
from expertmesh.node.service import NodeService

SECRET = "owner-progress-secret"
WAIT_S = 30  # bounds every wait below; none is a threshold the test measures


@pytest.fixture(autouse=True)
def _quick_progress(monkeypatch) -> None:
    monkeypatch.setattr(fetch_progress, "PROGRESS_EVERY_S", 0.05)  # 2 s on a real node, scaled as the stalls are


def _owner(pulled_home, tmp_path: Path, service_class=None):
    return serving(
        KIMI_K3, pulled_home("kimi_k3", tmp_path / "owner"), SECRET, node_id="owner", service_class=service_class
    )


def _asker(pulled_home, tmp_path: Path, owner, owner_hub_s: float, stall_s: float):
    """A node with no disk budget (it owns nothing), whose wait on the owner is scaled down."""
    node = joined(
        KIMI_K3,
        pulled_home("kimi_k3", tmp_path / "asker"),
        SECRET,
        [owner.rpc.address],
        node_id="asker",
        store=StoreConfig(prefetch=False, disk_budget="0"),
    )
    tier = node.peer_tier
    tier.deadline_s, tier.owner_hub_s, tier.owner_stall_s = 0.2, lambda nbytes: owner_hub_s, stall_s
    return node


class _GatedHub:
    """The owner's Hub tier, held at `gate` before each fetch: a Hub link that receives nothing."""

    def __init__(self, tier) -> None:
        self.tier, self.entered, self.gate = tier, threading.Event(), threading.Event()

    def __getattr__(self, name: str):
        return getattr(self.tier, name)

    def fetch(self, loc, *args, **kwargs):
        self.entered.set()
        self.gate.wait(WAIT_S)
        return self.tier.fetch(loc, *args, **kwargs)


def _gate_hub(owner, monkeypatch) -> _GatedHub:
    gated = _GatedHub(owner.hub)
    tiers = [gated if t is owner.hub else t for t in owner.experts.remote_tiers]
    monkeypatch.setattr(owner.experts, "remote_tiers", tiers)
    return gated


def _fetch(node, key):
    return node.store.chain.fetch(key, keep_now=True, decode=False)


def test_a_peer_queued_behind_the_owners_other_fetches_waits_while_its_link_moves(
    hub: HubServer, pulled_home, tmp_path: Path
) -> None:
    owner = _owner(pulled_home, tmp_path)
    first, mine = sorted(owner.index.experts)[:2]
    nbytes = owner.index.expert(*first).nbytes
    # the asker's bound on a silent owner is 0.2 + 0.3 s; the fetch ahead of its own takes 1.5 s
    asker = _asker(pulled_home, tmp_path, owner, owner_hub_s=0.3, stall_s=1.0)
    model = model_key(owner.index.repo_id, owner.index.commit)
    hub.knobs.bandwidth_bytes_per_s = nbytes / 1.5
    try:
        with hub.stats_.lock:
            hub.stats_.reset()
        with NodeClient(owner.rpc.address, SECRET) as other:
            ahead = other.fetch_expert(model, *first, timeout=WAIT_S, fetch_on_miss=True)

            def read_ahead() -> None:
                assert sum(len(c.data) for c in ahead) == nbytes
                hub.knobs.bandwidth_bytes_per_s = 0  # the asker's own fetch, next, goes at once

            reader = threading.Thread(target=read_ahead)
            reader.start()
            assert wait_until(lambda: owner.hub.reader.received_bytes() > 0, timeout_s=WAIT_S)
            result = _fetch(asker, mine)  # queued behind `first` for longer than its silent bound
            reader.join(WAIT_S)
        assert result.source == "peer"
        assert not {"stalled", "deadline_exceeded"} & set(asker.peers.errors)
        # each expert crossed the internet once: the owner fetched both, the asker neither
        assert asker.store.stats.uses["hub"] == 0
        assert hub.stats()["bytes_served"] == nbytes + owner.index.expert(*mine).nbytes + asker.store.stats.audit_bytes
    finally:
        hub.knobs.bandwidth_bytes_per_s = 0
        asker.close()
        owner.close()


class _OlderOwner(NodeService):
    """An owner from before progress: it ignores the field and says nothing until the data."""

    def FetchExpert(self, request, context):
        request.progress = False
        yield from super().FetchExpert(request, context)


@pytest.mark.parametrize(
    ("service_class", "owner_hub_s", "stall_s", "reason"),
    [
        # silent, it would be waited for an hour; its progress shows its links stopped
        (None, 3600.0, 0.5, "stalled"),
        # from before progress: the bound of its fetch, though the call's own deadline allows more
        (_OlderOwner, 0.3, 3600.0, "deadline_exceeded"),
    ],
    ids=["reports progress", "older owner"],
)
def test_an_owner_whose_fetch_is_stuck_is_given_up(
    hub: HubServer, pulled_home, tmp_path: Path, monkeypatch, service_class, owner_hub_s, stall_s, reason
) -> None:
    owner = _owner(pulled_home, tmp_path, service_class)
    gated = _gate_hub(owner, monkeypatch)
    key = sorted(owner.index.experts)[2]
    asker = _asker(pulled_home, tmp_path, owner, owner_hub_s=owner_hub_s, stall_s=stall_s)
    try:
        result = _fetch(asker, key)
        assert gated.entered.is_set()  # the owner's fetch had begun, and was stuck
        assert result.source == "hub"
        assert asker.peers.errors[reason] == 1
    finally:
        gated.gate.set()
        asker.close()
        owner.close()


def test_an_owner_does_not_fetch_for_a_caller_that_left_while_it_waited_its_turn(
    hub: HubServer, pulled_home, tmp_path: Path, monkeypatch
) -> None:
    owner = _owner(pulled_home, tmp_path)
    gated = _gate_hub(owner, monkeypatch)
    first, left = sorted(owner.index.experts)[4:6]
    model = model_key(owner.index.repo_id, owner.index.commit)
    try:
        with hub.stats_.lock:
            hub.stats_.reset()
        with NodeClient(owner.rpc.address, SECRET) as client:
            ahead = client.fetch_expert(model, *first, timeout=WAIT_S, fetch_on_miss=True)
            assert gated.entered.wait(WAIT_S)  # `first` holds the owner's fetch
            behind = client.fetch_expert(model, *left, timeout=0.5, fetch_on_miss=True, progress=True)
            with pytest.raises(grpc.RpcError) as e:
                for _ in behind:  # its progress, "not begun", until the caller's deadline
                    pass
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            gated.gate.set()
            assert sum(len(c.data) for c in ahead) == owner.index.expert(*first).nbytes
        assert wait_until(lambda: owner.service.peer_call_slots.in_use() == 0, timeout_s=WAIT_S)
        assert first in owner.disk and left not in owner.disk
        assert hub.stats()["bytes_served"] == owner.index.expert(*first).nbytes
    finally:
        gated.gate.set()
        owner.close()
