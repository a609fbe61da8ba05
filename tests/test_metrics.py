"""Metrics you can trust: a real Prometheus (Debian's package) scrapes a real node during a gRPC
generation on the tiny Kimi K3; every PromQL expression of the Grafana dashboard returns data; the
counters equal the generation's own summary; promtool accepts the config and a scrape; the
targets file follows the metrics ports that nodes advertise over zeroconf; Prometheus fed by
`expertmesh prometheus-targets` shows each node's own view of its peers' roles, and idle ratio
panels no data; the API's counts come through the node's own target; and `run --metrics-port`
keeps serving its final counts until they are scraped."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from repos import KIMI_K3
from waiting import wait_until

from expertmesh.assembly import Node, build_node
from expertmesh.coordinator.api_metrics import LABELS as API_LABELS
from expertmesh.node.config import (
    ApiConfig,
    HouseholdConfig,
    MetricsConfig,
    NodeConfig,
    RpcConfig,
    SpeculationConfig,
    StoreConfig,
)
from expertmesh.node.household.discovery import Advertisement, Discovery
from expertmesh.node.household.membership import PeerTable
from expertmesh.node.observability.metrics import LABELS as NODE_LABELS
from expertmesh.node.observability.metrics import MetricsSources, NodeMetrics
from expertmesh.node.observability.prometheus_targets import TARGET_LABELS, TargetsWatcher
from expertmesh.node.rpc.auth import call_metadata, node_method
from expertmesh.node.store.stats import SOURCES
from expertmesh.v1 import node_pb2, node_pb2_grpc

SECRET = "metrics-test-household-secret"
ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "expertmesh.json"
PROMETHEUS_YML = ROOT / "deploy" / "prometheus" / "prometheus.yml"
MAX_TOKENS = 12
WAIT_S = 60.0  # every poll below gives up after this long
CLI = [sys.executable, "-m", "expertmesh"]


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
def node(module_home: Path):
    """A full node with its /metrics: the gRPC node service, the API and prometheus_client's
    WSGI app: (model, gRPC stub, metrics server, API URL)."""
    config = NodeConfig(
        KIMI_K3,
        home=module_home,
        node_id="metrics-node",
        store=StoreConfig(prefetch=True),
        household=HouseholdConfig(secret=SECRET),
        rpc=RpcConfig("127.0.0.1", 0),
        metrics=MetricsConfig("127.0.0.1", 0),
        api=ApiConfig("127.0.0.1", 0),
    )
    node = build_node(config).start()
    channel = grpc.insecure_channel(node.rpc.address)
    try:
        yield node.model, node_pb2_grpc.NodeStub(channel), node.metrics_server, node.api.url
    finally:
        channel.close()
        node.close()


@contextlib.contextmanager
def _running_prometheus(config: dict, folder: Path) -> Iterator[str]:
    """A real Prometheus on a free loopback port with `config` written to `folder`/prometheus.yml
    (relative paths in it are relative to `folder`); yields its base URL."""
    binary = _tool("prometheus")
    path = folder / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    port = _free_port()
    log_path = folder / "prometheus.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={path}",
                f"--storage.tsdb.path={folder}/data",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        base = f"http://127.0.0.1:{port}"
        try:

            def ready() -> bool:
                if proc.poll() is not None:
                    pytest.fail(f"prometheus exited: {log_path.read_text()[-2000:]}")
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


@pytest.fixture(scope="module")
def prometheus(node):
    """A real Prometheus scraping the node every second."""
    served = node[2]
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "expertmesh", "static_configs": [{"targets": [f"127.0.0.1:{served.port}"]}]}],
    }
    with tempfile.TemporaryDirectory(prefix="prometheus-") as tmp:
        with _running_prometheus(config, Path(tmp)) as base:
            yield base


def _query(base: str, expr: str) -> list[dict]:
    doc = _get_json(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert doc["status"] == "success", (expr, doc)
    return doc["data"]["result"]


@pytest.fixture(scope="module")
def generation(node, prometheus):
    """One greedy gRPC generation while Prometheus watches, and one API request: (scrape before,
    scrape after, its summary)."""
    sm, stub, served, api_url = node
    # a sample before the generation, so rates over the window see it happen
    _poll(lambda: _query(prometheus, "expertmesh_tokens_generated_total"), "the first scrape of the node")
    before = _samples(_scrape(served.url))
    assert _get_json(f"{api_url}/models")["data"][0]["id"] == KIMI_K3
    events = list(
        stub.Generate(
            node_pb2.GenerateRequest(
                model=node_pb2.ModelKey(repo_id=KIMI_K3), prompt="hello world", max_tokens=MAX_TOKENS
            ),
            metadata=call_metadata(SECRET, node_method("Generate")),
            timeout=300,
        )
    )
    done = events[-1].done
    after = _samples(_scrape(served.url))
    return before, after, done


def _delta(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after[key] - before.get(key, 0.0)


@pytest.mark.e2e
def test_counters_equal_the_generations_own_summary(generation) -> None:
    before, after, done = generation
    assert done.generated_tokens > 0
    assert _delta(before, after, "expertmesh_tokens_generated_total") == done.generated_tokens
    # prompt_tokens counts only what was fed; what a stored prefix held is counted as reused
    assert _delta(before, after, "expertmesh_prompt_tokens_total") == done.prompt_tokens - done.cached_tokens
    assert _delta(before, after, "expertmesh_prompt_tokens_reused_total") == done.cached_tokens
    assert (
        _delta(before, after, "expertmesh_prefix_cache_lookups_total", outcome="hit" if done.cached_tokens else "miss")
        == 1
    )
    assert _delta(before, after, "expertmesh_token_seconds_count") == done.generated_tokens
    assert _delta(before, after, "expertmesh_time_to_first_token_seconds_count") == 1
    for s in SOURCES:
        assert _delta(before, after, "expertmesh_expert_requests_total", source=s) == done.expert_uses[s], s
        assert _delta(before, after, "expertmesh_expert_fetch_seconds_count", source=s) == done.expert_uses[s], s
        if s != "remote":  # moves activations, not experts: expertmesh_activation_bytes_total
            assert _delta(before, after, "expertmesh_expert_bytes_total", source=s) == done.expert_bytes[s], s
    assert ("expertmesh_expert_bytes_total", (("source", "remote"),)) not in after
    assert done.expert_uses["hub"] > 0  # a fresh node: the numbers above are not all zeros
    assert after[("expertmesh_cache_experts", (("tier", "disk"),))] > 0


@pytest.mark.e2e
def test_metrics_carry_no_expert_ids_prompts_or_secrets(node, generation) -> None:
    served = node[2]
    text = _scrape(served.url)
    assert SECRET not in text and "hello world" not in text
    allowed = set(NODE_LABELS) | set(API_LABELS)
    for fam in text_string_to_metric_families(text):
        if fam.name.startswith("expertmesh_"):
            for sample in fam.samples:
                assert set(sample.labels) <= allowed, (sample.name, sample.labels)


@pytest.mark.e2e
def test_no_metric_label_is_a_target_label(node, generation) -> None:
    """Prometheus renames a scraped label that a target label shares (`role` -> `exported_role`)."""
    text = _scrape(node[2].url)
    used = {name for fam in text_string_to_metric_families(text) for s in fam.samples for name in s.labels}
    assert {"role", "endpoint", "code", "state"} <= used  # the node's and the API's labels are all here
    assert not used & ({"job", "instance"} | set(TARGET_LABELS)), used


@pytest.mark.e2e
def test_api_metrics_come_through_the_nodes_own_target(node, prometheus, generation) -> None:
    """Prometheus scrapes only the node's /metrics port, and sees the API's responses and queue."""
    served = node[2]
    instance = f"127.0.0.1:{served.port}"

    def seen() -> list:
        return _query(prometheus, 'expertmesh_api_responses_total{endpoint="/v1/models", code="200"}')

    (got,) = _poll(seen, "the API's response counter in Prometheus")
    assert got["metric"]["instance"] == instance and float(got["value"][1]) >= 1
    states = {r["metric"]["state"]: float(r["value"][1]) for r in _query(prometheus, "expertmesh_api_generations")}
    assert states == {"running": 0.0, "waiting": 0.0}


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
def test_every_dashboard_expression_returns_data_from_a_real_prometheus(prometheus, generation, speculated) -> None:
    _, after, _ = speculated
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
        "API responses by code",
        "API generations",
        "Hub rate limits",
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
    served = node[2]
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
                {
                    "targets": ["127.0.0.1:9555"],
                    "labels": {"node_id": "metrics-a", "node_role": "cache", "node_cluster": cluster},
                }
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


@pytest.fixture(scope="module")
def speculated(node, generation):
    """After `generation`, a speculative one in this process (scripted drafts, so some are
    accepted and some not): (scrape before, scrape after, its summary)."""
    from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings

    sm, _, served, _ = node
    before = _samples(_scrape(served.url))
    summary = GenerationSummary()
    gen = Generator(sm, SpeculationConfig(mode="ngram"), draft_source=_RepeatDraft())
    list(gen.generate(sm.tokenizer.encode("one two one two"), SamplingSettings(max_tokens=8), summary=summary))
    return before, _samples(_scrape(served.url)), summary


@pytest.mark.e2e
def test_speculative_counters_equal_the_generations_own(speculated) -> None:
    before, after, summary = speculated
    assert summary.speculation.drafted > 0
    assert (
        _delta(before, after, "expertmesh_speculative_tokens_total", outcome="drafted") == summary.speculation.drafted
    )
    assert (
        _delta(before, after, "expertmesh_speculative_tokens_total", outcome="accepted") == summary.speculation.accepted
    )
    assert _delta(before, after, "expertmesh_tokens_generated_total") == summary.generated_tokens


# -- a household under `expertmesh prometheus-targets` -----------------------------------------


def _household_node(home: Path, node_id: str, cluster: str, cache_only: bool) -> Node:
    """A node as `serve` makes it: gRPC, /metrics, and zeroconf on loopback in `cluster`."""
    config = NodeConfig(
        KIMI_K3,
        home=home,
        node_id=node_id,
        cache_only=cache_only,
        household=HouseholdConfig(secret=SECRET, discover=True, cluster=cluster, interface="127.0.0.1"),
        rpc=RpcConfig("127.0.0.1", 0),
        metrics=MetricsConfig("127.0.0.1", 0),
    )
    return build_node(config).start()


@pytest.fixture(scope="module")
def household(pulled_home, hub, tmp_path_factory: pytest.TempPathFactory):
    """Two full nodes and a cache peer found by zeroconf, `expertmesh prometheus-targets` following
    them, and a real Prometheus reading its file through deploy/prometheus/prometheus.yml (scrape
    and refresh intervals shortened): (Prometheus URL, {node id: (role, instance)})."""
    cluster = f"metrics-roles-{os.getpid()}"  # unique: another test run on this machine shares loopback multicast
    roles = {"roles-full-a": "full", "roles-full-b": "full", "roles-cache": "cache"}
    folder = tmp_path_factory.mktemp("prometheus-household")
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["scrape_configs"][0]["file_sd_configs"][0]["refresh_interval"] = "1s"
    targets = folder / "targets" / "nodes.json"
    env = {**os.environ, "EXPERTMESH_HOME": str(folder / "home")}
    with contextlib.ExitStack() as stack:
        nodes = {}
        for node_id, role in roles.items():
            home = pulled_home("kimi_k3", tmp_path_factory.mktemp(node_id))
            nodes[node_id] = stack.enter_context(_household_node(home, node_id, cluster, role == "cache"))
        follower = subprocess.Popen(
            [*CLI, "prometheus-targets", str(targets), "--cluster", cluster, "--interface", "127.0.0.1"],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )

        def stop_follower() -> None:
            follower.send_signal(signal.SIGINT)  # what Ctrl-C sends: it says how many nodes it followed
            try:
                follower.communicate(timeout=WAIT_S)
            except subprocess.TimeoutExpired:
                follower.kill()
                follower.communicate()

        stack.callback(stop_follower)
        base = stack.enter_context(_running_prometheus(config, folder))
        for n in nodes.values():
            _poll(lambda n=n: n.peers.live_count() == len(nodes) - 1, f"{n.node_id} to find the other nodes")
        yield base, {node_id: (roles[node_id], f"127.0.0.1:{n.metrics_server.port}") for node_id, n in nodes.items()}


@pytest.mark.e2e
def test_prometheus_fed_by_prometheus_targets_reports_each_peers_role(household) -> None:
    """Each node's `expertmesh_peers{role}` keeps the roles of the peers it sees, not its own."""
    base, nodes = household

    def scraped() -> list[dict] | None:
        results = _query(base, "expertmesh_peers")
        peers: dict[str, float] = {}
        for r in results:
            peers[r["metric"]["instance"]] = peers.get(r["metric"]["instance"], 0.0) + float(r["value"][1])
        return results if peers == {instance: len(nodes) - 1 for _, instance in nodes.values()} else None

    seen: dict[str, dict[str, float]] = {}
    for r in _poll(scraped, "Prometheus to scrape every node's view of the household"):
        seen.setdefault(r["metric"]["instance"], {})[r["metric"].get("role", "?")] = float(r["value"][1])
    for node_id, (role, instance) in nodes.items():
        others = [r for other, (r, _) in nodes.items() if other != node_id]
        assert seen[instance] == {r: float(others.count(r)) for r in ("full", "cache")}, (node_id, role)
    for r in _query(base, "expertmesh_peers"):
        node_id = r["metric"]["node_id"]
        assert r["metric"]["node_role"] == nodes[node_id][0] and r["metric"]["instance"] == nodes[node_id][1]
    renamed = [
        r["metric"] for r in _query(base, '{__name__=~"expertmesh_.+"}') if any("exported_" in k for k in r["metric"])
    ]
    assert not renamed
    # the dashboard's "Peers up" on the cache peer: the two full nodes it sees
    (expr,) = [e for t, e in _dashboard_exprs() if t == "Peers up"]
    cache_instance = nodes["roles-cache"][1]
    panel = _query(base, expr.replace("$instance", cache_instance.replace(".", "\\\\.")))
    assert {r["metric"]["role"]: float(r["value"][1]) for r in panel} == {"full": 2.0, "cache": 0.0}


