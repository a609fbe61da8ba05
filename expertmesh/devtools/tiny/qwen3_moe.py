"""A tiny Qwen3-MoE in the layout Qwen publishes: BF16 per-expert tensors
`model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight`, every layer sparse."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from expertmesh.devtools.tiny.common import (
    Tensor,
    init_parameters,
    tensor,
    write_generation_config,
    write_json,
    write_layered_repo,
    write_readme,
)
from expertmesh.devtools.tiny.tokenizer import write_tokenizer_files

NUM_LAYERS = 4
NUM_EXPERTS = 32
VOCAB_SIZE = 448


def config(layers: int = NUM_LAYERS, experts: int = NUM_EXPERTS, top_k: int = 4) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def _core_tensors(name: str, a: mx.array, params: dict[str, mx.array]) -> list[Tensor]:
    return [tensor(name, a.astype(mx.bfloat16))]


def _expert_tensors(params: dict[str, mx.array], layer: int) -> list[Tensor]:
    base = f"model.layers.{layer}.mlp"
    stacked = {
        p: params[f"{base}.switch_mlp.{p}.weight"].astype(mx.bfloat16) for p in ("down_proj", "gate_proj", "up_proj")
    }
    experts = next(iter(stacked.values())).shape[0]
    return [tensor(f"{base}.experts.{e}.{p}.weight", w[e]) for e in range(experts) for p, w in stacked.items()]


def build(out: Path, seed: int) -> None:
    """Write the repo files of a tiny Qwen3-MoE into `out`."""
    build_shaped(out, seed)


def build_shaped(out: Path, seed: int, layers: int = NUM_LAYERS, experts: int = NUM_EXPERTS, top_k: int = 4) -> None:
    """A tiny Qwen3-MoE of another depth or width (Qwen3-30B-A3B's is 48 layers of 128 experts, top-8)."""
    cfg = config(layers, experts, top_k)
    params = init_parameters(cfg, seed)
    write_layered_repo(out, params, layers, list(range(layers)), _core_tensors, _expert_tensors, seed)
    write_json(out / "config.json", cfg)
    write_generation_config(out, write_tokenizer_files(out, VOCAB_SIZE))
    shape = (
        ""
        if (layers, experts, top_k) == (NUM_LAYERS, NUM_EXPERTS, 4)
        else f"{layers} layers of {experts} experts, top-{top_k}; "
    )
    write_readme(out, "qwen3_moe", seed, f"{shape}layout of Qwen/Qwen3-30B-A3B (BF16 experts).")
