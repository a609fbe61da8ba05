"""A slow home link shared by many connections (node/hub/speed.py): each connection is below the
speed floor only because the link they share is full, and nothing is broken. No connection is
given up, every fetch succeeds, and the Hub sends each byte once; a connection that is cut goes on
from the bytes it had, and a fetch that keeps receiving is not ended by its deadline.

Scaled down as tests/test_hub_slow_connections.py is: a floor of 16 kB/s over 1 s windows, and a
link of six floors for the pool's 12 connections (K3's: 64 kB/s over 10 s, and a 0.75 MB/s link)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from repos import KIMI_K3

from expertmesh.assembly import open_model
from expertmesh.devtools.local_hub import Fault, HubServer
from expertmesh.node.config import StoreConfig
from expertmesh.node.fetching import Deadline
from expertmesh.node.hub import client as hub_client
from expertmesh.node.hub.speed import too_slow
from expertmesh.node.store.tier_chain import Fetched

FLOOR = 16 * 1024
WINDOW_S = 1.0
CONNECTIONS = 12
# each piece outlasts the floor's time for it (26 kB at 16 kB/s), as a K3 piece does its 70 s:
# a fixed budget of twice that would end a fetch whose connections get half the floor
DEADLINE_S = 3.0
FAST = dict(backoff_base_s=0.005, backoff_max_s=0.05)


def _open(home: Path, reader: hub_client.RangeReader):
    # pieces of 16 kB at least: a layer's run (104 kB) goes as 4 pieces of 26 kB
    store = StoreConfig(
        prefetch=False, fill=False, disk_budget="0", hub_min_piece_bytes=16 * 1024, hub_connections=CONNECTIONS
    )
    return open_model(KIMI_K3, home=home, store=store, hub_reader=reader)


def _runs(sm) -> list[list[tuple[int, int]]]:
    """Every layer's experts, each layer one run: all at once they need more pieces than connections."""
    layers = sorted({k[0] for k in sm.index.experts})
    return [sorted(k for k in sm.index.experts if k[0] == layer) for layer in layers]


def test_connections_slow_only_because_the_link_is_full_are_kept(hub: HubServer, home: Path) -> None:
    reader = hub_client.RangeReader(
        min_bytes_per_s=FLOOR, speed_window_s=WINDOW_S, fetch_deadline_s=DEADLINE_S, max_retries=0, **FAST
    )
    sm = _open(home, reader)
    runs = _runs(sm)
    distinct = sum(sm.index.expert(*k).nbytes for run in runs for k in run)
    assert 4 * len(runs) > CONNECTIONS  # every connection busy at once
    hub.knobs.bandwidth_bytes_per_s = CONNECTIONS * FLOOR / 2  # each connection's share: half the floor
    hub.stats_.reset()
    try:
        with ThreadPoolExecutor(len(runs)) as pool:
            results = [
                r
                for rs in pool.map(lambda run: sm.store.chain.fetch_run(run, keep_now=True, decode=False), runs)
                for r in rs
            ]
    finally:
        hub.knobs.bandwidth_bytes_per_s = 0
        sm.close()
    assert all(isinstance(r, Fetched) and r.source == "hub" for r in results), [str(r)[:300] for r in results][:2]
    assert reader.slow_responses == 0 and reader.retries == 0  # no connection was given up ...
    assert hub.bytes_served() == distinct  # ... so each byte crossed the link once


def test_a_cut_connection_goes_on_from_the_bytes_it_had(hub: HubServer, home: Path) -> None:
    reader = hub_client.RangeReader(**FAST)
    sm = _open(home, reader)
    run = _runs(sm)[0]
    distinct = sum(sm.index.expert(*k).nbytes for k in run)
    hub.knobs.faults = [Fault("cut", count=4, path_glob="*.safetensors")]  # every piece: half, then closed
    hub.stats_.reset()
    try:
        results = sm.store.chain.fetch_run(run, keep_now=True, decode=False)
    finally:
        hub.knobs.faults = []
        sm.close()
    assert all(isinstance(r, Fetched) for r in results), results
    assert hub.stats()["faults"] == {"cut": 4} and reader.retries == 4
    assert hub.bytes_served() == distinct  # the retries asked for the halves not yet had, only


@pytest.mark.parametrize(
    "nbytes, link_bytes, link_open_s, given_up",
    [
        (20_000, 20_000, 1.0, False),  # above the floor
        (8_000, 96_000, 12.0, False),  # half the floor, its siblings' mean: a full link, kept
        (1_100, 96_000, 12.0, False),  # slower still, yet within SHARE_FLOOR of the mean: kept
        (500, 96_000, 12.0, True),  # far below its siblings: a broken edge
        (1_000, 12_000, 12.0, True),  # every connection drips: the node gets less than one floor
    ],
)
def test_a_slow_window_is_judged_against_the_link(
    nbytes: int, link_bytes: int, link_open_s: float, given_up: bool
) -> None:
    reason = too_slow(nbytes, 1.0, link_bytes, link_open_s, FLOOR)
    assert (reason is not None) == given_up
    assert reason is None or reason.endswith("the connection was given up")


def test_a_deadline_earns_time_with_the_bytes_that_arrive() -> None:
    deadline = Deadline(100.0, earned_bytes_per_s=1000)
    deadline.received(10_000)  # nothing before its first request
    assert deadline.left() == 100.0
    deadline.start()
    deadline.received(100_000)  # 100 s at the floor: more than any pause of this machine's
    assert 100.0 < deadline.left() <= 200.0
    ended = Deadline(0.01, earned_bytes_per_s=1000)
    ended.start()
    time.sleep(0.02)
    ended.received(10_000)  # too late: a fetch ended by its deadline stays ended
    assert ended.passed()
