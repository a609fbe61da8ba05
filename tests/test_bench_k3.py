"""`expertmesh bench --model k3-proportions` on a very small variant: its JSON carries exactly the
field names issue 20 fixed, and its baseline moves only what it demands, no faster than the link.
The speed figures themselves come from the real-size run in docs/benchmarks.md, not from here."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from expertmesh.devtools import bench_k3
from expertmesh.devtools.tiny import k3_proportions

# many experts, few routed: decode keeps meeting experts the prompt did not touch (the baseline has
# no fill to fetch them ahead); a cold node's fill may still have fetched all of them first
TINY = k3_proportions.Proportions(moe_layers=2, experts=128, top_k=2, latent=256, intermediate=256, hidden=64)
CAP = 20e6


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the tiny model is made once for the module's runs."""
    return tmp_path_factory.mktemp("bench-k3")


@pytest.fixture(scope="module")
def doc(cache: Path) -> dict:
    got = bench_k3.run(
        [CAP],
        tokens=2,
        configs=("cold", "fair_naive", "k3_replay"),
        progress=lambda _m: None,
        proportions=TINY,
        cache=cache,
    )
    return json.loads(json.dumps(got))  # what --json writes


@pytest.mark.e2e
def test_every_config_reports_the_agreed_fields(doc: dict) -> None:
    rows = {r["name"]: r for r in doc["configs"]}
    assert set(rows) == {"cold", "fair_naive", "k3_replay", "floor"}
    for name in ("cold", "fair_naive", "k3_replay"):
        row = rows[name]
        assert set(bench_k3.FIELDS) <= set(row), name
        assert row["per_connection_bytes_per_s"] == CAP
        assert row["tokens"] > 0 and row["s_per_token"] > 0 and row["peak_rss_bytes"] > 0, name
        # CPU per GB fetched is a figure only where something was fetched: never a made-up zero
        assert (row["node_cpu_s_per_gb"] is None) == (row["moved_bytes"] == 0), name
        assert row["node_cpu_s_per_gb"] is None or row["node_cpu_s_per_gb"] > 0, name
    assert doc["model"]["expert_bytes"] == TINY.expert_bytes
    assert doc["link"]["bytes_per_s"] == bench_k3.LINK_BYTES_PER_S


@pytest.mark.e2e
def test_the_baseline_moves_only_what_it_demands_at_no_more_than_the_link(doc: dict) -> None:
    rows = {r["name"]: r for r in doc["configs"]}
    assert rows["k3_replay"]["demanded_bytes"] > 0  # fresh experts at every layer of every token
    naive = rows["fair_naive"]
    assert naive["demanded_bytes"] > 0  # 2 of 128 experts a layer: decode meets ones the prompt did not touch
    # one connection, one expert at a time, no guesses, no fill: every byte it moves was waited for,
    # and no faster than the link carries it (the floor: demanded bytes at the link's full rate)
    assert naive["bytes_moved_over_demanded"] == pytest.approx(1.0)
    assert naive["wait_over_floor"] >= 0.95
    for name in ("cold", "fair_naive", "k3_replay"):
        row = rows[name]
        assert row["demanded_bytes"] % TINY.expert_bytes == 0, name  # whole experts, counted once
        if row["demanded_bytes"]:  # a cold node's fill may have left decode nothing to wait for
            assert row["useful_link_use"] == pytest.approx(1 / row["wait_over_floor"], rel=1e-6)
    floor = rows["floor"]
    assert floor["s_per_token"] == pytest.approx(
        rows["cold"]["demanded_bytes"] / doc["link"]["bytes_per_s"] / rows["cold"]["tokens"]
    )


