"""Metrics you can trust: a real Prometheus (Debian's package) scrapes a real node during a gRPC
generation on the tiny Kimi K3; every PromQL expression of the Grafana dashboard returns data; the
counters equal the generation's own summary; promtool accepts the config and a scrape; and the
targets file follows the metrics ports that nodes advertise over zeroconf."""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml
from nodes import serving
from prometheus_client.parser import text_string_to_metric_families

from expertmesh.node.config import MetricsConfig, StoreConfig
from expertmesh.node.household.discovery import Advertisement, Discovery
from expertmesh.node.household.membership import PeerTable
from expertmesh.node.observability.prometheus_targets import TargetsWatcher
from expertmesh.node.rpc.auth import call_metadata
from expertmesh.node.store.stats import SOURCES
from expertmesh.v1 import node_pb2, node_pb2_grpc

REPO_ID = "expertmesh/tiny-kimi_k3"
SECRET = "metrics-test-household-secret"
ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "expertmesh.json"
PROMETHEUS_YML = ROOT / "deploy" / "prometheus" / "prometheus.yml"
MAX_TOKENS = 12
WAIT_S = 60.0  # every poll below gives up after this long


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"`{name}` is not on PATH: install Debian's package (`apt-get install -y prometheus`, "
            "as .ci/run does); the metrics tests need a real Prometheus",
            pytrace=False,
        )
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value of one scrape."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _poll(fn, what: str):
    """fn() until it returns something truthy, at most WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while True:
        got = fn()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {WAIT_S:.0f} s waiting for {what}")
        time.sleep(0.25)


@pytest.fixture(scope="module")
def node(pulled_home, hub, tmp_path_factory: pytest.TempPathFactory):
    """A full node with its /metrics: the gRPC node service and prometheus_client's HTTP server."""
    home = tmp_path_factory.mktemp("metrics-node")
    pulled_home("kimi_k3", home)
    node = serving(
        REPO_ID,
        home,
        SECRET,
        node_id="metrics-node",
        store=StoreConfig(prefetch=True),
        metrics=MetricsConfig("127.0.0.1", 0),
    )
    channel = grpc.insecure_channel(node.rpc.address)
    try:
        yield node.model, node_pb2_grpc.NodeStub(channel), node.metrics_server
    finally:
        channel.close()
        node.close()


@pytest.fixture(scope="module")
def prometheus(node):
    """A real Prometheus on a free loopback port, scraping the node every second."""
    binary = _tool("prometheus")
    _, _, served = node
    with tempfile.TemporaryDirectory(prefix="prometheus-") as tmp:
        config = Path(tmp) / "prometheus.yml"
        config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "scrape_configs": [
                        {"job_name": "expertmesh", "static_configs": [{"targets": [f"127.0.0.1:{served.port}"]}]}
                    ],
                }
            )
        )
        port = _free_port()
        log = open(Path(tmp) / "prometheus.log", "wb")
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp}/data",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        base = f"http://127.0.0.1:{port}"
        try:

            def ready() -> bool:
                if proc.poll() is not None:
                    pytest.fail(f"prometheus exited: {(Path(tmp) / 'prometheus.log').read_text()[-2000:]}")
                try:
                    return urllib.request.urlopen(f"{base}/-/ready", timeout=2).status == 200
                except OSError:
                    return False

            _poll(ready, "Prometheus to be ready")
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            log.close()