@pytest.mark.e2e
def test_idle_ratio_panels_show_no_data(household) -> None:
    """Nodes that generated nothing: ratio panels have no sample (Grafana's "no data"), not 0."""
    base, nodes = household
    window = "5m"
    _poll(
        lambda: len(_query(base, f"rate(expertmesh_prefetch_total{{outcome='used'}}[{window}])")) == len(nodes),
        "two scrapes of every node, so rates exist",
    )
    idle = ("Prefetch accuracy", "Speculative acceptance", "Hit ratio by tier")
    checked = 0
    for title, expr in _dashboard_exprs():
        promql = expr.replace("$__rate_interval", window).replace("$instance", ".*")
        if title in idle and " / " in expr:
            assert _query(base, promql) == [], (title, promql)
            # the same panels' numerators do answer: 0 per second, nothing happening
            values = [float(r["value"][1]) for r in _query(base, promql.split(" / ")[0])]
            assert values and all(v == 0 for v in values), (title, values)
            checked += 1
    assert checked == len(idle)


# -- `run --metrics-port` -----------------------------------------------------------------------


def _summary_counts(stderr: str) -> tuple[int, dict[str, int]]:
    """(tokens generated, expert uses by source) from `run`'s summary."""
    first = next(ln for ln in stderr.splitlines() if " tokens in " in ln)
    tokens = int(first.split()[0])
    line = next(ln for ln in stderr.splitlines() if "expert uses by source" in ln)
    uses = {}
    for part in line.split(":", 1)[1].split(";")[0].split(","):
        words = part.split()
        uses[words[0]] = int(words[1])
    return tokens, uses


