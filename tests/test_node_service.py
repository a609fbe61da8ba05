"""The gRPC node service over a real channel on loopback: the secret guards all but health, experts
come back verified and exact, the inventory follows the disk, and Generate streams mlx-lm's tokens."""

from __future__ import annotations

import filecmp
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from nodes import serving
from repos import KIMI_K3

from expertmesh.node.rpc.auth import call_metadata, node_method
from expertmesh.v1 import node_pb2, node_pb2_grpc

SECRET = "test-household-secret"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def node(module_home: Path):
    served = serving(KIMI_K3, module_home, SECRET, node_id="n1")
    channel = grpc.insecure_channel(served.rpc.address)
    try:
        yield served.model, node_pb2_grpc.NodeStub(channel), channel, module_home
    finally:
        channel.close()
        served.close()


def _md(method: str):
    """A fresh credential for one call of `method`: a node accepts each credential once."""
    return call_metadata(SECRET, node_method(method))


def _key(sm, layer: int, expert: int) -> node_pb2.ExpertKey:
    return node_pb2.ExpertKey(model=node_pb2.ModelKey(repo_id=sm.repo_id, commit=sm.commit), layer=layer, expert=expert)


def _upstream_bytes(repo: Path, loc) -> bytes:
    out = b""
    for r in loc.ranges:
        with open(repo / r.file, "rb") as f:
            f.seek(r.start)
            out += f.read(r.nbytes)
    return out


