"""Every dtype of the safetensors format is sized as the format's own library sizes it (the
installed `safetensors`, huggingface/safetensors' Rust reader), sub-byte ones in bits; and at pull,
a tensor in a dtype expertmesh cannot use yet is harmless where mlx-lm drops it, and a clear "not
yet" where the experts or the core need it (node/model/safetensors_format.py, expert_index.py)."""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import pytest
import safetensors
from repos import tiny_id

from expertmesh.assembly import open_model
from expertmesh.devtools.local_hub import HubServer
from expertmesh.node.config import StoreConfig
from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings
from expertmesh.node.errors import UnsupportedModelError
from expertmesh.node.hub import client as hub_client
from expertmesh.node.hub.pull import pull
from expertmesh.node.model import safetensors_format
from expertmesh.node.model.safetensors_format import SafetensorsFormatError

INDEX = "model.safetensors.index.json"


def _file(path: Path, dtype: str, shape: list[int], nbytes: int) -> Path:
    header = json.dumps({"t": {"dtype": dtype, "shape": shape, "data_offsets": [0, nbytes]}}).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(nbytes))
    return path


def _library_accepts(path: Path) -> bool:
    try:
        with safetensors.safe_open(str(path), "numpy"):
            return True
    except safetensors.SafetensorError:
        return False


def _ours_accepts(path: Path) -> bool:
    try:
        safetensors_format.read_header(path)
        return True
    except SafetensorsFormatError:
        return False


def test_the_dtypes_are_those_the_safetensors_library_knows(tmp_path: Path) -> None:
    """Before: F4, the F6s, the FNUZ fp8s and C64 made a shard "not a valid safetensors file"."""
    with pytest.raises(safetensors.SafetensorError) as e:
        safetensors.safe_open(str(_file(tmp_path / "x.safetensors", "NOT_A_DTYPE", [1], 1)), "numpy")
    known = set(re.findall(r"`(\w+)`", str(e.value).split("expected one of", 1)[1]))
    assert known == set(safetensors_format.DTYPE_BITS), str(e.value)


