"""`--hub-connections N`: at most N range requests to the Hub at once while generating, and more
when N allows — a user sets it to spare a shared link or a rate-limited mirror. Without it the
count starts at 12 and grows while more connections carry more (store/tiers/hub_connections.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from repos import KIMI_K3

from expertmesh.assembly import open_model
from expertmesh.cli import build_parser
from expertmesh.cli.arguments import store_config
from expertmesh.devtools.local_hub import HubServer
from expertmesh.node.engine.generation import Generator, SamplingSettings
from expertmesh.node.hub import client as hub_client
from expertmesh.node.hub.client import RangeReader
from expertmesh.node.store.priority import PriorityPool
from expertmesh.node.store.tiers.hub_connections import PIECES_PER_CONNECTION, AdaptiveConnections


def _peak_while_generating(hub: HubServer, home: Path, connections: int) -> int:
    args = build_parser().parse_args(
        ["run", KIMI_K3, "x", "--no-prefetch", "--no-fill", "--hub-connections", str(connections)]
    )
    cfg = store_config(args)
    cfg.hub_min_piece_bytes = 1  # every expert in the pool's full number of pieces
    cfg.disk_budget = "0"  # every expert comes from the Hub
    sm = open_model(KIMI_K3, home=home, store=cfg)
    hub.knobs.ttfb_s = 0.02  # requests overlap for certain
    hub.stats_.reset()
    try:
        tokens = list(Generator(sm).generate(sm.tokenizer.encode("Count the"), SamplingSettings(max_tokens=3)))
    finally:
        hub.knobs.ttfb_s = 0.0
        sm.close()
    assert len(tokens) == 3
    assert hub.stats()["requests"] > connections  # there was more to ask for than the pool allows at once
    return hub.stats()["peak_waiting"]


def test_no_more_requests_in_flight_than_connections(hub: HubServer, module_home: Path) -> None:
    assert _peak_while_generating(hub, module_home, 2) <= 2
    assert _peak_while_generating(hub, module_home, 6) > 2  # and the limit is what held it down


def test_a_connection_count_below_one_is_refused(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", KIMI_K3, "x", "--hub-connections", "0"])
    assert "at least 1" in capsys.readouterr().err


def test_a_cold_shard_costs_one_redirect_however_many_reads_start_at_once(hub: HubServer, module_home: Path) -> None:
    reader = RangeReader()  # remembers nothing yet
    shard = hub_client.RemoteFile(KIMI_K3, hub.repos[KIMI_K3].commit, "model-00001-of-00003.safetensors")
    hub.knobs.ttfb_s = 0.05  # every read is out before the first redirect comes back
    hub.stats_.reset()
    try:
        with ThreadPoolExecutor(8) as pool:
            parts = list(pool.map(lambda i: reader.read(shard, 1000 * i, 1000 * (i + 1)), range(8)))
    finally:
        hub.knobs.ttfb_s = 0.0
    assert b"".join(parts) == reader.read(shard, 0, 8000)
    assert hub.stats()["redirects"] == 1


# -- the count adapts to what the CDN gives each connection (store/tiers/hub_connections.py) ----


def _converged_count(per_connection: float, link: float = 100e6, ttfb_s: float = 0.075, piece: float = 4.4e6) -> int:
    """The count AdaptiveConnections converges to when every allowed connection is busy with K3's
    pieces on `link`: each connection carries `per_connection` while transferring and nothing
    while it waits for the first byte, and together they carry at most the link."""
    counts = AdaptiveConnections(12, 32)
    now = 0.0
    while not counts.converged:
        n = counts.allowed
        alone = piece / (ttfb_s + piece / per_connection)  # one connection's rate, its first byte included
        rate = min(n * alone, link) / n
        for _ in range(PIECES_PER_CONNECTION * n):
            now += piece / (n * rate)  # n connections side by side: a piece ends every piece / (n x rate) s
            counts.record(int(piece), piece / rate, busy_at_start=n, ended_at=now)
    return counts.allowed


def test_a_full_link_shared_unevenly_does_not_read_as_room_for_more() -> None:
    """On a full link some pieces wait longer for their share than others: the pieces' rates
    spread while what the connections carry together stays the link's. Judged by that (bytes
    over the window's time), the count stays where the link was full; the median piece's rate
    times the count would have read the spread as a gain, and climbed to the most."""
    counts = AdaptiveConnections(12, 32)
    link, piece, now = 100e6, 4.4e6, 0.0
    while not counts.converged:
        n = counts.allowed
        starved = (n - 12) / n  # beyond the 12 that fill the link, connections mostly wait for a share
        rest = (1 - 0.2 * starved) / (1 - starved)  # the others' share: on average an even one
        for i in range(PIECES_PER_CONNECTION * n):
            now += piece / link  # together they carry the link, whatever the count
            share = 0.2 if i < starved * PIECES_PER_CONNECTION * n else rest
            counts.record(int(piece), piece / (share * link / n), busy_at_start=n, ended_at=now)
    assert counts.allowed == 12


def test_the_count_grows_while_more_connections_carry_more_and_stops_where_the_link_is_full() -> None:
    assert _converged_count(8.7e6) == 18  # 12 carry 91 MB/s of a 100 MB/s link: 18 fill it
    assert _converged_count(50e6) == 12  # 12 already fill it: 18 would only share it
    assert _converged_count(2e6) == 32  # a slow edge: as many as allowed
    assert 12 * 50e6 > 100e6 and 18 * 8.7e6 > 100e6 and 32 * 2e6 < 100e6


def test_pieces_in_flight_below_the_count_say_nothing_of_the_link() -> None:
    counts = AdaptiveConnections(12, 32)
    for _ in range(1000):
        counts.record(4_400_000, 0.5, busy_at_start=3)  # a quiet moment: only 3 connections busy
    assert counts.allowed == 12 and not counts.converged


def test_the_pool_runs_as_many_at_once_as_it_is_resized_to() -> None:
    import threading
    import time

    pool = PriorityPool(2, "resize-test")
    pool.start()
    gate, running, lock, peak = threading.Event(), [0], threading.Lock(), [0]

    def hold() -> None:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        gate.wait(10)
        with lock:
            running[0] -= 1

    try:
        pool.resize(5)
        futures = [pool.submit(hold, priority=0) for _ in range(8)]
        deadline = time.monotonic() + 10
        while running[0] < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert running[0] == 5  # five at once, the others queued
        gate.set()
        for f in futures:
            f.result(10)
        assert peak[0] == 5
        pool.resize(1)
        gate.clear()
        peak[0] = 0
        futures = [pool.submit(hold, priority=0) for _ in range(3)]
        deadline = time.monotonic() + 10
        while running[0] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        gate.set()
        for f in futures:
            f.result(10)
        assert peak[0] == 1 and pool.workers == 1
    finally:
        gate.set()
        pool.shutdown()
