"""`--hub-connections N`: at most N range requests to the Hub at once while generating, and more
when N allows — a user sets it to spare a shared link or a rate-limited mirror."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from expertmesh.assembly import open_model
from expertmesh.cli import build_parser
from expertmesh.cli.arguments import store_config
from expertmesh.devtools.local_hub import HubServer
from expertmesh.node.engine.generation import Generator, SamplingSettings
from expertmesh.node.hub import client as hub_client
from expertmesh.node.hub.client import RangeReader

REPO_ID = "expertmesh/tiny-kimi_k3"


@pytest.fixture(scope="module")
def pulled(pulled_home, hub: HubServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("hub-connections")
    pulled_home("kimi_k3", home)
    return home


def _peak_while_generating(hub: HubServer, home: Path, connections: int) -> int:
    args = build_parser().parse_args(
        ["run", REPO_ID, "x", "--no-prefetch", "--no-fill", "--hub-connections", str(connections)]
    )
    cfg = store_config(args)
    cfg.hub_min_piece_bytes = 1  # every expert in the pool's full number of pieces
    cfg.disk_budget = "0"  # every expert comes from the Hub
    sm = open_model(REPO_ID, home=home, store=cfg)
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


def test_no_more_requests_in_flight_than_connections(hub: HubServer, pulled: Path) -> None:
    assert _peak_while_generating(hub, pulled, 2) <= 2
    assert _peak_while_generating(hub, pulled, 6) > 2  # and the limit is what held it down


def test_a_connection_count_below_one_is_refused(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", REPO_ID, "x", "--hub-connections", "0"])
    assert "at least 1" in capsys.readouterr().err


def test_a_cold_shard_costs_one_redirect_however_many_reads_start_at_once(hub: HubServer, pulled: Path) -> None:
    reader = RangeReader()  # remembers nothing yet
    shard = hub_client.RemoteFile(REPO_ID, hub.repos[REPO_ID].commit, "model-00001-of-00003.safetensors")
    hub.knobs.ttfb_s = 0.05  # every read is out before the first redirect comes back
    hub.stats_.reset()
    try:
        with ThreadPoolExecutor(8) as pool:
            parts = list(pool.map(lambda i: reader.read(shard, 1000 * i, 1000 * (i + 1)), range(8)))
    finally:
        hub.knobs.ttfb_s = 0.0
    assert b"".join(parts) == reader.read(shard, 0, 8000)
    assert hub.stats()["redirects"] == 1
