"""A tiny DeepSeek-V3 in the Kimi-K2-Thinking layout.

MLA attention, sigmoid router with correction bias, one shared expert, layer 0 dense, and
routed experts as compressed-tensors `pack-quantized` symmetric int4 (group 32):
`model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.{weight_packed (int32), weight_scale
(bf16), weight_shape (int32)}`. mlx-lm's `deepseek_v3.sanitize` is the reference.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from expertmesh.devtools.tiny.common import (
    Tensor,
    fold_kv_b,
    init_parameters,
    tensor,
    write_generation_config,
    write_json,
    write_layered_repo,
    write_readme,
)
from expertmesh.devtools.tiny.tokenizer import write_tokenizer_files

NUM_LAYERS = 5
NUM_EXPERTS = 32
VOCAB_SIZE = 448
GROUP_SIZE = 32


def config() -> dict:
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "kimi_k2",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": NUM_EXPERTS,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 32,
        "q_lora_rank": 48,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "qk_nope_head_dim": 16,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": 4,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 1,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 50000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 4,
                        "type": "int",
                        "symmetric": True,
                        "group_size": GROUP_SIZE,
                        "strategy": "group",
                        "dynamic": False,
                    },
                    "input_activations": None,
                    "output_activations": None,
                }
            },
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"],
        },
    }


def pack_int4(w: mx.array) -> tuple[np.ndarray, mx.array]:
    """Symmetric int4 per group of 32, packed 8 per int32 lowest nibble first, as
    compressed-tensors does (stored value = q + 8), with bf16 scales."""
    out_dims, in_dims = w.shape
    groups = w.astype(mx.float32).reshape(out_dims, in_dims // GROUP_SIZE, GROUP_SIZE)
    scales = (mx.max(mx.abs(groups), axis=-1) / 7.0).astype(mx.bfloat16)
    s = np.array(scales.astype(mx.float32))[..., None]
    q = np.clip(np.round(np.array(groups) / np.where(s == 0, 1, s)), -8, 7).astype(np.int64) + 8
    q = q.reshape(out_dims, in_dims // 8, 8)
    packed = np.zeros((out_dims, in_dims // 8), dtype=np.uint32)
    for i in range(8):
        packed |= q[..., i].astype(np.uint32) << np.uint32(4 * i)
    return packed.view(np.int32), scales


def _core_tensors(name: str, a: mx.array, params: dict[str, mx.array]) -> list[Tensor]:
    dtype = mx.float32 if "e_score_correction_bias" in name else mx.bfloat16
    if name.endswith("embed_q.weight"):
        kv_b = fold_kv_b(a, params[name.replace("embed_q", "unembed_out")])
        return [tensor(name.replace("embed_q", "kv_b_proj"), kv_b.astype(dtype))]
    if name.endswith("unembed_out.weight"):
        return []
    return [tensor(name, a.astype(dtype))]


def _expert_tensors(params: dict[str, mx.array], layer: int) -> list[Tensor]:
    base = f"model.layers.{layer}.mlp"
    packed = {}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        w = params[f"{base}.switch_mlp.{proj}.weight"]
        packed[proj] = [pack_int4(w[e]) for e in range(NUM_EXPERTS)]
    out = []
    for e in range(NUM_EXPERTS):
        for proj in ("down_proj", "gate_proj", "up_proj"):
            q, scales = packed[proj][e]
            name = f"{base}.experts.{e}.{proj}"
            out.append(tensor(f"{name}.weight_packed", mx.array(q)))
            out.append(tensor(f"{name}.weight_scale", scales))
            out.append(tensor(f"{name}.weight_shape", mx.array([q.shape[0], q.shape[1] * 8], dtype=mx.int32)))
    return out


def build(out: Path, seed: int) -> None:
    """Write the repo files of a tiny Kimi-K2-style DeepSeek-V3 into `out`."""
    cfg = config()
    params = init_parameters(cfg, seed)
    moe_layers = list(range(cfg["first_k_dense_replace"], NUM_LAYERS))
    write_layered_repo(out, params, NUM_LAYERS, moe_layers, _core_tensors, _expert_tensors, seed)
    write_json(out / "config.json", cfg)
    write_generation_config(out, write_tokenizer_files(out, VOCAB_SIZE))
    write_readme(out, "deepseek_v3", seed, "layout of moonshotai/Kimi-K2-Thinking (int4 experts).")
