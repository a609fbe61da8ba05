"""The tiny repos are what every later test trusts: upstream names, formats, and mlx-lm loads them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from safetensors import safe_open

from expertmesh.devtools.tiny import ARCHS, make_tiny_model
from expertmesh.node.model.expert_index import classify


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.iterdir()):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


def _tensor_names(folder: Path) -> dict[str, str]:
    names = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(shard, "numpy") as f:
            for k in f.keys():
                names[k] = f.get_slice(k).get_dtype()
    return names


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path: Path, tiny_repos: dict[str, Path]) -> None:
    again = make_tiny_model(tmp_path / "a", "kimi_k3", seed=0)
    other = make_tiny_model(tmp_path / "b", "kimi_k3", seed=1)
    assert _digest(again) == _digest(tiny_repos["kimi_k3"])
    assert _digest(other) != _digest(again)


def test_unknown_arch_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny architecture"):
        make_tiny_model(tmp_path / "x", "llama_dense")


def test_kimi_k3_upstream_layout(tiny_repos: dict[str, Path]) -> None:
    repo = tiny_repos["kimi_k3"]
    config = json.loads((repo / "config.json").read_text())
    assert config["quantization_config"]["format"] == "mxfp4-pack-quantized"
    names = _tensor_names(repo)
    assert names["model.layers.1.block_sparse_moe.experts.31.w2.weight_packed"] == "U8"
    assert names["model.layers.1.block_sparse_moe.experts.0.w1.weight_scale"] == "U8"
    assert "model.layers.0.mlp.gate_proj.weight" in names  # layer 0 is dense
    assert not any(".block_sparse_moe.experts." in n for n in names if n.startswith("model.layers.0."))
    assert "model.layers.0.self_attn.q_conv1d.weight" in names  # KDA
    assert "model.layers.3.self_attn.kv_b_proj.weight" in names  # MLA
    assert "model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight" in names
    assert "model.layers.1.block_sparse_moe.routed_expert_down_proj.weight" in names  # latent MoE
    index = json.loads((repo / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3


@pytest.mark.parametrize("arch", ["kimi_k3", "deepseek_v3", "qwen3_moe"])
def test_enough_routing(arch: str, tiny_repos: dict[str, Path]) -> None:
    """≥ 32 experts per MoE layer, ≥ 4 MoE layers, no mlx-lm internal names upstream."""
    names = _tensor_names(tiny_repos[arch])
    experts: dict[int, set[int]] = {}
    for n in names:
        kind = classify(n)
        if kind and kind[0] == "expert":
            experts.setdefault(kind[1], set()).add(kind[2])
    assert len(experts) >= 4
    assert all(len(ids) >= 32 for ids in experts.values())
    assert not any("switch_mlp" in n for n in names)
    config = json.loads((tiny_repos[arch] / "config.json").read_text())
    config = config.get("text_config", config)
    top_k = config.get("num_experts_per_token") or config.get("num_experts_per_tok")
    assert top_k >= 4


def test_deepseek_v3_is_kimi_k2_int4(tiny_repos: dict[str, Path]) -> None:
    names = _tensor_names(tiny_repos["deepseek_v3"])
    assert names["model.layers.1.mlp.experts.0.gate_proj.weight_packed"] == "I32"
    assert names["model.layers.1.mlp.experts.0.gate_proj.weight_scale"] == "BF16"
    assert "model.layers.1.mlp.experts.0.gate_proj.weight_shape" in names
    config = json.loads((tiny_repos["deepseek_v3"] / "config.json").read_text())
    assert config["quantization_config"]["format"] == "pack-quantized"


def test_mlx_converted_stacks_experts(tiny_repos: dict[str, Path]) -> None:
    names = _tensor_names(tiny_repos["mlx_qwen3_moe"])
    assert "model.layers.0.mlp.switch_mlp.gate_proj.scales" in names
    config = json.loads((tiny_repos["mlx_qwen3_moe"] / "config.json").read_text())
    assert config["quantization"]["bits"] == 4


@pytest.mark.parametrize("arch", list(ARCHS))
def test_plain_mlx_lm_loads_and_generates(arch: str, tiny_repos: dict[str, Path]) -> None:
    """The oracle of the streaming engine: mlx-lm itself, on the whole repo."""
    model, tokenizer = mlx_lm.load(str(tiny_repos[arch]))
    if arch == "qwen3_moe" and mx.default_device() == mx.cpu:
        # MLX's CPU gather_mm computes only float32; on Metal the BF16 experts run as they are.
        model.set_dtype(mx.float32)
    text = mlx_lm.generate(model, tokenizer, "hello experts", max_tokens=8)
    assert len(tokenizer.encode(text)) >= 1
