"""`expertmesh pull` through `expertmesh hub`: only the core crosses the link, exactly, resumably."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from repos import KIMI_K3, QWEN3_MOE

from expertmesh.devtools.local_hub import Fault, HubServer
from expertmesh.devtools.tiny import ARCHS
from expertmesh.node.errors import AuthError, EndpointUnreachableError, ModelNotFoundError, UnsupportedModelError
from expertmesh.node.hub import client as hub_client
from expertmesh.node.hub.pull import pull
from expertmesh.node.model import safetensors_format
from expertmesh.node.model.expert_index import INDEX_FILENAME, ExpertIndex


def _reset(hub: HubServer, faults: list[Fault] | None = None) -> None:
    with hub.stats_.lock:
        hub.stats_.reset()
    hub.knobs.faults = faults or []


def _expert_bytes_served(hub: HubServer, repo: Path, repo_id: str) -> int:
    """Bytes of routed experts the hub sent, from its per-range stats and the repo's headers."""
    spans = []
    for shard in repo.glob("*.safetensors"):
        for e in safetensors_format.read_header(shard).values():
            if ".experts." in e.name or "switch_mlp" in e.name:
                spans.append((shard.name, e.start, e.end))
    served = 0
    for key, entry in hub.stats()["files"].items():
        for a, b, n in entry["ranges"]:
            for shard, s, e in spans:
                if key == f"{repo_id}/{shard}":
                    served += n * max(0, min(b + 1, e) - max(a, s))
    return served


@pytest.mark.parametrize("arch", list(ARCHS))
def test_pull_with_faults_fetches_only_the_core(
    arch: str, hub: HubServer, tiny_repos: dict[str, Path], tmp_path: Path
) -> None:
    repo = tiny_repos[arch]
    repo_id = f"expertmesh/{repo.name}"
    _reset(
        hub,
        [
            Fault("429", count=2, retry_after_s=0),
            Fault("503", count=1, retry_after_s=0),
            Fault("500", count=1),
            Fault("cut", count=3, path_glob="*.safetensors"),
        ],
    )
    result = pull(repo_id, home=tmp_path, progress=False)
    stats = hub.stats()
    assert sum(stats["faults"].values()) >= 5  # the faults really happened
    assert _expert_bytes_served(hub, repo, repo_id) == 0
    assert result.retries >= 3  # the cut and the ignored range hit core ranges and were retried
    # every core tensor is byte-identical to the original
    index = ExpertIndex.load(result.path / INDEX_FILENAME)
    assert len(index.experts) >= 4 * 32
    for shard in {t.file for t in index.core.values()}:
        local = safetensors_format.read_header(result.path / shard)
        original = (repo / shard).read_bytes()
        pulled = (result.path / shard).read_bytes()
        for name, e in local.items():
            src = index.core[name]
            assert pulled[e.start : e.end] == original[src.start : src.end], name
        assert not any(".experts." in n for n in local)
    assert result.fetched_bytes == index.core_bytes
    again = pull(repo_id, home=tmp_path, progress=False)
    assert again.already_complete and again.fetched_bytes == 0


def test_ignored_range_is_retried_never_used(hub: HubServer, tiny_repos: dict[str, Path]) -> None:
    """A 200 carrying the whole shard is refused; the retry gets exactly the range."""
    _reset(hub, [Fault("ignore_range", count=2)])
    reader = hub_client.RangeReader(backoff_base_s=0.01)
    remote = hub_client.RemoteFile(QWEN3_MOE, hub.repos[QWEN3_MOE].commit, "model-00001-of-00002.safetensors")
    data = reader.read(remote, 100, 300)
    assert data == (tiny_repos["qwen3_moe"] / remote.filename).read_bytes()[100:300]
    assert reader.retries == 2 and hub.stats()["faults"] == {"ignore_range": 2}


