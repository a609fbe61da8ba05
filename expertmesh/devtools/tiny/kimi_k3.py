"""A tiny Kimi K3 in the layout Moonshot publishes.

KDA (linear attention) and MLA layers, attention residuals, layer 0 dense, latent MoE with
shared experts, and routed experts as compressed-tensors `mxfp4-pack-quantized`:
`model.layers.{l}.block_sparse_moe.experts.{e}.{w1,w2,w3}.{weight_packed,weight_scale}`, the
six tensors of one expert contiguous, the experts of one layer contiguous, after that
layer's core tensors. mlx-lm's `kimi_k3.sanitize` is the reference for every name here.
"""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx

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

NUM_LAYERS = 6
NUM_EXPERTS = 32
VOCAB_SIZE = 448
# Kept in float32 upstream (mlx-lm's cast_predicate).
_FP32 = ("e_score_correction_bias", "A_log", "dt_bias")
# mlx-lm name of a switch_mlp projection -> upstream expert tensor.
_EXPERT_PROJ = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def text_config() -> dict:
    return {
        "model_type": "kimi_linear",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 128,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        # 1-based layer numbers, as upstream: layers 0, 1, 2, 4 are KDA, 3 and 5 are MLA.
        "linear_attn_config": {
            "kda_layers": [1, 2, 3, 5],
            "full_attn_layers": [4, 6],
            "num_heads": 4,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
        },
        "hidden_act": "situ",
        "activation_situ_beta": 1.0,
        "attn_res_block_size": 2,
        "q_lora_rank": None,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "mla_use_nope": True,
        "num_experts": NUM_EXPERTS,
        "num_experts_per_token": 4,
        "num_shared_experts": 2,
        "moe_intermediate_size": 64,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 2.0,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_expert_group": 1,
        "topk_group": 1,
        "routed_expert_hidden_size": 32,
        "latent_moe_use_norm": True,
        "tie_word_embeddings": False,
    }


def config() -> dict:
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "text_config": text_config(),
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 4,
                        "type": "float",
                        "group_size": 32,
                        "strategy": "group",
                        "symmetric": True,
                        "scale_dtype": "uint8",
                    },
                    "input_activations": None,
                }
            },
            "ignore": [
                "lm_head",
                "re:.*self_attn.*",
                "re:.*shared_experts.*",
                "re:.*mlp\\.(gate|up|down)_proj.*",
                "re:.*block_sparse_moe\\.gate$",
                "re:.*routed_expert.*",
            ],
        },
    }


def _upstream_name(name: str) -> str:
    """mlx-lm's name of a core tensor -> the upstream checkpoint's name."""
    name = re.sub(
        r"\.mlp\.(?=gate\.|e_score_correction_bias|shared_experts\.|routed_expert_)", ".block_sparse_moe.", name
    )
    name = name.replace("block_sparse_moe.e_score_correction_bias", "block_sparse_moe.gate.e_score_correction_bias")
    for res in ("self_attention_res", "mlp_res", "output_attn_res"):
        name = name.replace(f"{res}_proj.weight", f"{res}.proj_weight")
        name = name.replace(f"{res}_norm.weight", f"{res}.norm_weight")
    return name


