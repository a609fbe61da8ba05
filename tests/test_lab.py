"""`expertmesh lab`: the namespaces, bridge and tbf links and their cleanup; the lab itself on a
small K3-layout model with two nodes; the projection's arithmetic on given inputs."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from expertmesh.devtools.lab import network, projection
from expertmesh.devtools.lab.household import Lab, LabConfig, print_table

NEEDS_NAMESPACES = network.available()


def _namespaces() -> set[str]:
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20)
    return {line.split()[0] for line in r.stdout.splitlines() if line.strip()}


def _skip_without_namespaces() -> None:
    if NEEDS_NAMESPACES is not None:
        pytest.skip(f"network namespaces not available here: {NEEDS_NAMESPACES}")


@pytest.mark.e2e
def test_the_bridge_joins_shaped_namespaces_and_goes_away() -> None:
    _skip_without_namespaces()
    net = network.LabNetwork(2, lan_bytes_per_s=20e6, hub_bytes_per_s=10e6)
    with net:
        assert {f"{net.prefix}-{h}" for h in ("br", "hub", "n0", "n1")} <= _namespaces()
        assert "tbf" in net.qdiscs("n0") and "160Mbit" in net.qdiscs("n0")  # 20 MB/s
        assert "80Mbit" in net.qdiscs("hub")
        n0, n1 = net.hosts["n0"], net.hosts["n1"]
        routes = subprocess.run(n0.command(["ip", "route"]), capture_output=True, text=True, timeout=20).stdout
        assert "224.0.0.0/4 dev lan0" in routes  # multicast (zeroconf) crosses the bridge
        # a TCP connection from n0 to n1 over the bridge
        server = subprocess.Popen(
            n1.command(
                [
                    "python3",
                    "-c",
                    "import socket\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
                    f"s.bind(('{n1.address}',9100));s.listen();print('up',flush=True)\n"
                    "c,_=s.accept();print(len(c.recv(100)))",
                ]
            ),
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout.readline().strip() == "up"
            subprocess.run(
                n0.command(
                    [
                        "python3",
                        "-c",
                        f"import socket;socket.create_connection(('{n1.address}',9100),5).sendall(b'x'*9)",
                    ]
                ),
                check=True,
                timeout=20,
            )
            assert server.communicate(timeout=20)[0].strip() == "9"
        finally:
            server.kill()
            server.wait()
        assert net.leftovers()
    assert net.leftovers() == []
    assert not any(n.startswith(net.prefix + "-") for n in _namespaces())


@pytest.mark.e2e
def test_a_failed_setup_and_a_dead_labs_leftovers_are_removed() -> None:
    _skip_without_namespaces()
    net = network.LabNetwork(1, prefix=f"{network.PREFIX}{os.getpid()}")
    with pytest.raises(RuntimeError, match="boom"):
        with net:
            raise RuntimeError("boom")
    assert net.leftovers() == []
    dead = f"{network.PREFIX}4194305-n0"  # above any pid Linux hands out: that lab's process is gone
    subprocess.run(["ip", "netns", "add", dead], check=True, timeout=20)
    try:
        assert dead in network.remove_leftovers()
        assert dead not in _namespaces()
    finally:
        subprocess.run(["ip", "netns", "delete", dead], capture_output=True, timeout=20)


def test_projection_arithmetic_on_given_inputs() -> None:
    p = projection.ProjectionInputs(
        compute_s=0.001,
        call_s=0.002,
        activation_bytes=28_672,
        metal_compute_s=0.0,
        ssd_bytes_per_s=17_547_264 / 0.004,  # 4 ms to read one expert
        core_s=0.1,
    )
    gbe = projection.LINKS["1GbE"]
    # one Mac: 16 experts a layer, each read and computed: 5 ms
    assert projection.token_seconds(p, 1, gbe, p.compute_s) == pytest.approx(92 * 16 * 0.005 + 0.1)
    # four Macs, remote: a peer's call, the 12 remote experts' activations through our NIC, its 4 experts
    peer = 0.002 + 12 * 28_672 / 118e6 + 4 * 0.005
    assert projection.token_seconds(p, 4, gbe, p.compute_s) == pytest.approx(92 * peer + 0.1)
    # four Macs, fetching: 12 experts' bytes through our NIC, then computed here
    fetch = 12 * 17_547_264 / 118e6 + 12 * 0.001
    assert projection.token_seconds(p, 4, gbe, p.compute_s, remote=False) == pytest.approx(92 * fetch + 0.1)
    doc = projection.project(p)
    assert len(doc["rows"]) == 2 * 2 * 3
    moon = doc["moonshot"]
    metal = 92 * (0.002 + 12 * 28_672 / 118e6 + 4 * 0.004) + 0.1
    assert moon["projected_s_per_token"] == pytest.approx(metal)
    assert moon["met"] is (metal <= 1.5)
    text = projection.format_projection(doc)
    assert "stands in for Metal" in text and "input (assumed)" in text


def test_prompt_projection_arithmetic_on_given_inputs() -> None:
    """A long prompt's layer needs every expert (its union), each with thousands of rows: fetched,
    most of them cross our NIC as expert bytes; computed where they are, only their rows do."""
    p = projection.PromptInputs(
        tokens=10_000,  # on 8 experts choosing 2: the union is all 8, 2,500 rows each
        row_bytes=1_000,
        call_s=0.01,
        cpu_row_s=1e-6,
        metal_row_s=0.0,
        metal_expert_s=0.0,
        ssd_bytes_per_s=1e6 / 0.004,  # 4 ms to read one expert
        core_s=0.1,
        max_call_bytes=2_000_000,
        expert_bytes=1_000_000,
        experts=8,
        layers=10,
        top_k=2,
    )
    gbe = projection.LINKS["1GbE"]
    service = 0.004 + 2_500 * 1e-6  # an expert read from SSD and computed over its rows
    assert projection.prompt_layer_seconds(p, 1, gbe, metal=False, remote=True) == pytest.approx(8 * service)
    # four Macs, fetching: the 6 experts others hold cross our NIC, and are computed here
    fetch = 6 * (1e6 / 118e6 + 2_500 * 1e-6)
    assert projection.prompt_layer_seconds(p, 4, gbe, metal=False, remote=False) == pytest.approx(fetch)
    # remote: a peer's 2.5 MB of rows in two calls (in flight together), 15,000 rows' bytes through our NIC
    remote = 0.01 + 15_000 * 1_000 / 118e6 + 2 * service
    assert projection.prompt_layer_seconds(p, 4, gbe, metal=False, remote=True) == pytest.approx(remote)
    doc = projection.project_prompt(p)
    four = next(r for r in doc["rows"] if (r["compute"], r["link"], r["macs"]) == ("cpu_measured", "1GbE", 4))
    assert four["fetch_ttft_s"] == pytest.approx(10 * fetch + 0.1) and four["remote_ttft_s"] == pytest.approx(
        10 * remote + 0.1
    )
    # Metal here computes in no time: each layer is the NIC's, 6 experts fetched or 15,000 rows sent
    metal_fetch, metal_remote = 6 * 1e6 / 118e6, 0.01 + 15_000 * 1_000 / 118e6 + 2 * 0.004
    assert doc["target"]["projected"] == pytest.approx((10 * metal_fetch + 0.1) / (10 * metal_remote + 0.1))
    assert "not a measurement" in projection.format_prompt_projection(doc)


REQUIRED = ("alone_cold", "alone_warm_disk", "fetch_from_owners", "remote")
PROMPT = ("prompt_fetch_from_owners", "prompt_remote")


@pytest.mark.e2e
def test_the_lab_on_a_small_model_with_two_nodes(tmp_path: Path) -> None:
    config = LabConfig(
        nodes=2,
        moe_layers=2,
        experts=8,
        top_k=4,
        latent=512,
        intermediate=512,
        hidden=128,
        tokens=3,
        prompts=("Count the experts",),
        hub_ttfb_s=0.01,
        ram_experts=1,
        scenarios=REQUIRED + PROMPT,
        prompt_tokens=12,
        cache=tmp_path / "cache",
    )
    lines: list[str] = []
    ours = f"{network.PREFIX}{os.getpid()}-"  # the lab's own: other runs on this machine make and remove theirs
    doc = Lab(config, progress=lines.append).run()
    doc = json.loads(json.dumps(doc))  # what --json writes
    assert doc["network"] == ("namespaces" if NEEDS_NAMESPACES is None else "loopback")
    by = {c["name"]: c for c in doc["configs"]}
    assert tuple(by) == REQUIRED + PROMPT
    for c in by.values():
        for field in ("s_per_token", "lan_bytes_per_token", "hub_bytes_per_token", "tokens_equal_alone"):
            assert field in c, field
        assert c["tokens_equal_alone"] is True, c["name"]
        assert c["tokens"] > 0 and c["s_per_token"] > 0
    assert by["alone_cold"]["uses"]["hub"] > 0 and by["alone_cold"]["lan_bytes_per_token"] == 0
    assert by["alone_warm_disk"]["uses"]["disk"] > 0 and by["alone_warm_disk"]["hub_bytes_per_token"] == 0
    assert by["fetch_from_owners"]["uses"]["peer"] > 0 and by["fetch_from_owners"]["found_by"] == "zeroconf"
    assert by["fetch_from_owners"]["peers_found"] == 2
    assert by["remote"]["uses"]["remote"] > 0
    assert by["remote"]["lan_bytes_per_token"] < by["fetch_from_owners"]["lan_bytes_per_token"]
    assert set(by["remote"]["placed"]) - {"here"}  # some experts were placed on peers
    # each household node's own uses during the measured prompts, by node: where an owner got what it lacked
    assert len(by["remote"]["nodes_uses"]) == len(by["fetch_from_owners"]["nodes_uses"]) == 2
    assert by["alone_cold"]["nodes_uses"] == {}
    warm = by["remote"]["warm_up"]  # what the measured prompts' deadlines were learnt from
    assert warm["prompt_remote"]["calls"] > 0 and set(warm["links"]) == set(by["remote"]["links"])
    assert all(link["prompt_scale"] >= 1.0 for link in warm["links"].values())
    # a long prompt, its first token timed: fetched from the owners, or computed there in at most
    # one call per peer per MoE layer; the same tokens either way
    fetched, computed = by["prompt_fetch_from_owners"], by["prompt_remote"]
    assert fetched["prompt_tokens"] == computed["prompt_tokens"] == 12
    assert fetched["ttft_s"][0] > 0 and computed["ttft_s"][0] > 0
    assert fetched["prompt_stats"][0]["uses"]["peer"] > 0 and fetched["prompt_stats"][0]["remote"].get("calls", 0) == 0
    assert 0 < computed["prompt_stats"][0]["remote"]["calls"] <= 2 * config.moe_layers
    assert computed["outputs"] == fetched["outputs"]
    assert doc["projection"]["moonshot"]["target_s_per_token"] == 1.5
    assert doc["projection"]["inputs"]["activation_bytes"] > 0
    # the prompt's projection to K3 is made from these two rows' bytes, calls and compute
    inputs = doc["prompt_projection"]["inputs"]
    assert inputs["tokens"] == 12 and inputs["row_bytes"] > 0 and inputs["cpu_row_s"] > 0
    out: list[str] = []
    print_table(doc, out.append)
    assert any(line.startswith("prompt target (K3, 4 Macs") for line in "\n".join(out).splitlines())
    if NEEDS_NAMESPACES is None:
        assert not any(n.startswith(ours) for n in _namespaces())  # everything it made is gone
    else:
        assert any("LOOPBACK FALLBACK" in line for line in lines)
