"""The index must address every expert's exact bytes, in every upstream layout."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from expertmesh.node.errors import UnsupportedModelError
from expertmesh.node.model import safetensors_format
from expertmesh.node.model.expert_index import ExpertIndex, build_index


def _local_index(repo: Path) -> ExpertIndex:
    shards = sorted(p.name for p in repo.glob("*.safetensors"))
    headers = {s: (safetensors_format.read_header(repo / s), (repo / s).stat().st_size) for s in shards}
    return build_index("expertmesh/x", "0" * 40, headers, json.loads((repo / "config.json").read_text()))


@pytest.mark.parametrize("arch", ["kimi_k3", "deepseek_v3", "qwen3_moe", "mlx_qwen3_moe"])
def test_every_expert_range_holds_its_tensors(arch: str, tiny_repos: dict[str, Path], tmp_path: Path) -> None:
    repo = tiny_repos[arch]
    index = _local_index(repo)
    index.save(tmp_path / "index.json")
    loaded = ExpertIndex.load(tmp_path / "index.json")
    assert loaded.experts == index.experts and loaded.core == index.core
    handles = {p.name: safe_open(p, "numpy") for p in repo.glob("*.safetensors")}
    raw = {p.name: p.read_bytes() for p in repo.glob("*.safetensors")}
    for (layer, e), loc in loaded.experts.items():
        fetched = b"".join(raw[r.file][r.start : r.end] for r in loc.ranges)
        expected = b""
        for t in loc.tensors:
            if arch == "mlx_qwen3_moe" or t.dtype == "BF16":  # numpy has no bfloat16: compare raw bytes of the slice
                expected += raw[t.file][t.start : t.end]
                continue
            expected += np.ascontiguousarray(handles[t.file].get_tensor(t.name)).tobytes()
        assert fetched == expected, (layer, e)
    if arch == "kimi_k3":
        assert all(len(loc.ranges) == 1 for loc in loaded.experts.values())  # one range per expert
        assert len(loaded.experts) == 5 * 32
    if arch == "mlx_qwen3_moe":
        # a stacked slice: check one against the array itself
        t = next(t for t in loaded.expert(2, 7).tensors if t.dtype == "U32")
        stacked = handles[t.file].get_tensor(t.name)
        assert raw[t.file][t.start : t.end] == np.ascontiguousarray(stacked[7]).tobytes()


def test_core_lists_everything_else(tiny_repos: dict[str, Path]) -> None:
    repo = tiny_repos["kimi_k3"]
    index = _local_index(repo)
    all_names = set(json.loads((repo / "model.safetensors.index.json").read_text())["weight_map"])
    expert_names = {t.name for loc in index.experts.values() for t in loc.tensors}
    assert set(index.core) | expert_names == all_names
    assert "model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight" in index.core
    assert index.core_bytes + index.expert_bytes == sum(
        e.nbytes for s in repo.glob("*.safetensors") for e in safetensors_format.read_header(s).values()
    )


def test_dense_model_is_rejected() -> None:
    entry = safetensors_format.TensorEntry("model.layers.0.mlp.up_proj.weight", "BF16", (4, 4), 100, 132)
    with pytest.raises(UnsupportedModelError, match="no routed experts"):
        build_index("a/dense", "0" * 40, {"model.safetensors": ({entry.name: entry}, 200)}, {"model_type": "llama"})
