"""`pull` against a Hub that lies: every answer that names a path, a size or a count is checked
before it is used, and each lie ends in a one-line user error with nothing written outside the
model's folder (node/hub/pull.py, client.py, safetensors_format.py, local_models.py)."""

from __future__ import annotations

import json
import shutil
import socket
import struct
import threading
from pathlib import Path

import pytest
from repos import KIMI_K3, tiny_id

from expertmesh.devtools.local_hub import HubServer
from expertmesh.node.errors import DownloadError, NotPulledError, UnsupportedModelError
from expertmesh.node.hub import client as hub_client
from expertmesh.node.hub import local_models
from expertmesh.node.hub import pull as pull_module
from expertmesh.node.hub.pull import pull
from expertmesh.node.model import safetensors_format

SHARD = "model-00001-of-00003.safetensors"


def _own_hub(tiny_repos: dict[str, Path], tmp_path: Path, arch: str = "kimi_k3") -> Path:
    """A Hub root of its own holding a copy of one tiny repo, for a test to make hostile."""
    root = tmp_path / "hub"
    shutil.copytree(tiny_repos[arch], root / "expertmesh" / f"tiny-{arch}")
    return root


def _files_under(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*")) if folder.exists() else []


# -- D2: weight_map values name files under the model's folder ----------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        "ABSOLUTE",  # replaced by an absolute path outside the home
        "../../../escape.safetensors",
        "sub/../../../../escape.safetensors",
        "sub\\..\\escape.safetensors",
        ".pull/x.safetensors",  # would land in (and be deleted with) the parts folder
        "pull_complete.json",  # would overwrite the completion marker
        "not-in-the-repo.safetensors",
        7,
        None,
    ],
)
def test_weight_map_names_that_could_leave_the_model_folder_are_refused(
    bad: object, tiny_repos: dict[str, Path], tmp_path: Path
) -> None:
    root = _own_hub(tiny_repos, tmp_path)
    outside = tmp_path / "outside"
    if bad == "ABSOLUTE":
        bad = str(outside / "evil.safetensors")
    index = root / "expertmesh" / "tiny-kimi_k3" / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"] = {k: (bad if v == SHARD else v) for k, v in doc["weight_map"].items()}
    index.write_text(json.dumps(doc))
    home = tmp_path / "home"
    with HubServer(root) as hub, hub_client.using_endpoint(hub.url):
        files = hub.repos[KIMI_K3].files
        if isinstance(bad, str) and bad != "not-in-the-repo.safetensors":
            files[bad] = files[SHARD]  # the hostile Hub lists the odd name and serves the shard's bytes
        with pytest.raises(UnsupportedModelError, match="names the shard") as e:
            pull(KIMI_K3, home=home, progress=False)
    assert "\n" not in str(e.value)
    assert not outside.exists()
    assert {p.relative_to(tmp_path).parts[0] for p in _files_under(tmp_path)} <= {"hub", "home"}
    assert not list(home.rglob("*.safetensors")) and not list(home.rglob("*.part"))


def test_a_part_path_outside_the_parts_folder_is_refused(tmp_path: Path) -> None:
    """The second guard: even a name that slipped past the weight_map check builds no path outside."""
    parts_dir = tmp_path / "model" / ".pull"
    with pytest.raises(UnsupportedModelError, match="outside"):
        pull_module._Part("../../../x.safetensors", 0, 8).path(parts_dir)
    with pytest.raises(UnsupportedModelError, match="outside"):
        pull_module._Part(str(tmp_path / "abs.safetensors"), 0, 8).path(parts_dir)
    inside = pull_module._Part("sub/a.safetensors", 0, 8).path(parts_dir)
    assert inside.parent == parts_dir / "sub" / "a.safetensors"


# -- D3: the commit sha names a folder ---------------------------------------------------------


@pytest.mark.parametrize(
    "sha", ["ABSOLUTE", "../../../escape", "0123456789ABCDEF0123456789abcdef01234567", "deadbeef", "a" * 41]
)
def test_a_commit_that_is_not_a_sha_is_refused_before_anything_is_written(
    sha: str, tiny_repos: dict[str, Path], tmp_path: Path
) -> None:
    root = _own_hub(tiny_repos, tmp_path)
    if sha == "ABSOLUTE":
        sha = str(tmp_path / "outside" / "model")
    (root / "expertmesh" / "tiny-kimi_k3" / ".hub_commit").write_text(sha)
    home = tmp_path / "home"
    with HubServer(root) as hub, hub_client.using_endpoint(hub.url):
        with pytest.raises(DownloadError, match="not a 40-hex-digit commit sha"):
            pull(KIMI_K3, home=home, progress=False)
    assert not _files_under(home)
    assert {p.relative_to(tmp_path).parts[0] for p in _files_under(tmp_path)} == {"hub"}