def test_health_is_open_and_everything_else_needs_the_secret(node) -> None:
    sm, stub, channel, _ = node
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="expertmesh.v1.Node"))
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    for credential in (lambda method: (), lambda method: call_metadata("wrong", node_method(method))):
        with pytest.raises(grpc.RpcError) as e:
            stub.Info(node_pb2.InfoRequest(), metadata=credential("Info"), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert sm.repo_id not in e.value.details()  # learns nothing about the node
        with pytest.raises(grpc.RpcError) as e:
            key = _key(sm, 1, 0)
            list(stub.FetchExpert(node_pb2.FetchExpertRequest(key=key), metadata=credential("FetchExpert"), timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    info = stub.Info(node_pb2.InfoRequest(), metadata=_md("Info"), timeout=10)
    assert info.role == "full" and info.node_id == "n1" and info.models[0].commit == sm.commit
    assert SECRET not in str(info)


def test_fetch_expert_is_exact_and_verified_and_fills_the_inventory(node, tiny_repos: dict[str, Path]) -> None:
    sm, stub, _, _ = node
    layer = sm.index.moe_layers[-1]
    loc = sm.index.expert(layer, 7)
    with pytest.raises(grpc.RpcError) as e:  # not held, and not asked to fetch it
        list(
            stub.FetchExpert(
                node_pb2.FetchExpertRequest(key=_key(sm, layer, 7)), metadata=_md("FetchExpert"), timeout=10
            )
        )
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    chunks = list(
        stub.FetchExpert(
            node_pb2.FetchExpertRequest(key=_key(sm, layer, 7), fetch_on_miss=True),
            metadata=_md("FetchExpert"),
            timeout=30,
        )
    )
    data = b"".join(c.data for c in chunks)
    assert chunks[0].size == len(data) == loc.nbytes
    assert chunks[0].sha256 == hashlib.sha256(data).hexdigest()
    assert data == _upstream_bytes(tiny_repos["kimi_k3"], loc)
    inventory = stub.GetInventory(
        node_pb2.InventoryRequest(model=_key(sm, 0, 0).model), metadata=_md("GetInventory"), timeout=10
    )
    bitmap = next(b for b in inventory.layers if b.layer == layer)
    assert bitmap.bits[7 // 8] & (1 << (7 % 8))  # the owner kept what it fetched
    assert [b.layer for b in inventory.layers] == sm.index.moe_layers


def test_bad_requests_get_clear_statuses(node) -> None:
    sm, stub, _, _ = node
    cases = [
        (_key(sm, 999, 0), grpc.StatusCode.INVALID_ARGUMENT),
        (
            node_pb2.ExpertKey(model=node_pb2.ModelKey(repo_id="other/model", commit=sm.commit), layer=1),
            grpc.StatusCode.NOT_FOUND,
        ),
        (
            node_pb2.ExpertKey(model=node_pb2.ModelKey(repo_id=sm.repo_id, commit="0" * 40), layer=1),
            grpc.StatusCode.NOT_FOUND,
        ),
    ]
    for key, code in cases:
        with pytest.raises(grpc.RpcError) as e:
            list(
                stub.FetchExpert(
                    node_pb2.FetchExpertRequest(key=key, fetch_on_miss=True), metadata=_md("FetchExpert"), timeout=10
                )
            )
        assert e.value.code() == code, key
    with pytest.raises(grpc.RpcError) as e:
        list(
            stub.Generate(
                node_pb2.GenerateRequest(model=_key(sm, 0, 0).model, prompt="hi", top_p=2.0),
                metadata=_md("Generate"),
                timeout=10,
            )
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_generate_streams_mlx_lm_tokens_with_a_summary(node, oracle) -> None:

    sm, stub, _, _ = node
    prompt = "The household shares"
    request = node_pb2.GenerateRequest(model=node_pb2.ModelKey(repo_id=sm.repo_id), prompt=prompt, max_tokens=12)
    events = list(stub.Generate(request, metadata=_md("Generate"), timeout=120))
    tokens = [e.token.id for e in events if e.HasField("token")]
    done = events[-1].done
    expected = oracle.tokens("kimi_k3", prompt, 12)
    assert tokens == expected
    assert done.generated_tokens == len(tokens) and done.stop_reason in ("length", "eos")
    per_token = sum(e.token.expert_uses for e in events if e.HasField("token"))
    assert events[0].token.expert_uses > 0  # the first token carries the prefill's experts
    if done.stop_reason == "length":  # every pass led to a streamed token
        assert per_token == sum(done.expert_uses.values())
    else:  # the pass that chose the end of sequence streams no token
        assert per_token < sum(done.expert_uses.values())


def test_generate_with_speculation_gives_the_same_tokens_and_counts_its_passes(node, oracle) -> None:
    """`serve --speculate ngram` runs Generate through the speculative decoder (the random tiny
    model seldom repeats itself, so drafts are few: tests/test_speculative.py and
    benchmarks/bench_speculative.py show the savings on the trained demo model)."""

    from expertmesh.node.config import SpeculationConfig

    sm, home = node[0], node[3]
    speculating = serving(KIMI_K3, home, SECRET, node_id="n2", speculation=SpeculationConfig(mode="ngram"))
    prompt = "one two three four one two three four one two three four one two"
    try:
        with grpc.insecure_channel(speculating.rpc.address) as channel:
            request = node_pb2.GenerateRequest(
                model=node_pb2.ModelKey(repo_id=sm.repo_id), prompt=prompt, max_tokens=24
            )
            events = list(node_pb2_grpc.NodeStub(channel).Generate(request, metadata=_md("Generate"), timeout=120))
    finally:
        speculating.close()
    expected = oracle.tokens("kimi_k3", prompt, 24)
    assert [e.token.id for e in events if e.HasField("token")] == expected
    done = events[-1].done
    assert 0 < done.forward_passes <= done.generated_tokens  # counted by the speculative decoder
    assert done.accepted_tokens <= done.drafted_tokens


@pytest.mark.e2e
def test_the_committed_generated_code_is_up_to_date(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ},
    )
    assert r.returncode == 0, r.stderr
    for generated in sorted((tmp_path / "expertmesh" / "v1").glob("*.py*")):
        committed = ROOT / "proto" / "expertmesh" / "v1" / generated.name
        assert committed.exists() and filecmp.cmp(generated, committed, shallow=False), (
            f"{committed.relative_to(ROOT)} is stale: run `python scripts/gen_proto.py`"
        )


@pytest.mark.e2e
def test_serve_creates_a_secret_says_where_it_is_and_stops_on_sigterm(pulled_home, tmp_path: Path) -> None:
    import re
    import signal
    import time

    pulled_home("kimi_k3", tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "EXPERTMESH_SECRET"}
    env["EXPERTMESH_HOME"] = str(tmp_path)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "expertmesh",
            "serve",
            KIMI_K3,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--http-port",
            "0",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = []
        deadline = time.monotonic() + 120
        while not any("created a household secret" in ln for ln in lines) and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            lines.append(line)
        port = int(re.search(r"on 127\.0\.0\.1:(\d+)", "".join(lines)).group(1))
        secret = (tmp_path / "secret").read_text().strip()
        assert (tmp_path / "secret").stat().st_mode & 0o077 == 0  # owner-only
        assert secret not in "".join(lines)  # stdout is a pipe here (a log, under launchd): never the secret
        assert "`expertmesh secret` shows it" in "".join(lines)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            info = node_pb2_grpc.NodeStub(channel).Info(
                node_pb2.InfoRequest(), metadata=call_metadata(secret, node_method("Info")), timeout=30
            )
        assert info.role == "full"
        api = re.search(r"OpenAI-compatible API on (\S+)", "".join(lines)).group(1)  # the embedded coordinator
        import json
        import urllib.request

        with urllib.request.urlopen(f"{api}/models", timeout=30) as r:
            assert [m["id"] for m in json.load(r)["data"]] == [KIMI_K3]
        with urllib.request.urlopen(api.removesuffix("/v1") + "/healthz", timeout=30) as r:
            assert json.load(r)["full_nodes"] == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        proc.stdout.close()
        proc.stderr.close()