@pytest.mark.e2e
def test_a_config_runs_over_a_kernel_shaped_link_and_leaves_no_namespace(cache: Path) -> None:
    from expertmesh.devtools.lab import network

    why = network.available()
    if why:
        print(f"kernel link not available: {why}")
        pytest.skip(why)
    got = json.loads(
        json.dumps(
            bench_k3.run(
                [CAP],
                tokens=2,
                configs=("k3_replay",),
                progress=lambda _m: None,
                proportions=TINY,
                cache=cache,
                kernel_link=True,
            )
        )
    )
    assert got["link"]["shaped_by"] == "kernel tbf"
    # read from the Hub's interface while it ran: the link's 100 MB/s, in bits
    assert "tbf" in got["link"]["hub_qdisc"] and "rate 800Mbit" in got["link"]["hub_qdisc"]
    (row,) = got["configs"]
    assert row["name"] == "k3_replay" and set(bench_k3.FIELDS) <= set(row)
    assert row["tokens"] == 2 and row["demanded_bytes"] > 0 and row["s_per_token"] > 0
    assert row["demanded_bytes"] % TINY.expert_bytes == 0
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert f"{network.PREFIX}{os.getpid()}" not in listed


def test_a_kernel_link_without_namespaces_fails_clearly_instead_of_falling_back(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Checked before anything is made or started: the message says why, nothing runs hub-shaped."""
    from expertmesh.devtools.lab import network

    monkeypatch.setattr(network, "available", lambda: "not root: network namespaces need CAP_NET_ADMIN")
    with pytest.raises(bench_k3.KernelLinkUnavailable, match="not root"):
        bench_k3.run([CAP], configs=("k3_replay",), proportions=TINY, cache=tmp_path, kernel_link=True)
    assert not any(tmp_path.iterdir())  # no model made, no hub started


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--experts-per-layer", "8"], "--experts-per-layer"),  # fewer than the 16 a token routes to
        (["--configs", "cold,warm_ram"], "warm_ram"),
        (["--per-connection-bandwidth", "fast"], "--per-connection-bandwidth"),
        (["--baseline", "/nonexistent/baseline.json"], "--baseline"),
    ],
)
def test_bad_bench_arguments_fail_before_anything_is_made(
    args: list[str], named: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from expertmesh.cli import main

    monkeypatch.setenv("EXPERTMESH_HOME", str(tmp_path))
    assert main(["bench", "--model", "k3-proportions", *args]) != 0
    err = capsys.readouterr().err
    assert err.startswith("error:") and named in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())  # no repo made, nothing downloaded


@pytest.mark.e2e
def test_a_run_is_held_against_its_recorded_baseline(doc: dict, tmp_path: Path) -> None:
    """`bench --baseline`: the run's CPU per GB and useful link beside a recorded run of the same
    shape; one doubled CPU per GB, a halved useful link or a row that gave no figure is a regression."""
    from expertmesh.devtools import fetch_baseline

    shape = fetch_baseline.Shape(TINY.experts, TINY.moe_layers, TINY.router, ("cold", "k3_replay"), (CAP,), 2)
    path = tmp_path / "baseline.json"
    fetch_baseline.record(doc, shape, path)
    loaded_shape, baseline = fetch_baseline.load(path)
    assert loaded_shape == shape and {r["name"] for r in baseline["rows"]} == {"cold", "k3_replay"}
    same = fetch_baseline.compare(doc, baseline)
    assert same and not any(c.regressed for c in same)
    assert fetch_baseline.print_comparison(same, baseline, out=lambda _line: None)

    worse = json.loads(json.dumps(doc))
    replay = next(r for r in worse["configs"] if r["name"] == "k3_replay")
    replay["node_cpu_s_per_gb"] *= 2
    replay["useful_link_use"] /= 2
    regressed = {(c.config, c.figure) for c in fetch_baseline.compare(worse, baseline) if c.regressed}
    assert regressed == {("k3_replay", "node_cpu_s_per_gb"), ("k3_replay", "useful_link_use")}
    lines: list[str] = []
    assert not fetch_baseline.print_comparison(fetch_baseline.compare(worse, baseline), baseline, out=lines.append)
    assert sum("REGRESSED" in line for line in lines) == 2

    worse["configs"] = [r for r in worse["configs"] if r["name"] != "cold"]
    assert {c.config for c in fetch_baseline.compare(worse, baseline) if c.regressed} == {"cold", "k3_replay"}


def test_a_baseline_that_is_not_one_is_refused_by_name(tmp_path: Path) -> None:
    from expertmesh.devtools import fetch_baseline

    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": []}')
    with pytest.raises(fetch_baseline.BaselineError, match="bad.json"):
        fetch_baseline.load(bad)