def test_a_ref_that_does_not_hold_a_sha_is_not_followed(tmp_path: Path) -> None:
    """A damaged or planted `refs/main` never points `run`, `rm` or `ls` outside the model's root."""
    home = tmp_path / "home"
    root = local_models.model_root(home, KIMI_K3)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text("../../../elsewhere\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / local_models.COMPLETE_MARKER).write_text("{}")
    assert local_models.local_commit(home, KIMI_K3, "main") is None
    with pytest.raises(NotPulledError, match="expertmesh pull"):
        local_models.find_pulled(home, KIMI_K3)
    with pytest.raises(ValueError, match="commit sha"):
        local_models.model_dir(home, KIMI_K3, "../../../elsewhere")
    with pytest.raises(ValueError, match="commit sha"):
        local_models.record_ref(home, KIMI_K3, "main", str(elsewhere))
    assert local_models.model_dir(home, KIMI_K3, "0" * 40) == root / ("0" * 40)


# -- D11: sizes the Hub claims --------------------------------------------------------------------


def _claiming_server(claim: int, body: bytes, connections: int) -> tuple[socket.socket, threading.Thread]:
    """A raw HTTP server that answers `connections` requests with a 206 claiming `claim` bytes and
    sending `body`, then closing."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    sock.settimeout(20)

    def serve() -> None:
        for _ in range(connections):
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    conn.recv(65536)
                    head = (
                        f"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-{claim - 1}/{claim}\r\n"
                        f"Content-Length: {claim}\r\nContent-Type: application/json\r\n\r\n"
                    )
                    conn.sendall(head.encode() + body)
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return sock, thread


def test_a_size_the_hub_claims_is_not_allocated_before_the_bytes_arrive() -> None:
    """A Content-Range of 2**62 bytes with an 18-byte body: a DownloadError, not a MemoryError."""
    sock, thread = _claiming_server(1 << 62, b'{"weight_map": {}}', connections=1)
    try:
        with hub_client.using_endpoint(f"http://127.0.0.1:{sock.getsockname()[1]}"):
            reader = hub_client.RangeReader(max_retries=0, timeout_s=5)
            remote = hub_client.RemoteFile("x/y", "0" * 40, "model.safetensors.index.json")
            with pytest.raises(DownloadError, match="failed"):
                reader.read_with_size(remote, 0, 1 << 62)
    finally:
        sock.close()
        thread.join(10)


def test_an_index_json_larger_than_the_cap_is_refused(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pull_module, "MAX_WEIGHT_MAP_BYTES", 100)
    with pytest.raises(UnsupportedModelError, match="model.safetensors.index.json is .* more than"):
        pull(KIMI_K3, home=tmp_path, progress=False)
    served = hub.stats()["files"][f"{KIMI_K3}/model.safetensors.index.json"]
    assert all(b - a + 1 <= 101 for a, b, _ in served["ranges"])  # never more than the cap and one byte


# -- D12: safetensors headers ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "header,why",
    [
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": ["0", "4"]}}, "data_offsets"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0.0, 4.0]}}, "data_offsets"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}}, "data_offsets"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [True, 5]}}, "data_offsets"),
        ({"a": {"dtype": "F32", "shape": [-1, -2], "data_offsets": [0, 8]}}, "shape"),
        ({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, "shape"),
        ({"a": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}}, "shape"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, "offsets disagree"),
        ({"a": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}, "dtype"),
        ({"a": [1, 2]}, "malformed"),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            },
            "overlap",
        ),
        (
            {
                "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
            },
            "overlap",
        ),
        ({"a": {"dtype": "F32", "shape": [4000], "data_offsets": [0, 16000]}}, "past the end"),
        ({"__metadata__": [1], "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, "__metadata__"),
    ],
)
def test_a_malformed_safetensors_header_is_a_format_error(header: dict, why: str) -> None:
    with pytest.raises(safetensors_format.SafetensorsFormatError, match=why):
        safetensors_format.parse_header(json.dumps(header).encode(), 10_000)


def test_a_header_nested_past_the_recursion_limit_is_a_format_error() -> None:
    header = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(safetensors_format.SafetensorsFormatError, match="nested too deeply"):
        safetensors_format.parse_header(header, 10**6)


def test_well_formed_headers_still_parse() -> None:
    header = {
        "__metadata__": {"format": "pt"},
        "b": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [16, 28]},
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "empty": {"dtype": "F32", "shape": [0], "data_offsets": [28, 28]},
    }
    text = json.dumps(header).encode()
    tensors, meta = safetensors_format.parse_header(text, 8 + len(text) + 28)
    assert meta == {"format": "pt"} and tensors["b"].shape == (2, 3) and tensors["b"].nbytes == 12


def test_a_shard_with_a_malformed_header_fails_pull_in_one_line(tiny_repos: dict[str, Path], tmp_path: Path) -> None:
    root = _own_hub(tiny_repos, tmp_path)
    shard = root / "expertmesh" / "tiny-kimi_k3" / SHARD
    data = shard.read_bytes()
    n = safetensors_format.header_length(data[:8])
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"] = [str(x) for x in header[name]["data_offsets"]]
    text = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])
    with HubServer(root) as hub, hub_client.using_endpoint(hub.url):
        with pytest.raises(DownloadError, match="not a valid safetensors file: .*data_offsets"):
            pull(KIMI_K3, home=tmp_path / "home", progress=False)


# -- D14: config sizes against the shards ---------------------------------------------------------


@pytest.mark.parametrize(
    "text,match", [("[1, 2]", "not a JSON object"), ("[" * 100_000, "nested too deeply"), ("{", "not valid JSON")]
)
def test_a_config_that_is_not_an_object_fails_pull_in_one_line(
    text: str, match: str, tiny_repos: dict[str, Path], tmp_path: Path
) -> None:
    root = _own_hub(tiny_repos, tmp_path)
    (root / "expertmesh" / "tiny-kimi_k3" / "config.json").write_text(text)
    with HubServer(root) as hub, hub_client.using_endpoint(hub.url):
        with pytest.raises(UnsupportedModelError, match=match):
            pull(KIMI_K3, home=tmp_path / "home", progress=False)


@pytest.mark.parametrize(
    "arch,path,value,match",
    [
        ("qwen3_moe", ("num_hidden_layers",), "+30", "num_hidden_layers = .* layers"),
        ("qwen3_moe", ("num_experts",), 10**6, "num_experts = 1000000"),
        ("kimi_k3", ("text_config", "num_hidden_layers"), 10**6, "text_config.num_hidden_layers = 1000000"),
        ("kimi_k3", ("text_config", "num_experts"), "+1", "text_config.num_experts = 33"),
    ],
)
def test_config_counts_beyond_the_shards_are_refused_before_the_model_is_built(
    arch: str,
    path: tuple[str, ...],
    value: object,
    match: str,
    tiny_repos: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from expertmesh.node.model import mlx_lm_models

    root = _own_hub(tiny_repos, tmp_path, arch)
    config_path = root / "expertmesh" / f"tiny-{arch}" / "config.json"
    config = json.loads(config_path.read_text())
    at = config
    for key in path[:-1]:
        at = at[key]
    at[path[-1]] = at[path[-1]] + int(value[1:]) if isinstance(value, str) else value
    config_path.write_text(json.dumps(config))
    built: list[dict] = []
    monkeypatch.setattr(mlx_lm_models, "build_model", lambda c: built.append(c) or pytest.fail("model built"))
    with HubServer(root) as hub, hub_client.using_endpoint(hub.url):
        with pytest.raises(UnsupportedModelError, match=match):
            pull(tiny_id(arch), home=tmp_path / "home", progress=False)
    assert not built


def test_config_counts_are_checked_against_the_headers_and_a_cap() -> None:
    def entry(name: str, shape: tuple[int, ...]) -> safetensors_format.TensorEntry:
        return safetensors_format.TensorEntry(name, "F32", shape, 0, 0)

    tensors = [
        entry("model.layers.0.self_attn.q_proj.weight", (4, 4)),
        entry("model.layers.3.mlp.switch_mlp.gate_proj.weight", (16, 4, 4)),
        entry("transformer.h.7.moe.experts.20.w1", (4, 4)),  # `h.N` layers and per-expert names count too
    ]
    headers = {"a.safetensors": ({t.name: t for t in tensors}, 0)}
    check = pull_module.check_config_sizes
    check("x/y", {"num_hidden_layers": 8, "num_experts": 21, "vision_config": {"num_hidden_layers": 99}}, headers)
    with pytest.raises(UnsupportedModelError, match="num_hidden_layers = 9, but the shards hold 8 layers"):
        check("x/y", {"num_hidden_layers": 9}, headers)
    with pytest.raises(UnsupportedModelError, match="llm.n_routed_experts = 22"):
        check("x/y", {"llm": {"n_routed_experts": 22}}, headers)
    big = {"x.safetensors": ({"layers.9999999.w": entry("layers.9999999.w", (1,))}, 0)}
    with pytest.raises(UnsupportedModelError, match="at most 4096"):
        check("x/y", {"num_layers": 5000}, big)  # a header that names a huge layer does not lift the cap
