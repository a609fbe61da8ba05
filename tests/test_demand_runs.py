"""Demanded experts that lie back to back in a shard are fetched as one run of range requests when
a layer wants more experts than there are Hub connections: fewer requests (each pays its time to
first byte once, and counts against the Hub's rate limit), the same bytes, each expert once."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
from repos import KIMI_K3

from expertmesh.assembly import open_model
from expertmesh.devtools.local_hub import Fault, HubServer
from expertmesh.node.config import StoreConfig
from expertmesh.node.model.expert_index import run_ranges
from tests.store_calls import take_layer

RUN, LONE = [0, 1, 2], 5


def _open(home: Path, coalesce: bool, connections: int = 1):
    # no disk copies, no guesses, no fills: every expert below comes from the Hub on demand
    return open_model(
        KIMI_K3,
        home=home,
        store=StoreConfig(
            disk_budget="0",
            prefetch=False,
            fill=False,
            coalesce=coalesce,
            hub_connections=connections,
            hub_max_connections=connections,
        ),
    )


def _demand(hub: HubServer, sm, layer: int) -> tuple[dict, int, int]:
    """The experts, and the range requests and bytes the Hub served for them."""
    hub.stats_.reset()
    weights = take_layer(sm.store, layer, [*RUN, LONE])
    stats = hub.stats()
    ranges = sum(n for name, f in stats["files"].items() if name.endswith(".safetensors") for _, _, n in f["ranges"])
    return weights, ranges, stats["bytes_served"]


def test_adjacent_demands_go_as_one_run_with_the_same_bytes(hub: HubServer, module_home: Path) -> None:
    plain, runs, free = (
        _open(module_home, coalesce=False),
        _open(module_home, coalesce=True),
        _open(module_home, True, 12),
    )
    try:
        layer = min(k[0] for k in plain.index.experts)
        locs = {e: plain.index.expert(layer, e) for e in [*RUN, LONE]}
        merged = run_ranges([locs[e] for e in RUN])
        assert merged is not None
        expected, plain_requests, plain_bytes = _demand(hub, plain, layer)
        got, run_requests, run_bytes = _demand(hub, runs, layer)
        assert plain_bytes == run_bytes == sum(loc.nbytes for loc in locs.values())  # each expert once
        assert plain_requests == sum(len(loc.ranges) for loc in locs.values())
        assert run_requests == len(merged) + len(locs[LONE].ranges)  # the three adjacent ones as one run
        assert sorted(got) == sorted(expected)
        for e in expected:
            assert got[e].keys() == expected[e].keys() and all(
                np.array_equal(got[e][k], expected[e][k]) for k in got[e]
            )
        assert runs.store.stats.snapshot().uses["hub"] == len(locs)
        # with a connection free for every expert, one request each is faster: no runs
        assert _demand(hub, free, layer)[1] == plain_requests
    finally:
        plain.close()
        runs.close()
        free.close()


def test_a_demand_for_an_expert_of_a_running_run_waits_for_it(hub: HubServer, module_home: Path) -> None:
    sm = _open(module_home, coalesce=True)
    hub.knobs.ttfb_s = 0.2  # the run is still on its way when the second demand comes
    try:
        layer = max(k[0] for k in sm.index.experts)
        before = hub.stats()["bytes_served"]
        first = threading.Thread(target=take_layer, args=(sm.store, layer, RUN))
        first.start()
        deadline = time.monotonic() + 10
        while hub.stats_.waiting == 0 and time.monotonic() < deadline:  # the run's requests are out
            time.sleep(0.005)
        second = take_layer(sm.store, layer, [RUN[1]])
        first.join(timeout=30)
        assert not first.is_alive() and RUN[1] in second
        assert sm.store.stats.snapshot().uses["hub"] == len(RUN) + 1  # the second demand used the run's copy
        assert hub.stats()["bytes_served"] - before == sum(sm.index.expert(layer, e).nbytes for e in RUN)
    finally:
        hub.knobs.ttfb_s = 0.0
        sm.close()


def test_a_run_with_bad_bytes_is_fetched_again_expert_by_expert(hub: HubServer, module_home: Path) -> None:
    clean = _open(module_home, coalesce=True)
    try:
        layer = sorted({k[0] for k in clean.index.experts})[1]  # one the other tests do not use
        expected = take_layer(clean.store, layer, RUN)  # records every expert's sha256
    finally:
        clean.close()
    sm = _open(module_home, coalesce=True)
    hub.knobs.faults = [Fault("wrong_bytes", count=1, path_glob="*.safetensors")]  # the run's one response
    try:
        got = take_layer(sm.store, layer, RUN)
        stats = sm.store.stats.snapshot()
    finally:
        hub.knobs.faults = []
        sm.close()
    assert stats.integrity_failures["hub"] == len(RUN)  # every expert of the spoilt run caught
    for e in RUN:
        assert got[e].keys() == expected[e].keys() and all(np.array_equal(got[e][k], expected[e][k]) for k in got[e])
