"""A newcomer's first `pull` and `run` against a Hub that behaves as huggingface.co does
(`expertmesh hub --like-huggingface`, told by the real huggingface_hub client, which raises its typed
errors only for the exact codes and messages the real service sends): small files by a relative 307
that keeps the token, a gated repo pulled and run with HF_TOKEN while the CDN origin never sees it,
signed CDN URLs that expire mid-generation, a used-up resolver quota waited out, a tree listed in
pages, a 200 with exactly the bytes asked, and every refusal one line saying what to do
(expertmesh/devtools/local_hub.py, hub_access.py, hub_quota.py; node/hub/client.py, rate_limit.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx2
import pytest
from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub import errors as hf_errors
from huggingface_hub.utils import parse_ratelimit_headers
from nodes import serving
from prometheus_client import generate_latest
from repos import KIMI_K3

from expertmesh.assembly import open_model
from expertmesh.coordinator.status import status_lines
from expertmesh.devtools.local_hub import Fault, HubServer
from expertmesh.node import doctor
from expertmesh.node.config import StoreConfig
from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings
from expertmesh.node.errors import AuthError, DownloadError, ModelNotFoundError, RateLimitedError
from expertmesh.node.fetching import FetchContext
from expertmesh.node.hub import client as hub_client
from expertmesh.node.hub.pull import pull
from expertmesh.node.hub.rate_limit import GATE
from expertmesh.node.observability.metrics import MetricsSources, NodeMetrics
from expertmesh.node.rpc.client import ask_info

PUBLIC = KIMI_K3
GATED = "expertmesh/gated-kimi_k3"
PRIVATE = "expertmesh/private-kimi_k3"
MISSING = "expertmesh/no-such-model"
GRANTED = "hf_granted_account_token"  # an account that accepted the gated repo's licence and owns the private one
OTHER = "hf_other_account_token"  # an account the Hub knows, with no access to either
UNKNOWN = "hf_unknown_or_revoked_token"  # not a token of any account
SHARD = "model-00001-of-00003.safetensors"
INDEX = "model.safetensors.index.json"
PROMPT = "hello experts"
MAX_TOKENS = 8
GREEDY = SamplingSettings(max_tokens=MAX_TOKENS, temp=0.0, top_p=1.0, seed=None)


@pytest.fixture(scope="module")
def root(tiny_repos: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny K3 as a public repo, a gated copy whose licence GRANTED accepted, and a private copy
    GRANTED owns (the same files: the same commit, so the same oracle)."""
    root = tmp_path_factory.mktemp("like-hf")
    for repo_id in (PUBLIC, GATED, PRIVATE):
        shutil.copytree(tiny_repos["kimi_k3"], root / repo_id)
    (root / GATED / ".hub_gated").write_text(GRANTED + "\n")
    (root / PRIVATE / ".hub_private").write_text(GRANTED + "\n")
    return root