@pytest.mark.e2e
def test_killed_pull_resumes_and_fetches_less(
    hub: HubServer, hub_root: Path, tiny_repos: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kill -9 part-way through a slow pull, then pull again: same bytes, fewer fetched."""
    from expertmesh.node import constants

    monkeypatch.setattr(constants, "MAX_RANGE_BYTES", 32 * 1024)  # as in the killed process
    repo_id = KIMI_K3
    _reset(hub)
    hub.knobs.bandwidth_bytes_per_s = 400_000  # ≈ 2 s for the core, so the kill lands mid-way
    env = {**os.environ, "EXPERTMESH_HOME": str(tmp_path), "HF_ENDPOINT": hub.url}
    code = (
        "import sys; from expertmesh.node import constants; constants.MAX_RANGE_BYTES = 32 * 1024; "
        "from expertmesh.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "pull", repo_id, "--no-progress", "--concurrency", "2"], env=env
    )
    try:
        deadline = time.monotonic() + 30
        parts = tmp_path / "models" / "expertmesh--tiny-kimi_k3"
        while time.monotonic() < deadline and len(list(parts.rglob("*.part"))) < 4:
            time.sleep(0.05)
        proc.kill()
        proc.wait(10)
    finally:
        hub.knobs.bandwidth_bytes_per_s = 0
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, "the pull finished before it could be killed"
    first = hub.stats()["bytes_served"]
    _reset(hub)
    result = pull(repo_id, home=tmp_path, progress=False)
    assert 0 < result.fetched_bytes < result.core_bytes
    index = ExpertIndex.load(result.path / INDEX_FILENAME)
    original = {p.name: p.read_bytes() for p in tiny_repos["kimi_k3"].glob("*.safetensors")}
    for shard in {t.file for t in index.core.values()}:
        local = safetensors_format.read_header(result.path / shard)
        pulled = (result.path / shard).read_bytes()
        for name, e in local.items():
            src = index.core[name]
            assert pulled[e.start : e.end] == original[shard][src.start : src.end]
    assert first > 0
    assert not list(result.path.rglob("*.part"))


def test_bad_inputs_give_clear_errors(hub: HubServer, hub_root: Path, tmp_path: Path, monkeypatch) -> None:
    _reset(hub)
    with pytest.raises(ModelNotFoundError, match="was not found at"):
        pull("expertmesh/does-not-exist", home=tmp_path, progress=False)
    with pytest.raises(ModelNotFoundError, match="revision"):
        pull(KIMI_K3, revision="v9", home=tmp_path, progress=False)
    # every retry still made, without the jittered backoff between them (seconds in all)
    monkeypatch.setattr(hub_client, "retrying", functools.partial(hub_client.retrying, backoff_max_s=0.0))
    with hub_client.using_endpoint("http://127.0.0.1:9"), pytest.raises(EndpointUnreachableError):
        pull(KIMI_K3, home=tmp_path, progress=False)


def test_unsupported_and_dense_models(hub_root: Path, tiny_repos: dict[str, Path], tmp_path: Path) -> None:
    import json
    import shutil

    root = tmp_path / "hub"
    weird = root / "other" / "unknown-arch"
    shutil.copytree(tiny_repos["qwen3_moe"], weird)
    cfg = json.loads((weird / "config.json").read_text())
    (weird / "config.json").write_text(json.dumps({**cfg, "model_type": "no_such_arch"}))
    dense = root / "other" / "dense"
    dense.mkdir(parents=True)
    (dense / "config.json").write_text(json.dumps({"model_type": "llama"}))
    safetensors_format.write_file(
        dense / "model.safetensors", [("model.layers.0.mlp.up_proj.weight", "F32", (2,), b"\0" * 8)]
    )
    with HubServer(root) as server, hub_client.using_endpoint(server.url):
        with pytest.raises(UnsupportedModelError, match="not implemented by mlx-lm"):
            pull("other/unknown-arch", home=tmp_path / "home", progress=False)
        with pytest.raises(UnsupportedModelError, match="no routed experts"):
            pull("other/dense", home=tmp_path / "home", progress=False)


def test_rejected_token(hub_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:

    with HubServer(hub_root) as server, hub_client.using_endpoint(server.url):
        server.knobs.required_token = "hf_right"
        monkeypatch.setenv("HF_TOKEN", "hf_wrong")
        with pytest.raises(AuthError, match="does not accept the token from HF_TOKEN") as e:
            pull(KIMI_K3, home=tmp_path, progress=False)
        assert "hf_wrong" not in str(e.value)


@pytest.mark.e2e
def test_cli_errors_are_one_line(hub: HubServer, tmp_path: Path) -> None:
    env = {**os.environ, "EXPERTMESH_HOME": str(tmp_path), "HF_ENDPOINT": hub.url}
    r = subprocess.run(
        [sys.executable, "-m", "expertmesh", "pull", "expertmesh/nope", "--no-progress"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0
    assert r.stderr.strip().startswith("error:") and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_index_ranges_fetched_from_the_hub_equal_the_tensors(
    hub: HubServer, tiny_repos: dict[str, Path], tmp_path: Path
) -> None:
    """What a later expert fetch will do: the index's ranges, read from the Hub, are the expert."""
    import numpy as np
    from safetensors import safe_open

    result = pull(KIMI_K3, home=tmp_path, progress=False)
    index = ExpertIndex.load(result.path / INDEX_FILENAME)
    reader = hub_client.RangeReader()
    for key in [(1, 0), (2, 17), (5, 31)]:
        loc = index.expert(*key)
        (r,) = loc.ranges  # one range per K3 expert
        data = reader.read(hub_client.RemoteFile(index.repo_id, index.commit, r.file), r.start, r.end)
        with safe_open(tiny_repos["kimi_k3"] / r.file, "numpy") as f:
            expected = b"".join(np.ascontiguousarray(f.get_tensor(t.name)).tobytes() for t in loc.tensors)
        assert data == expected


def test_disk_space_is_checked_first(
    hub_root: Path, tiny_repos: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from expertmesh.node import constants
    from expertmesh.node.errors import InsufficientDiskError

    monkeypatch.setattr(constants, "DISK_HEADROOM_BYTES", 10**18)
    # a Hub of its own: a response of an earlier test still finishing would count in a shared one
    with HubServer(hub_root) as hub, hub_client.using_endpoint(hub.url):
        with pytest.raises(InsufficientDiskError, match="free"):
            pull(KIMI_K3, home=tmp_path, progress=False)
    for key, entry in hub.stats()["files"].items():
        if key.endswith(".safetensors"):  # nothing but the headers was read
            shard = tiny_repos["kimi_k3"] / key.rsplit("/", 1)[1]
            assert entry["bytes"] == 8 + safetensors_format.header_length(shard.read_bytes()[:8])


def test_an_index_only_pull_is_enough_for_a_cache_peer_but_not_to_generate(hub: HubServer, tmp_path: Path) -> None:
    from expertmesh.assembly import build_node, open_model
    from expertmesh.node.config import NodeConfig, StoreConfig
    from expertmesh.node.errors import NotPulledError
    from expertmesh.node.hub import local_models

    _reset(hub)
    result = pull(KIMI_K3, home=tmp_path, progress=False, index_only=True)
    assert result.core_bytes == 0 and result.expert_count > 0
    shards = [k for k in hub.stats()["files"] if k.endswith(".safetensors")]
    assert shards and all(hub.stats()["files"][k]["bytes"] < 64 * 1024 for k in shards)  # headers, never tensors
    assert not list(local_models.find_index(tmp_path, KIMI_K3).glob("*.safetensors"))
    with pytest.raises(NotPulledError, match=f"expertmesh pull {KIMI_K3}"):
        open_model(KIMI_K3, home=tmp_path)
    config = NodeConfig(KIMI_K3, home=tmp_path, cache_only=True, store=StoreConfig(disk_budget="1MB"))
    with build_node(config) as node:  # a cache peer: the index is enough
        peer = node.experts
        loc = next(iter(peer.index.experts.values()))
        assert peer.held_copy(loc) is None and len(peer.fetch_as_owner(loc)) == loc.nbytes
        assert peer.held_copy(loc) is not None  # kept, and it passes its own digest


def test_pull_keeps_its_requests_in_flight(hub: HubServer, tmp_path: Path) -> None:
    """`--concurrency N` means N ranges in flight, also while each waits for its first byte."""
    _reset(hub)
    hub.knobs.ttfb_s = 0.3  # every request waits, so the ones in flight overlap for certain
    try:
        pull(KIMI_K3, home=tmp_path, progress=False, concurrency=3)
    finally:
        hub.knobs.ttfb_s = 0.0
    assert hub.stats()["peak_waiting"] == 3


def test_a_core_of_few_large_spans_is_split_so_every_connection_has_work() -> None:
    from expertmesh.node.hub.pull import MIN_PART_BYTES, PARTS_PER_CORE, _plan_parts
    from expertmesh.node.model.expert_index import ExpertIndex, TensorSlice

    big = 3 * 1024**3  # one span of 3 GB, as a K3 layer's core can be
    core = {"a": TensorSlice("a", "U8", (big,), "s1.safetensors", 0, big)}
    parts = _plan_parts(ExpertIndex("x/y", "0" * 40, {"s1.safetensors": big}, core, {}))
    assert len(parts) >= PARTS_PER_CORE and all(MIN_PART_BYTES <= p.nbytes <= 64 * 1024**2 for p in parts)
    assert parts[0].start == 0 and parts[-1].end == big and all(a.end == b.start for a, b in zip(parts, parts[1:]))


@pytest.mark.parametrize("damage", ["core", "config", "marker"])
def test_a_damaged_local_copy_is_named_at_load_and_repaired_by_pull(
    hub: HubServer, tmp_path: Path, damage: str
) -> None:
    """A cut core shard (a disk error, an interrupted copy or restore), a garbled config or marker:
    `run` died with a traceback and `pull` said "already pulled" (found by an audit). Loading now
    names the damage and the repair; `pull` finds it by sizes and parsing and fetches again."""
    from expertmesh.assembly import open_model
    from expertmesh.node.config import StoreConfig
    from expertmesh.node.errors import DamagedModelError

    _reset(hub)
    repo_id = KIMI_K3
    first = pull(repo_id, home=tmp_path, progress=False)
    index = ExpertIndex.load(first.path / INDEX_FILENAME)
    if damage == "core":
        shard = first.path / sorted({t.file for t in index.core.values()})[0]
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
    elif damage == "config":
        (first.path / "config.json").write_text('{"model_type": "kimi')
    else:
        (first.path / "pull_complete.json").write_bytes(b"\xff\xfe not json")
    with pytest.raises(DamagedModelError, match="expertmesh pull"):
        open_model(repo_id, home=tmp_path, store=StoreConfig(fill=False)).close()
    again = pull(repo_id, home=tmp_path, progress=False)
    assert not again.already_complete
    if damage == "core":
        assert again.fetched_bytes > 0
    open_model(repo_id, home=tmp_path, store=StoreConfig(fill=False)).close()
    assert pull(repo_id, home=tmp_path, progress=False).already_complete