@pytest.mark.parametrize("dtype", sorted(safetensors_format.DTYPE_BITS))
@pytest.mark.parametrize("count", [1, 3, 4, 8])
def test_each_dtype_is_sized_in_bits_as_the_library_sizes_it(tmp_path: Path, dtype: str, count: int) -> None:
    """A tensor of `count` elements, its size as our sizing says (or a byte more or less): we
    accept exactly the files the library accepts, sub-byte tensors ending off a byte boundary none."""
    bits = safetensors_format.DTYPE_BITS[dtype]
    for nbytes in {max(0, count * bits // 8 + d) for d in (-1, 0, 1)}:
        path = _file(tmp_path / f"{nbytes}.safetensors", dtype, [count], nbytes)
        assert _ours_accepts(path) == _library_accepts(path), (dtype, count, nbytes)
    if count * bits % 8:
        with pytest.raises(SafetensorsFormatError, match="byte boundary"):
            safetensors_format.tensor_nbytes(dtype, (count,))
    else:
        assert safetensors_format.tensor_nbytes(dtype, (count,)) == count * bits // 8


# -- at pull ---------------------------------------------------------------------------------


def _rewrite(repo: Path, shard: str, change) -> None:
    """Write `shard` again with `change(tensors)` applied to its [name, dtype, shape, bytes] list
    (in file order), and the index's weight_map naming what it now holds."""
    path = repo / shard
    data = path.read_bytes()
    tensors = [
        [e.name, e.dtype, e.shape, data[e.start : e.end]]
        for e in sorted(safetensors_format.read_header(path).values(), key=lambda e: e.start)
    ]
    change(tensors)
    safetensors_format.write_file(path, [tuple(t) for t in tensors])
    index = json.loads((repo / INDEX).read_text())
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != shard}
    index["weight_map"].update({t[0]: shard for t in tensors})
    (repo / INDEX).write_text(json.dumps(index))


def _one_shard_holding(repo: Path, fragment: str) -> str:
    weight_map = json.loads((repo / INDEX).read_text())["weight_map"]
    return next(f for n, f in sorted(weight_map.items()) if fragment in n)


def test_an_f4_tensor_mlx_lm_drops_is_pulled_past_and_the_model_runs(
    tiny_repos: dict[str, Path], tmp_path: Path, oracle
) -> None:
    """deepseek_v3's sanitize drops precomputed `rotary_emb.inv_freq`: one stored as F4 (96 of
    them in 48 bytes), between the core's tensors of a shard, changes nothing but the offsets."""
    repo = tmp_path / "hub" / "expertmesh" / "tiny-deepseek_v3"
    shutil.copytree(tiny_repos["deepseek_v3"], repo)
    shard = _one_shard_holding(repo, "layers.0.self_attn.")
    _rewrite(
        repo, shard, lambda ts: ts.insert(1, ["model.layers.0.self_attn.rotary_emb.inv_freq", "F4", (96,), bytes(48)])
    )
    home = tmp_path / "home"
    with HubServer(tmp_path / "hub") as hub, hub_client.using_endpoint(hub.url):
        pull("expertmesh/tiny-deepseek_v3", home=home, progress=False)
        sm = open_model("expertmesh/tiny-deepseek_v3", home=home, store=StoreConfig(prefetch=False, fill=False))
        try:
            ids = sm.tokenizer.encode("hello experts")
            settings = SamplingSettings(max_tokens=6, temp=0.0, top_p=1.0, seed=None)
            tokens = [t.id for t in Generator(sm).generate(ids, settings, lambda: False, GenerationSummary())]
        finally:
            sm.close()
    assert tokens == oracle.tokens("deepseek_v3", ids, 6)  # mlx-lm on the repo without it


def _relabel(name_fragment: str, dtype: str, per_element: int):
    """A change to `_rewrite`: every tensor whose name holds `name_fragment` relabelled as `dtype`,
    its last axis stretched by `per_element` so that the bytes are the same."""

    def change(tensors: list) -> None:
        for t in tensors:
            if name_fragment in t[0]:
                t[1], t[2] = dtype, (*t[2][:-1], t[2][-1] * per_element)

    return change


@pytest.mark.parametrize(
    ("arch", "fragment", "dtype", "per_element", "says"),
    [
        (
            "qwen3_moe",
            ".mlp.experts.",
            "F8_E4M3FNUZ",
            2,
            r"the routed experts of layer \d+ are stored as F8_E4M3FNUZ \(.*\), which expertmesh cannot decode yet",
        ),
        ("qwen3_moe", "model.norm.weight", "F4", 4, "the core tensor model.norm.weight is stored as F4, which MLX"),
    ],
)
def test_experts_or_core_in_a_dtype_expertmesh_cannot_use_are_refused_at_pull(
    tiny_repos: dict[str, Path], tmp_path: Path, arch: str, fragment: str, dtype: str, per_element: int, says: str
) -> None:
    """Before: the header was "not a valid safetensors file"; without the check it would have
    been a failure at the first token."""
    repo = tmp_path / "hub" / "expertmesh" / f"tiny-{arch}"
    shutil.copytree(tiny_repos[arch], repo)
    for shard in sorted(set(json.loads((repo / INDEX).read_text())["weight_map"].values())):
        _rewrite(repo, shard, _relabel(fragment, dtype, per_element))
    with HubServer(tmp_path / "hub") as hub, hub_client.using_endpoint(hub.url):
        with pytest.raises(UnsupportedModelError, match=says) as e:
            pull(tiny_id(arch), home=tmp_path / "home", progress=False)
    assert "\n" not in str(e.value)
    assert not list((tmp_path / "home").rglob("*.safetensors")) and not list((tmp_path / "home").rglob("*.part"))