@pytest.fixture
def hub(root: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    GATE.reset()
    with (
        HubServer(root, like_huggingface=True, user_tokens=(GRANTED, OTHER)) as server,
        hub_client.using_endpoint(server.url),
    ):
        yield server
    GATE.reset()


# -- the emulation, told by huggingface_hub's client -----------------------------------------


def _head(hub: HubServer, repo_id: str, name: str, token: str | None = None) -> httpx2.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx2.head(f"{hub.url}/{repo_id}/resolve/main/{name}", headers=headers)


def test_small_files_are_a_relative_307_to_the_resolve_cache_and_large_ones_a_302_to_the_cdn(hub: HubServer) -> None:
    r = _head(hub, PUBLIC, "config.json")
    commit = hub.repos[PUBLIC].commit
    assert r.status_code == 307 and r.headers["location"].startswith(f"/api/resolve-cache/models/{PUBLIC}/{commit}/")
    assert r.headers["x-repo-commit"] == commit and "RateLimit" in r.headers
    r = _head(hub, PUBLIC, SHARD)
    assert r.status_code == 302 and r.headers["location"].startswith(hub.cdn_url_base + "/")
    assert "Expires=" in r.headers["location"] and "Signature=" in r.headers["location"]


def test_the_real_client_downloads_a_gated_repo_with_its_token_and_the_cdn_never_sees_it(
    hub: HubServer, root: Path, tmp_path: Path
) -> None:
    for name in ("config.json", SHARD):
        path = hf_hub_download(GATED, name, cache_dir=tmp_path, endpoint=hub.url, token=GRANTED)
        assert Path(path).read_bytes() == (root / GATED / name).read_bytes()
    stats = hub.stats()
    assert stats["cdn_requests"] >= 1 and stats["cdn_with_token"] == 0


@pytest.mark.parametrize(
    ("repo_id", "token", "error", "status"),
    [
        (MISSING, None, hf_errors.RepositoryNotFoundError, 401),  # the Hub does not tell missing from private
        (MISSING, OTHER, hf_errors.RepositoryNotFoundError, 404),
        (PRIVATE, None, hf_errors.RepositoryNotFoundError, 401),
        (PRIVATE, OTHER, hf_errors.RepositoryNotFoundError, 404),
        (GATED, None, hf_errors.GatedRepoError, 401),
        (GATED, OTHER, hf_errors.GatedRepoError, 403),
        (PUBLIC, UNKNOWN, hf_errors.HfHubHTTPError, 401),
    ],
)
def test_refusals_are_the_errors_huggingface_hub_raises_for_the_real_service(
    hub: HubServer, tmp_path: Path, repo_id: str, token: str | None, error: type, status: int
) -> None:
    with pytest.raises(error) as e:
        hf_hub_download(repo_id, "config.json", cache_dir=tmp_path, endpoint=hub.url, token=token or False)
    assert e.value.response.status_code == status
    if error is hf_errors.HfHubHTTPError:  # an unknown token is not taken for a missing repo
        assert not isinstance(e.value, hf_errors.RepositoryNotFoundError)


def test_a_gated_repo_shows_its_metadata_and_files_to_anyone(hub: HubServer) -> None:
    info = HfApi(endpoint=hub.url, token=False).model_info(GATED)
    assert info.gated == "manual" and info.sha == hub.repos[GATED].commit
    assert "config.json" in HfApi(endpoint=hub.url, token=False).list_repo_files(GATED)


def test_the_tree_is_paged_with_link_headers_and_huggingface_hub_follows_them(hub: HubServer) -> None:
    hub.knobs.tree_page_size = 2
    r = httpx2.get(f"{hub.url}/api/models/{PUBLIC}/tree/main", params={"recursive": "true"})
    assert len(r.json()) == 2 and 'rel="next"' in r.headers["link"]
    listed = HfApi(endpoint=hub.url, token=False).list_repo_files(PUBLIC)
    assert sorted(listed) == sorted(hub.repos[PUBLIC].files)


def test_past_its_quota_a_bucket_answers_429_with_ratelimit_and_no_retry_after(hub: HubServer) -> None:
    hub.knobs.rate_limits = {"resolvers": 2}
    hub.knobs.rate_window_s = 60.0
    assert [_head(hub, PUBLIC, "config.json").status_code for _ in range(2)] == [307, 307]
    r = _head(hub, PUBLIC, "config.json")
    assert r.status_code == 429 and "retry-after" not in r.headers
    info = parse_ratelimit_headers(r.headers)  # huggingface_hub's own reading of it
    assert (info.resource_type, info.remaining, info.limit, info.window_seconds) == ("resolvers", 0, 2, 60)
    assert 0 < info.reset_in_seconds <= 60
    assert httpx2.get(f"{hub.url}/api/models/{PUBLIC}").status_code == 200  # another bucket
    assert _head(hub, PUBLIC, "config.json", GRANTED).status_code == 307  # another account


# -- the range reader against these answers ------------------------------------------------


def test_a_same_origin_redirect_keeps_the_token_and_is_not_remembered(
    hub: HubServer, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: every 3xx was taken for a CDN, so the resolve cache got no token (401 on a gated
    repo) and its URL was remembered as the file's location."""
    monkeypatch.setenv("HF_TOKEN", GRANTED)
    reader = hub_client.RangeReader()
    commit = hub.repos[GATED].commit
    small, shard = hub_client.RemoteFile(GATED, commit, INDEX), hub_client.RemoteFile(GATED, commit, SHARD)
    assert reader.read(small, 0, 64) == (root / GATED / INDEX).read_bytes()[:64]
    assert reader.read(shard, 8, 100) == (root / GATED / SHARD).read_bytes()[8:100]
    assert small not in reader._locations and shard in reader._locations  # only the signed CDN URL
    assert hub.stats()["cdn_with_token"] == 0


def test_a_200_with_exactly_the_asked_bytes_is_taken_and_any_other_200_refused(hub: HubServer, root: Path) -> None:
    """Before: a 200 was always refused, so a CDN answering a small file whole failed every attempt."""
    reader = hub_client.RangeReader(backoff_base_s=0.001, max_retries=1)
    commit = hub.repos[PUBLIC].commit
    whole = (root / PUBLIC / SHARD).read_bytes()
    hub.knobs.faults = [Fault("ignore_range", count=1)]
    data, size = reader.read_with_size(hub_client.RemoteFile(PUBLIC, commit, SHARD), 0, len(whole) + 100)
    assert data == whole and size == len(whole) and reader.retries == 0
    hub.knobs.faults = [Fault("ignore_range", count=2)]  # a range within the file: a 200 is not it
    with pytest.raises(DownloadError, match="ignored the Range header"):
        reader.read(hub_client.RemoteFile(PUBLIC, commit, SHARD), 0, 100)


# -- pull and run through it -------------------------------------------------------------


def _generate(repo_id: str, home: Path, store: StoreConfig, between=lambda n: None) -> list[int]:
    """Greedy tokens of PROMPT; `between(n)` runs after the n-th token."""
    sm = open_model(repo_id, home=home, store=store)
    try:
        ids = sm.tokenizer.encode(PROMPT)
        made: list[int] = []

        def should_stop() -> bool:
            between(len(made))
            return False

        for t in Generator(sm).generate(ids, GREEDY, should_stop, GenerationSummary()):
            made.append(t.id)
        return made
    finally:
        sm.close()


def _oracle_tokens(oracle) -> list[int]:
    """What mlx-lm makes of the same weights (the three repos hold the same files)."""
    _, tokenizer = oracle.load("kimi_k3")
    return oracle.tokens("kimi_k3", tokenizer.encode(PROMPT), MAX_TOKENS)


def test_a_gated_repo_pulls_and_generates_with_hf_token_and_the_cdn_never_sees_it(
    hub: HubServer, oracle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the index, a small file, came by a same-origin 307 that the reader took for a CDN,
    so it dropped the token and the pull failed with "CDN refused the signed URL (HTTP 401)"."""
    monkeypatch.setenv("HF_TOKEN", GRANTED)
    pull(GATED, home=tmp_path, progress=False)
    tokens = _generate(GATED, tmp_path, StoreConfig(prefetch=False, fill=False))
    assert tokens == _oracle_tokens(oracle)  # what mlx-lm makes of the same, public, weights
    stats = hub.stats()
    assert stats["cdn_requests"] > 0 and stats["cdn_with_token"] == 0

    checks = {c.name: c for c in doctor.hub(tmp_path)}  # what the Hub announced to doctor's own requests
    assert checks["models"].status == "ok" and checks["quota"].status == "ok", checks
    assert re.search(r"resolvers [\d,]+ of 3,000 left \(resets in \d+ s\)", checks["quota"].detail), checks["quota"]


def test_signed_urls_that_expire_mid_generation_are_resolved_again(hub: HubServer, oracle, tmp_path: Path) -> None:
    pull(PUBLIC, home=tmp_path, progress=False)
    # no disk and a one-byte RAM tier: every token fetches its experts from the Hub again
    store = StoreConfig(prefetch=False, fill=False, ram_budget="1", disk_budget="0")
    expired_at: list[int] = []

    def expire_after_the_second_token(n: int) -> None:
        if n == 2 and not expired_at:
            hub.expire_cdn_urls()  # as if the clock passed every Expires handed out so far
            expired_at.append(hub.stats()["cdn_expired"])

    tokens = _generate(PUBLIC, tmp_path, store, expire_after_the_second_token)
    assert tokens == _oracle_tokens(oracle)
    assert expired_at == [0] and hub.stats()["cdn_expired"] >= 1  # a remembered URL was refused, then replaced


def test_a_used_up_resolver_quota_is_waited_out_by_a_pull_and_a_run(
    hub: HubServer, oracle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Windows of one second (the Hub's are five minutes) and a quota a pull needs three of (it
    makes 17 resolver requests): the 429s close the process's one gate, every request waits for the
    window to reopen, and the pull and the generation finish. Before: each request backed off
    alone and gave up."""
    monkeypatch.setattr(GATE, "margin_s", 0.2)  # the Hub's `t` is whole seconds, the emulation's exact
    hub.knobs.rate_window_s = 1.0
    hub.knobs.rate_limits = {"resolvers": 6, "api": 500}
    pull(PUBLIC, home=tmp_path, progress=False)
    assert hub.stats()["rate_limited"]["resolvers"] >= 1 and GATE.limited["resolvers"] >= 1
    limited = hub.stats()["rate_limited"]["resolvers"]

    hub.knobs.rate_limits = {"resolvers": 1, "api": 500}  # a run resolves each of the 3 shards once
    tokens = _generate(PUBLIC, tmp_path, StoreConfig(prefetch=False, fill=False))
    assert tokens == _oracle_tokens(oracle)
    assert hub.stats()["rate_limited"]["resolvers"] > limited
    text = generate_latest(NodeMetrics(MetricsSources()).registry).decode()
    assert 'expertmesh_hub_rate_limited_total{bucket="resolvers"}' in text
    waited = next(
        line
        for line in text.splitlines()
        if line.startswith('expertmesh_hub_rate_limit_wait_seconds_total{bucket="resolvers"}')
    )
    assert float(waited.split()[-1]) > 0

    # `status` shows the window the Hub is in now: a one-second window can end while the node below
    # starts on a loaded machine, so go back to windows that outlive the test, and make one request
    hub.knobs.rate_window_s = 300.0
    hub.knobs.rate_limits = {"resolvers": 2, "api": 500}
    hub.quotas.reset()  # the Hub's next window is then a long one
    assert HfApi().file_exists(PUBLIC, "config.json")  # a git file: a resolve and its resolve-cache
    node = serving(PUBLIC, tmp_path, "status-secret", node_id="quota-node")  # `status` asks nodes for Info
    try:
        lines = status_lines(ask_info([node.rpc.address], "status-secret"))
    finally:
        node.close()
    shown = next(line for line in lines if line.startswith("quota-node: Hub requests this rate-limit window"))
    assert re.search(r"resolvers \d+ of 2\b", shown), lines


def test_a_wait_beyond_the_fetch_deadline_is_one_error_naming_the_bucket_the_wait_and_the_fix(
    hub: HubServer,
) -> None:
    hub.knobs.rate_window_s = 600.0
    hub.knobs.rate_limits = {"resolvers": 0}
    reader = hub_client.RangeReader(fetch_deadline_s=5.0)
    commit = hub.repos[PUBLIC].commit
    remote = hub_client.RemoteFile(PUBLIC, commit, "model-00001-of-00003.safetensors")
    out = memoryview(bytearray(16))
    with pytest.raises(RateLimitedError) as e:
        reader.read_into(remote, 0, 16, out, FetchContext(deadline=reader.deadline()))
    message = str(e.value)
    assert "'resolvers' rate limit is used up" in message and "reopens in 10 min" in message
    assert "log in for a larger quota" in message and "\n" not in message
    assert hub.stats()["rate_limited"] == {"resolvers": 1}  # one request: the gate answered the rest


def test_shards_are_listed_from_the_paged_tree_not_from_siblings(hub: HubServer, tmp_path: Path) -> None:
    """Before: the files came from model_info's `siblings`, which the Hub may cut short."""
    hub.knobs.siblings_limit = 1
    hub.knobs.tree_page_size = 2
    result = pull(PUBLIC, home=tmp_path, progress=False)
    assert result.expert_count > 0 and result.core_bytes > 0


@pytest.mark.parametrize(
    ("repo_id", "token", "error", "says"),
    [
        (MISSING, None, ModelNotFoundError, "was not found at .*: check the name; if it is private, log in"),
        (MISSING, OTHER, ModelNotFoundError, "or the account of the token from HF_TOKEN cannot see it"),
        (PRIVATE, None, ModelNotFoundError, "if it is private, log in"),
        (GATED, None, AuthError, r"is gated: log in \(`hf auth login`, or set HF_TOKEN\) and accept its licence at"),
        (GATED, OTHER, AuthError, "has no access yet: accept its licence at http://.*/expertmesh/gated-kimi_k3"),
        (PUBLIC, UNKNOWN, AuthError, "does not accept the token from HF_TOKEN .invalid or expired.: set HF_TOKEN"),
    ],
)
def test_each_refusal_is_one_line_saying_what_to_do(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, repo_id: str, token, error: type, says: str
) -> None:
    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    with pytest.raises(error, match=says) as e:
        pull(repo_id, home=tmp_path, progress=False)
    assert "\n" not in str(e.value) and (token is None or token not in str(e.value))


@pytest.mark.e2e
def test_the_cli_prints_the_gated_refusal_on_one_line(hub: HubServer, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    env.update(EXPERTMESH_HOME=str(tmp_path), HF_ENDPOINT=hub.url)
    r = subprocess.run(
        [sys.executable, "-m", "expertmesh", "pull", GATED, "--no-progress"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "is gated: log in" in lines[0], r.stderr