def _core_tensors(name: str, a: mx.array, params: dict[str, mx.array]) -> list[Tensor]:
    """One mlx-lm core tensor in upstream form: KDA q/k/v split, MLA kv_b_proj folded."""
    dtype = mx.float32 if any(s in name for s in _FP32) else mx.bfloat16
    upstream = _upstream_name(name)
    if name.endswith("qkv_proj.weight"):
        return [
            tensor(upstream.replace("qkv_proj", f"{p}_proj"), w.astype(dtype))
            for p, w in zip("qkv", mx.split(a, 3, axis=0))
        ]
    if name.endswith("qkv_conv.conv.weight"):  # (3P, K, 1) -> three upstream (P, 1, K)
        return [
            tensor(upstream.replace("qkv_conv.conv", f"{p}_conv1d"), w.moveaxis(2, 1).astype(dtype))
            for p, w in zip("qkv", mx.split(a, 3, axis=0))
        ]
    if name.endswith("A_log"):
        return [tensor(upstream, a.reshape(1, 1, -1, 1).astype(dtype))]
    if name.endswith("embed_q.weight"):
        kv_b = fold_kv_b(a, params[name.replace("embed_q", "unembed_out")])
        return [tensor(upstream.replace("embed_q", "kv_b_proj"), kv_b.astype(dtype))]
    if name.endswith("unembed_out.weight"):
        return []  # folded into kv_b_proj with embed_q
    return [tensor(upstream, a.astype(dtype))]


def _expert_tensors(params: dict[str, mx.array], layer: int) -> list[Tensor]:
    """The layer's routed experts quantised to mxfp4, expert by expert."""
    base = f"model.layers.{layer}.mlp.switch_mlp"
    packed = {}
    for proj, upstream in _EXPERT_PROJ.items():
        q, scales, *_ = mx.quantize(params[f"{base}.{proj}.weight"], group_size=32, bits=4, mode="mxfp4")
        packed[upstream] = (q.view(mx.uint8), scales)
    out = []
    for e in range(NUM_EXPERTS):
        for upstream in ("w1", "w2", "w3"):
            q, scales = packed[upstream]
            name = f"model.layers.{layer}.block_sparse_moe.experts.{e}.{upstream}"
            out.append(tensor(f"{name}.weight_packed", q[e]))
            out.append(tensor(f"{name}.weight_scale", scales[e]))
    return out


def build(out: Path, seed: int) -> None:
    """Write the repo files of a tiny Kimi K3 into `out`."""
    _build(out, config(), seed, "layout of moonshotai/Kimi-K3 (mxfp4 experts).")


def build_wide(out: Path, seed: int, hidden_size: int = 768) -> None:
    """A wider tiny Kimi K3 (same layers, experts and layout) whose compute is no longer
    dwarfed by per-layer fixed costs: benchmarks compare engines on it."""
    cfg = config()
    cfg["text_config"].update(
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        moe_intermediate_size=hidden_size,
        routed_expert_hidden_size=hidden_size // 2,
    )
    _build(out, cfg, seed, f"layout of moonshotai/Kimi-K3 (mxfp4 experts), hidden size {hidden_size}.")


def _build(out: Path, cfg: dict, seed: int, note: str) -> None:
    params = {k.removeprefix("language_model."): v for k, v in init_parameters(cfg, seed).items()}
    first_moe = cfg["text_config"]["first_k_dense_replace"]
    write_layered_repo(
        out, params, NUM_LAYERS, list(range(first_moe, NUM_LAYERS)), _core_tensors, _expert_tensors, seed
    )
    write_json(out / "config.json", cfg)
    write_generation_config(out, write_tokenizer_files(out, VOCAB_SIZE))
    write_readme(out, "kimi_k3", seed, note)


def write_weights(out: Path, params: dict[str, mx.array], cfg: dict) -> None:
    """Write given mlx-lm parameters (trained ones, say) as this layout's shards, exactly.

    Unlike `build`, norms and biases are written as given (no noise). `cfg` is a `config()`-shaped
    dict; its layer and expert counts must be this layout's.
    """
    text = cfg["text_config"]
    if (text["num_hidden_layers"], text["num_experts"]) != (NUM_LAYERS, NUM_EXPERTS):
        raise ValueError(f"this layout has {NUM_LAYERS} layers of {NUM_EXPERTS} experts")
    moe_layers = list(range(text["first_k_dense_replace"], NUM_LAYERS))
    write_layered_repo(out, params, NUM_LAYERS, moe_layers, _core_tensors, _expert_tensors, seed=0, noise=False)