def _query(base: str, expr: str) -> list[dict]:
    doc = _get_json(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert doc["status"] == "success", (expr, doc)
    return doc["data"]["result"]


@pytest.fixture(scope="module")
def generation(node, prometheus):
    """One greedy gRPC generation while Prometheus watches: (scrape before, scrape after, its summary)."""
    sm, stub, served = node
    # a sample before the generation, so rates over the window see it happen
    _poll(lambda: _query(prometheus, "expertmesh_tokens_generated_total"), "the first scrape of the node")
    before = _samples(_scrape(served.url))
    events = list(
        stub.Generate(
            node_pb2.GenerateRequest(
                model=node_pb2.ModelKey(repo_id=REPO_ID), prompt="hello world", max_tokens=MAX_TOKENS
            ),
            metadata=call_metadata(SECRET),
            timeout=300,
        )
    )
    done = events[-1].done
    after = _samples(_scrape(served.url))
    return before, after, done


def _delta(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after[key] - before.get(key, 0.0)


def test_counters_equal_the_generations_own_summary(generation) -> None:
    before, after, done = generation
    assert done.generated_tokens > 0
    assert _delta(before, after, "expertmesh_tokens_generated_total") == done.generated_tokens
    assert _delta(before, after, "expertmesh_prompt_tokens_total") == done.prompt_tokens
    assert _delta(before, after, "expertmesh_token_seconds_count") == done.generated_tokens
    assert _delta(before, after, "expertmesh_time_to_first_token_seconds_count") == 1
    for s in SOURCES:
        assert _delta(before, after, "expertmesh_expert_requests_total", source=s) == done.expert_uses[s], s
        assert _delta(before, after, "expertmesh_expert_bytes_total", source=s) == done.expert_bytes[s], s
        assert _delta(before, after, "expertmesh_expert_fetch_seconds_count", source=s) == done.expert_uses[s], s
    assert done.expert_uses["hub"] > 0  # a fresh node: the numbers above are not all zeros
    assert after[("expertmesh_cache_experts", (("tier", "disk"),))] > 0


def test_metrics_carry_no_expert_ids_prompts_or_secrets(node, generation) -> None:
    _, _, served = node
    text = _scrape(served.url)
    assert SECRET not in text and "hello world" not in text
    allowed = {"source", "tier", "outcome", "role", "reason", "direction", "le"}
    for fam in text_string_to_metric_families(text):
        if fam.name.startswith("expertmesh_"):
            for sample in fam.samples:
                assert set(sample.labels) <= allowed, (sample.name, sample.labels)


def _dashboard_exprs() -> list[tuple[str, str]]:
    doc = json.loads(DASHBOARD.read_text())
    names = {v["name"] for v in doc["templating"]["list"]}
    assert {"datasource", "instance"} <= names
    out = []
    for panel in doc["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            out.append((panel["title"], target["expr"]))
    return out


@pytest.mark.e2e
def test_every_dashboard_expression_returns_data_from_a_real_prometheus(prometheus, generation) -> None:
    _, after, done = generation
    total = after[("expertmesh_tokens_generated_total", ())]
    _poll(
        lambda: any(float(r["value"][1]) == total for r in _query(prometheus, "expertmesh_tokens_generated_total")),
        "Prometheus to scrape the state after the generation",
    )
    exprs = _dashboard_exprs()
    titles = {t for t, _ in exprs}
    for wanted in (
        "Tokens per second",
        "Token latency",
        "Time to first token",
        "Expert uses by source",
        "Expert bytes by source",
        "Hit ratio by tier",
        "Hub bandwidth",
        "Prefetch accuracy",
        "Speculative acceptance",
        "Peers up",
        "Errors by reason",
    ):
        assert wanted in titles
    for title, expr in exprs:
        # what Grafana substitutes: the window covers this young Prometheus' whole history
        promql = expr.replace("$__rate_interval", "5m").replace("$instance", ".*")

        def finite(promql: str = promql) -> list:
            return [r for r in _query(prometheus, promql) if math.isfinite(float(r["value"][1]))]

        result = _poll(finite, f"data for {title!r}: {promql}")
        if title in (
            "Tokens per second",
            "Token latency",
            "Time to first token",
            "Expert uses by source",
            "Hub bandwidth",
        ):
            assert any(float(r["value"][1]) > 0 for r in result), (title, promql, result)


@pytest.mark.e2e
def test_promtool_accepts_the_config_and_a_scrape(node, generation) -> None:
    promtool = _tool("promtool")
    _, _, served = node
    checked = subprocess.run(
        [promtool, "check", "config", str(PROMETHEUS_YML)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    checked = subprocess.run(
        [promtool, "check", "metrics"], input=_scrape(served.url), capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_deploy_files_reference_what_exists() -> None:
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (ROOT / "deploy" / source).exists(), volume
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/expertmesh.yml").read_text())
    assert provider["providers"][0]["type"] == "file"
    datasource = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["type"] == "prometheus"
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    assert config["scrape_configs"][0]["file_sd_configs"][0]["files"] == ["targets/*.json"]


def test_targets_file_follows_the_advertised_metrics_ports(tmp_path: Path) -> None:
    path = tmp_path / "targets" / "nodes.json"
    cluster = f"metrics-cluster-{os.getpid()}"  # unique: another test run on this machine shares loopback multicast
    watcher = TargetsWatcher(path, cluster, ["127.0.0.1"])
    try:
        assert json.loads(path.read_text()) == []
        ad = Advertisement("metrics-a", cluster, "cache", 1500, 10**9, metrics_port=9555)
        assert "metrics" in ad.properties() and SECRET not in json.dumps(ad.properties())
        node_a = Discovery(PeerTable("metrics-a", 1.0), ad, "127.0.0.1", ["127.0.0.1"])
        try:
            _poll(lambda: json.loads(path.read_text()), "the advertised node in the targets file")
            assert json.loads(path.read_text()) == [
                {"targets": ["127.0.0.1:9555"], "labels": {"node_id": "metrics-a", "role": "cache", "cluster": cluster}}
            ]
        finally:
            node_a.close()
        _poll(lambda: json.loads(path.read_text()) == [], "the node to leave the targets file")
        assert not list(path.parent.glob("*.tmp"))
    finally:
        watcher.close()


class _RepeatDraft:
    """Drafts the last token k times: cheap, deterministic, sometimes right."""

    def propose(self, context: list[int], k: int, temp: float, top_p: float):
        from expertmesh.node.engine.speculative import Draft

        return Draft([context[-1]] * k)


def test_speculative_counters_equal_the_generations_own(node, generation) -> None:
    from expertmesh.node.config import SpeculationConfig
    from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings

    sm, _, served = node
    before = _samples(_scrape(served.url))
    summary = GenerationSummary()
    gen = Generator(sm, SpeculationConfig(mode="ngram"), draft_source=_RepeatDraft())
    list(gen.generate(sm.tokenizer.encode("one two one two"), SamplingSettings(max_tokens=8), summary=summary))
    after = _samples(_scrape(served.url))
    assert summary.speculation.drafted > 0
    assert (
        _delta(before, after, "expertmesh_speculative_tokens_total", outcome="drafted") == summary.speculation.drafted
    )
    assert (
        _delta(before, after, "expertmesh_speculative_tokens_total", outcome="accepted") == summary.speculation.accepted
    )
    assert _delta(before, after, "expertmesh_tokens_generated_total") == summary.generated_tokens