@pytest.mark.e2e
def test_run_keeps_serving_its_final_counts_until_scraped(pulled_home, hub, tmp_path: Path) -> None:
    home = pulled_home("kimi_k3", tmp_path / "home")
    env = {**os.environ, "EXPERTMESH_HOME": str(home), "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_TELEMETRY": "1"}
    # a linger far longer than the test may wait: only the scrape below can end it in time
    args = ["run", KIMI_K3, "hello world", "--max-tokens", "8", "--metrics-port", "0", "--metrics-linger", "3600"]
    proc = subprocess.Popen([*CLI, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stderr:  # ends when it exits: then the assertion below says why
            lines.append(line)
            if line.startswith("keeping ") and "until it is scraped" in line:
                break
        stderr = "".join(lines)
        assert lines and lines[-1].startswith("keeping "), stderr
        url = next(ln.split()[-1] for ln in lines if ln.startswith("metrics on "))
        tokens, uses = _summary_counts(stderr)
        assert tokens == 8 and uses["hub"] > 0
        # the generation is over and the process is still serving /metrics: its final counts
        scraped = _samples(_scrape(url))
        assert scraped[("expertmesh_tokens_generated_total", ())] == tokens
        for source, n in uses.items():
            assert scraped[("expertmesh_expert_requests_total", (("source", source),))] == n, source
        out, rest = proc.communicate(timeout=WAIT_S)  # that scrape ended the linger
        assert proc.returncode == 0, stderr + rest
        assert "was not scraped" not in rest
        assert out.strip()  # the text, on stdout as always
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_linger_stops_at_its_bound_when_nobody_scrapes() -> None:
    """`run` on a machine without Prometheus still ends: the linger is bounded."""
    server = NodeMetrics(MetricsSources()).serve("127.0.0.1", 0)
    try:
        assert server.linger(0.2) is False
        assert server.linger(0) is False
        assert "expertmesh_tokens_generated_total" in _scrape(server.url)  # served until stopped
    finally:
        server.stop()


def test_a_scrape_sent_on_the_linger_announcement_ends_it() -> None:
    """`run` prints "keeping … until it is scraped" and a scraper may answer it at once. The
    scrapes that count were marked after that line, so a scrape quick enough to begin first did
    not count and `run` waited out its whole linger (an hour in the e2e test above, which failed
    about half the time once the node's own threads kept this one from the GIL)."""
    server = NodeMetrics(MetricsSources()).serve("127.0.0.1", 0)
    try:
        # the scrape is answered before linger waits: only a mark taken before announcing counts it
        assert server.linger(30, announce=lambda: _scrape(server.url)) is True
    finally:
        server.stop()


def test_idle_connections_to_metrics_cannot_take_a_thread_each() -> None:
    """/metrics needs no key and `serve` listens on the LAN: 400 connections that sent half a
    request held 400 threads for ever (found by an audit). Now at most METRICS_CONNECTIONS are
    served at once (the rest are closed at once), and a scrape is answered once they go."""
    import threading

    from expertmesh.node.observability.metrics import METRICS_CONNECTIONS, METRICS_READ_TIMEOUT_S

    def answered() -> bool:
        try:
            return "expertmesh_tokens_generated_total" in _scrape(server.url)
        except OSError:  # closed at once while every slot is still taken
            return False

    server = NodeMetrics(MetricsSources()).serve("127.0.0.1", 0)
    idle = []
    try:

        def ours(t: threading.Thread) -> bool:
            """A thread serving a connection to this server: other servers of the session (a real
            Prometheus scraping an earlier fixture's node) start threads of the same name."""
            args = getattr(t, "_args", ())
            try:
                return bool(args) and args[0].getsockname()[1] == server.port
            except (OSError, AttributeError, IndexError, TypeError):
                return False

        def serving() -> int:  # the server's threads, one per connection it serves
            return sum("process_request_thread" in t.name and ours(t) for t in threading.enumerate())

        # one at a time, each waited for: a burst would overflow the listen backlog, and the kernel
        # then retries dropped connections for seconds
        base = serving()
        for n in range(1, METRICS_CONNECTIONS + 1):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            s.sendall(b"GET /metrics HTTP/1.1\r\n")  # and nothing more
            idle.append(s)
            assert wait_until(lambda n=n: serving() - base == n, timeout_s=10, interval_s=0.002), n  # a thread each
        for _ in range(8):  # every slot taken: closed at once (the old server held a thread each, for ever)
            # well before the read timeout, which would close a connection served by a thread too
            with socket.create_connection(("127.0.0.1", server.port), timeout=METRICS_READ_TIMEOUT_S / 2) as s:
                s.sendall(b"GET /metrics HTTP/1.1\r\n")
                with contextlib.suppress(ConnectionResetError):
                    assert s.recv(1) == b""  # the server's close, not a timeout
            assert serving() - base == METRICS_CONNECTIONS
        for s in idle:
            s.close()
        idle.clear()
        assert wait_until(answered, timeout_s=30)
    finally:
        for s in idle:
            s.close()
        server.stop()
