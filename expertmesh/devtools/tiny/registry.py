"""A tiny repo for every Mixture-of-Experts architecture of the installed mlx-lm.

tests/test_registry.py streams each of these and compares with mlx-lm, so the list of supported
architectures in README.md is measured, not claimed. Each repo is small (2 layers of 8 experts,
hidden size 64) so that all of them run in CI in well under a few minutes.

How a repo is made, without a hand-written maker per architecture:

- the config: mlx-lm's own `ModelArgs` fields, each set from one table of tiny values
  (`TINY`) when the architecture has it, plus the few per-architecture settings an
  architecture needs to have routed experts at all (`OVERRIDES`);
- the core: mlx-lm's freshly initialised parameters under mlx-lm's names (every sanitize
  accepts those), norms and biases perturbed;
- the experts: written in the first of a few upstream layouts (`LAYOUTS`: per-expert tensors
  under the names the makers use, stacked fused gate/up `(E, 2·I, H)`, its transpose,
  granite's `input_linear`, gpt-oss's mxfp4 blocks, FP8 with block scales) that mlx-lm's
  sanitize turns into exactly the model's parameters — checked by tracing sanitize on the
  layout's names and shapes (node/model/expert_trace.py), never by trying a load. Values are
  random with the scale of a trained layer (1/√fan-in); mlx-lm's load of the repo is the
  oracle, so what sanitize does to them needs no inverse here.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from expertmesh.devtools.tiny.common import (
    Shard,
    Tensor,
    init_parameters,
    perturb,
    tensor,
    write_generation_config,
    write_json,
    write_readme,
    write_shards,
)
from expertmesh.devtools.tiny.tokenizer import write_tokenizer_files
from expertmesh.node.model import expert_trace, mlx_lm_models

VOCAB_SIZE = 448
NUM_EXPERTS = 8
TOP_K = 2

# Tiny values for the ModelArgs fields architectures share, set wherever an architecture has one.
TINY: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 96,
    "ffn_hidden_size": 96,
    "moe_intermediate_size": 32,
    "expert_ffn_hidden_size": 32,
    "shared_expert_intermediate_size": 32,
    "shared_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_attention_groups": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "model_max_length": 1024,
    "rms_norm_eps": 1e-5,
    "norm_eps": 1e-5,
    "layer_norm_epsilon": 1e-5,
    "layernorm_epsilon": 1e-5,
    "rope_theta": 10000.0,
    "num_experts": NUM_EXPERTS,
    "n_routed_experts": NUM_EXPERTS,
    "num_local_experts": NUM_EXPERTS,
    "moe_num_experts": NUM_EXPERTS,
    "num_experts_per_tok": TOP_K,
    "num_experts_per_token": TOP_K,
    "moe_topk": TOP_K,
    "moe_k": TOP_K,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "num_shared_expert": 1,
    "norm_topk_prob": True,
    "first_k_dense_replace": 0,
    "num_dense_layers": 0,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "moe_layer_freq": 1,
    "routed_scaling_factor": 1.5,
    "n_group": 1,
    "topk_group": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "use_bias": False,
    "mlp_bias": False,
    "partial_rotary_factor": 1.0,
    "rope_scaling": None,  # only where the architecture requires the field (see _fill)
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "use_qk_norm": True,
    "sliding_window": 64,
    "sliding_window_size": 64,
    # gated-delta (linear attention) layers: qwen3_next, qwen3_5
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 2,
    # phixtral's names
    "num_vocab": VOCAB_SIZE,
    "model_dim": 64,
    "num_heads": 4,
    "rotary_dim": 8,
}
# Fields whose architecture default is safer than None: set only where a value is required.
_ONLY_IF_REQUIRED = {"rope_scaling"}

_MISTRAL4_ROPE = {"rope_theta": 1e4, "llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 1024}
_GEMMA4 = {
    "enable_moe_block": True,
    "num_kv_shared_layers": 0,
    "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window_pattern": 2,
    "global_head_dim": 16,
    "hidden_size_per_layer_input": 16,
    "vocab_size_per_layer_input": VOCAB_SIZE,
    "top_k_experts": TOP_K,
}

# Kimi's linear attention in the tiny repos: one KDA layer, then one full-attention layer.
_KDA_ATTENTION = {
    "kda_layers": [1],
    "full_attn_layers": [2],
    "num_heads": 4,
    "head_dim": 16,
    "short_conv_kernel_size": 4,
}

# What an architecture needs beyond TINY: its layer pattern, nested text config, required flags.
# `text_args` names the ModelArgs class TINY fills `text_config` from (module.Class).
OVERRIDES: dict[str, dict[str, Any]] = {
    "afmoe": {"layer_types": ["full_attention", "sliding_attention"], "num_dense_layers": 0},
    "bailing_hybrid": {"layer_group_size": 2, "group_norm_size": 1},
    "bailing_moe_linear": {"layer_group_size": 2, "group_norm_size": 1},
    "exaone_moe": {"layer_types": ["full_attention", "sliding_attention"], "is_moe_layer": [True, True]},
    "ernie4_5_moe": {"moe_k": TOP_K, "moe_layer_start_index": 0, "moe_layer_interval": 1},
    "granitemoe": {
        "logits_scaling": 1.0,
        "attention_multiplier": 0.25,
        "embedding_multiplier": 1.0,
        "residual_multiplier": 1.0,
    },
    "granitemoehybrid": {
        "logits_scaling": 1.0,
        "attention_multiplier": 0.25,
        "embedding_multiplier": 1.0,
        "residual_multiplier": 1.0,
        "layer_types": ["mamba", "attention"],
        "num_local_experts": NUM_EXPERTS,
        "mamba_n_heads": 4,
        "mamba_d_head": 32,
        "mamba_d_state": 16,
        "mamba_n_groups": 1,
        "mamba_d_conv": 4,
    },
    "jamba": {
        "attn_layer_offset": 1,
        "attn_layer_period": 2,
        "expert_layer_offset": 0,
        "expert_layer_period": 1,
        "mamba_d_conv": 4,
        "mamba_d_state": 8,
        "mamba_expand": 2,
    },
    "lfm2_moe": {"use_expert_bias": True, "conv_bias": False, "conv_L_cache": 3, "full_attn_idxs": [1]},
    "mimo_v2_flash": {
        "hybrid_layer_pattern": [0, 1],
        "moe_layer_freq": [1, 1],
        "add_swa_attention_sink_bias": True,
        "add_full_attention_sink_bias": False,
        "swa_rope_theta": 10000.0,
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 2,
        "swa_head_dim": 16,
        "swa_v_head_dim": 16,
    },
    "minimax": {"rotary_dim": 8},
    "nemotron_h": {
        "hybrid_override_pattern": "ME*E",  # mlx-lm reads the cache of an attention (*) layer
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "ssm_state_size": 8,
        "conv_kernel": 4,
        "n_groups": 1,
        "use_conv_bias": True,
    },
    "qwen3_next": {"partial_rotary_factor": 0.5},
    "kimi_linear": {
        "linear_attn_config": _KDA_ATTENTION,
        "first_k_dense_replace": 0,
        "num_experts_per_token": TOP_K,
    },
    "glm_moe_dsa": {"index_head_dim": 16, "index_n_heads": 2, "index_topk": 8, "rope_parameters": {"rope_theta": 1e4}},
    "hunyuan": {
        "use_mixed_mlp_moe": True,
        "use_cla": False,
        "cla_share_factor": 1,
        "rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"},
    },
    "deepseek_v2": {"rope_scaling": {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 1024}},
    "mellum": {
        "layer_types": ["full_attention", "sliding_attention"],
        "rope_parameters": {"full_attention": {"rope_theta": 1e4}, "sliding_attention": {"rope_theta": 1e4}},
    },
    "mistral4": {"rope_parameters": _MISTRAL4_ROPE},
    "mistral3": {
        "text_args": "mistral4.ModelArgs",
        "text": {"model_type": "mistral4", "rope_parameters": _MISTRAL4_ROPE},
    },
    "longcat_flash": {
        "attention_method": "MLA",
        "zero_expert_type": "identity",
        "zero_expert_num": 2,
        "mla_scale_q_lora": True,
        "mla_scale_kv_lora": True,
    },
    "longcat_flash_ngram": {
        "zero_expert_num": 2,
        "mla_scale_q_lora": True,
        "mla_scale_kv_lora": True,
        "ngram_vocab_size_ratio": 2,
        "emb_neighbor_num": 2,
        "emb_split_num": 2,
    },
    "kimi_k25": {"text_args": "deepseek_v3.ModelArgs", "text": {"model_type": "deepseek_v3"}},
    "kimi_vl": {"text_args": "kimi_vl.TextArgs", "text": {"model_type": "deepseek_v3"}},
    "llama4": {
        "text_args": "llama4.TextArgs",
        "text": {
            "num_hidden_layers": 4,  # every fourth layer is a global-attention one
            "model_type": "llama4_text",
            "interleave_moe_layer_step": 1,
            "attention_chunk_size": 64,
            "intermediate_size_mlp": 96,
            "rope_scaling": None,
            "num_experts_per_tok": 1,  # mlx-lm's llama4 routes each token to one expert
        },
    },
    "minimax_m3_vl": {"text_args": "minimax_m3_vl.TextArgs", "text": {"moe_layer_freq": [1, 1], "rotary_dim": 8}},
    "qwen3_5": {"text_args": "qwen3_5.TextModelArgs", "text": {"model_type": "qwen3_5_moe_text"}},
    "qwen3_5_moe": {"text_args": "qwen3_5.TextModelArgs", "text": {"model_type": "qwen3_5_moe_text"}},
    "qwen3_vl_moe": {"text_args": "qwen3_moe.ModelArgs", "text": {"model_type": "qwen3_vl_moe_text"}},
    "gemma4": {"text_args": "gemma4_text.ModelArgs", "text": {"model_type": "gemma4_text", **_GEMMA4}},
    "gemma4_text": _GEMMA4,
    "kimi_k3": {
        "text_args": "kimi_k3.TextArgs",
        "text": {
            "model_type": "kimi_linear",
            "linear_attn_config": _KDA_ATTENTION,
            "num_key_value_heads": 4,
            "hidden_act": "situ",
            "activation_situ_beta": 1.0,
            "attn_res_block_size": 2,
            "q_lora_rank": None,
            "mla_use_nope": True,
            "moe_router_activation_func": "sigmoid",
            "num_expert_group": 1,
            "routed_expert_hidden_size": 32,
            "latent_moe_use_norm": True,
        },
    },
    "muse_spark": {
        "text_args": "muse_spark.TextArgs",
        # transformers' config (which loads the tokenizer) checks the audio encoder's width
        "audio_config": {"out_hidden_size": TINY["hidden_size"]},
        "text": {
            "post_norm_eps": 1e-5,
            "rope_parameters": {"rope_theta": 1e4},
            "layer_rope_theta": [1e4, 1e4],
            "layer_types": ["full_attention", "sliding_attention"],
            "final_logit_softcapping": 30.0,
            "output_multiplier": 1.0,
            "moe_hidden_size": 32,
            "num_shared_experts": 0,
        },
    },
    "step3p5": {
        "moe_layers_enum": "0,1",
        "share_expert_dim": 32,
        "moe_num_experts": NUM_EXPERTS,
        "moe_top_k": TOP_K,
        "moe_intermediate_size": 32,
        "core_names": [
            (".mlp.gate.gate.", ".moe.gate."),
            (".mlp.gate.router_bias", ".moe.router_bias"),
            (".mlp.share_expert.", ".share_expert."),
        ],
    },
}

# model_type to put in config.json when it is not the module's name (mlx-lm remaps it).
MODEL_TYPES: dict[str, str] = {}

# Architectures no tiny repo can be made for yet, and why.
NO_MAKER: dict[str, str] = {
    "prism_hadamard_qwen35": "a PRISM Hadamard-rotated checkpoint (its ModelArgs.modules names packed, "
    "sign-rotated modules); no tiny maker writes one yet",
}


def tiny_config(module: str, sizes: dict[str, int] | None = None) -> dict:
    """A tiny config.json for mlx-lm's `module`, from TINY (its widths replaced by `sizes`) and
    the module's OVERRIDES.

    Raises:
        ValueError: a required ModelArgs field has no tiny value (the message names it).
    """
    overrides = dict(OVERRIDES.get(module, {}))
    text_args = overrides.pop("text_args", None)
    text = overrides.pop("text", {})
    overrides.pop("core_names", None)
    args_class = importlib.import_module(f"mlx_lm.models.{module}").ModelArgs
    tiny = {**TINY, **(sizes or {})}
    config = _fill(args_class, {"model_type": MODEL_TYPES.get(module, module), **overrides}, tiny)
    if text_args:
        mod, cls = text_args.split(".")
        text_class = getattr(importlib.import_module(f"mlx_lm.models.{mod}"), cls)
        config["text_config"] = _fill(text_class, {**{k: v for k, v in overrides.items()}, **text}, tiny)
        for key in ("vocab_size", "tie_word_embeddings"):
            if config["text_config"].get(key) is not None:
                config.setdefault(key, config["text_config"][key])
    return config


def _fill(args_class: type, overrides: dict, tiny: dict[str, Any]) -> dict:
    out = {}
    for f in dataclasses.fields(args_class):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if f.name in overrides:
            out[f.name] = overrides[f.name]
        elif f.name in tiny and (required or f.name not in _ONLY_IF_REQUIRED):
            out[f.name] = tiny[f.name]
        elif required:
            if f.name in ("text_config", "vision_config"):
                out[f.name] = {}
                continue
            raise ValueError(f"no tiny value for the required field {f.name!r} of {args_class.__module__}")
    out.update({k: v for k, v in overrides.items() if k not in out})
    return out


# -- expert layouts --------------------------------------------------------------------------


Shapes = dict[str, tuple[int, ...]]  # projection -> its stacked weight's shape (E, out, in)
ExpertSpec = tuple[str, str, tuple[int, ...], int | None]  # name, safetensors dtype, shape, fan-in


@dataclass(frozen=True)
class Layout:
    """One way makers publish a layer's routed experts.

    `tensors(block, shapes, biases)` lists `(name, dtype, shape, fan_in)` for a block at mlx-lm
    path `block` whose projections have stacked weights of `shapes` (proj -> (E, out, in)) and
    additive biases for the projections in `biases`; `fan_in` scales the random values (None:
    bytes written as they are, e.g. fp8 or packed fp4 codes); no tensors: not this layout.
    """

    name: str
    description: str
    tensors: Callable[[str, Shapes, set[str]], list[ExpertSpec]]
    quantization_config: dict | None = None


_W = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_GLU = ("gate_proj", "up_proj", "down_proj")


def _parent(block: str) -> str:
    return block.rsplit(".", 1)[0]


def _experts(shapes: Shapes) -> int:
    return next(iter(shapes.values()))[0]


def _per_expert(names: dict[str, str], moe: Callable[[str], str], group: str = "experts") -> Callable:
    """`{moe}.{group}.{e}.{name}.weight` (and `.bias`) per expert, for the projections in `names`."""

    def tensors(block: str, shapes: Shapes, biases: set[str]) -> list:
        if set(shapes) != set(names):
            return []
        out: list[ExpertSpec] = []
        for e in range(_experts(shapes)):
            for proj, (_, o, i) in shapes.items():
                out.append((f"{moe(block)}.{group}.{e}.{names[proj]}.weight", "BF16", (o, i), i))
                if proj in biases:
                    out.append((f"{moe(block)}.{group}.{e}.{names[proj]}.bias", "BF16", (o,), i))
        return out

    return tensors


def _per_expert_fp8(block: str, shapes: Shapes, biases: set[str]) -> list:
    if set(shapes) != set(_GLU) or biases:
        return []
    out: list[ExpertSpec] = []
    for e in range(_experts(shapes)):
        for proj, (_, o, i) in shapes.items():
            name = f"{_parent(block)}.experts.{e}.{proj}"
            out.append((f"{name}.weight", "F8_E4M3", (o, i), None))
            out.append((f"{name}.weight_scale_inv", "F32", (math.ceil(o / 128), math.ceil(i / 128)), i))
    return out


def _fused(transposed: bool, base: Callable[[str], str], gate_up: str, down: str, suffix: str = "") -> Callable:
    def tensors(block: str, shapes: Shapes, biases: set[str]) -> list:
        if set(shapes) != set(_GLU) or biases:
            return []
        e, inter, hidden = shapes["gate_proj"]
        b = base(block)
        if transposed:
            return [
                (f"{b}.{gate_up}{suffix}", "BF16", (e, hidden, 2 * inter), hidden),
                (f"{b}.{down}{suffix}", "BF16", (e, inter, hidden), inter),
            ]
        return [
            (f"{b}.{gate_up}{suffix}", "BF16", (e, 2 * inter, hidden), hidden),
            (f"{b}.{down}{suffix}", "BF16", (e, hidden, inter), inter),
        ]

    return tensors


def _stacked(rename: Callable[[str], str | None]) -> Callable:
    def tensors(block: str, shapes: Shapes, biases: set[str]) -> list:
        base = rename(block)
        if base is None or biases:
            return []
        return [(f"{base}.{p}.weight", "BF16", shape, shape[-1]) for p, shape in shapes.items()]

    return tensors


def _gpt_oss_mxfp4(block: str, shapes: Shapes, biases: set[str]) -> list:
    if set(shapes) != set(_GLU):
        return []
    e, inter, hidden = shapes["gate_proj"]
    b = f"{_parent(block)}.experts"
    return [
        (f"{b}.gate_up_proj_blocks", "U8", (e, 2 * inter, hidden // 32, 16), None),
        (f"{b}.gate_up_proj_scales", "U8", (e, 2 * inter, hidden // 32), None),
        (f"{b}.gate_up_proj_bias", "BF16", (e, 2 * inter), hidden),
        (f"{b}.down_proj_blocks", "U8", (e, hidden, inter // 32, 16), None),
        (f"{b}.down_proj_scales", "U8", (e, hidden, inter // 32), None),
        (f"{b}.down_proj_bias", "BF16", (e, hidden), inter),
    ]


_FUSED = "stacked, gate and up fused: `experts.gate_up_proj` (E, 2·I, H) + `experts.down_proj`"
LAYOUTS: list[Layout] = [
    Layout("fp8", "per-expert FP8 e4m3 + 128×128 block scales (`weight_scale_inv`)", _per_expert_fp8),
    Layout(
        "per_expert", "per-expert BF16 `experts.{e}.{gate,up,down}_proj`", _per_expert({p: p for p in _GLU}, _parent)
    ),
    Layout("per_expert_w123", "per-expert BF16 `experts.{e}.{w1,w3,w2}`", _per_expert(_W, _parent)),
    Layout(
        "block_sparse_moe",
        "per-expert BF16 `block_sparse_moe.experts.{e}.{w1,w3,w2}`",
        _per_expert(_W, lambda b: re.sub(r"\.mlp$", ".block_sparse_moe", _parent(b))),
    ),
    Layout(
        "per_expert_fc",
        "per-expert BF16 `experts.{e}.{up,down}_proj` (SwitchMLP: no gate)",
        _per_expert({"fc1": "up_proj", "fc2": "down_proj"}, _parent),
    ),
    Layout(
        "phixtral",
        "per-expert BF16 `moe.mlp.{e}.{fc1,fc2}` with biases (SwitchMLP: no gate)",
        _per_expert({"fc1": "fc1", "fc2": "fc2"}, _parent, group="mlp"),
    ),
    Layout("fused", _FUSED, _fused(False, lambda b: f"{_parent(b)}.experts", "gate_up_proj", "down_proj")),
    Layout("fused_in_block", _FUSED, _fused(False, _parent, "gate_up_proj", "down_proj")),
    Layout(
        "fused_transposed",
        "stacked, gate and up fused, transposed: `experts.gate_up_proj` (E, H, 2·I) + `experts.down_proj`",
        _fused(True, lambda b: f"{_parent(b)}.experts", "gate_up_proj", "down_proj"),
    ),
    Layout(
        "granite",
        "stacked, gate and up fused: `input_linear` (E, 2·I, H) + `output_linear`",
        _fused(False, _parent, "input_linear", "output_linear", ".weight"),
    ),
    Layout(
        "stacked_moe",
        "stacked, one tensor per projection: `moe.{gate,up,down}_proj.weight` (E, out, in)",
        _stacked(lambda b: b.removesuffix(".mlp.switch_mlp") + ".moe" if b.endswith(".mlp.switch_mlp") else None),
    ),
    Layout(
        "mxfp4_blocks",
        "stacked mxfp4 blocks, gate/up rows interleaved: `experts.gate_up_proj_{blocks,scales,bias}`",
        _gpt_oss_mxfp4,
        {"quant_method": "mxfp4"},
    ),
    Layout(
        "mlx_stacked",
        "stacked as mlx-lm names them, `switch_mlp.{gate,up,down}_proj.weight` (an MLX conversion)",
        _stacked(lambda b: b),
    ),
]


@dataclass
class Made:
    """What `build` wrote: the layout its experts are in and the config."""

    layout: Layout
    config: dict


def build(out: Path, module: str, seed: int = 0, sizes: dict[str, int] | None = None) -> Made:
    """Write a tiny repo of mlx-lm's `module` into `out` in the first layout sanitize accepts;
    `sizes` replaces some of TINY's widths.

    Raises:
        ValueError: no tiny config, no SwitchGLU in it, or no layout sanitize maps exactly onto
            the model's parameters (the message says which).
    """
    if module in NO_MAKER:
        raise ValueError(NO_MAKER[module])
    config = tiny_config(module, sizes)
    model = mlx_lm_models.build_model(config)
    blocks = mlx_lm_models.expert_blocks(model)
    if not blocks:
        raise ValueError(f"the tiny config of {module} builds no expert block")
    params = init_parameters(config, seed)
    block_shapes: dict[str, Shapes] = {}
    block_biases: dict[str, set[str]] = {}
    for b in blocks:
        projs = [p for p in ("gate_proj", "up_proj", "down_proj", "fc1", "fc2") if f"{b}.{p}.weight" in params]
        block_shapes[b] = {p: tuple(params[f"{b}.{p}.weight"].shape) for p in projs}
        block_biases[b] = {p for p in projs if f"{b}.{p}.bias" in params}
    core = {}
    for k, v in params.items():
        if not any(k.startswith(f"{b}.{p}.") for b in block_shapes for p in block_shapes[b]):
            for mlx_name, upstream in OVERRIDES.get(module, {}).get("core_names", []):
                k = k.replace(mlx_name, upstream)
            core[k] = v
    wanted = {k: tuple(v.shape) for k, v in params.items()}
    reasons = []
    for layout in LAYOUTS:
        experts = [t for b, shapes in block_shapes.items() for t in layout.tensors(b, shapes, block_biases[b])]
        if not experts:
            continue
        cfg = dict(config)
        if layout.quantization_config:
            cfg["quantization_config"] = layout.quantization_config
        problem = _mismatch(cfg, core, experts, wanted)
        if problem is None:
            _write(out, module, seed, cfg, core, experts, layout)
            return Made(layout, cfg)
        reasons.append(f"{layout.name}: {problem}")
    raise ValueError(f"no expert layout sanitize maps onto {module}'s parameters ({'; '.join(reasons)})")


def _mismatch(config: dict, core: dict[str, mx.array], experts: list, wanted: dict[str, tuple[int, ...]]) -> str | None:
    """Why sanitize would not turn this repo into exactly the model's parameters (None: it would)."""
    model = mlx_lm_models.build_model(config)
    tensors = {k: (_st_dtype(v.dtype), tuple(v.shape)) for k, v in core.items()}
    tensors.update({name: (dtype, shape) for name, dtype, shape, _ in experts})
    try:
        out = expert_trace.trace_sanitize(model, tensors)
    except expert_trace.Untraceable as e:
        return str(e)
    if config.get("quantization_config"):
        import mlx.nn as nn

        nn.quantize(model, 32, 4, mode="mxfp4", class_predicate=lambda p, m: f"{p}.scales" in out)
        wanted = {k: tuple(v.shape) for k, v in mlx_lm_models.flat_parameters(model).items()}
    got = {k: tuple(v.shape) for k, v in out.items() if isinstance(v, expert_trace.Sym) and v._shape is not None}
    missing, extra = sorted(set(wanted) - set(got)), sorted(set(got) - set(wanted))
    if missing or extra:
        return f"missing {missing[:2]}, unexpected {extra[:2]}"
    bad = [k for k in wanted if wanted[k] != got[k]]
    return f"shapes differ for {bad[:2]}" if bad else None


def _st_dtype(dtype: mx.Dtype) -> str:
    return {mx.bfloat16: "BF16", mx.float16: "F16", mx.float32: "F32"}.get(dtype, "F32")


def _write(out: Path, module: str, seed: int, config: dict, core: dict, experts: list, layout: Layout) -> None:
    key = mx.random.key(seed + 7919)
    rng = np.random.default_rng(seed)
    core_tensors = []
    for name, a in core.items():
        key, sub = mx.random.split(key)
        if name.endswith(("norm.weight", "layernorm.weight", "e_score_correction_bias", "expert_bias")):
            a = perturb(a, 0.1, sub)
        keep = a.dtype if a.dtype == mx.float32 and not name.endswith(".weight") else mx.bfloat16
        core_tensors.append(tensor(name, a.astype(keep)))
    expert_tensors = [_expert_tensor(name, dtype, shape, fan_in, rng) for name, dtype, shape, fan_in in experts]
    layer_re = re.compile(r"layers\.(\d+)\.")

    def layer_of(t: Tensor) -> int:
        m = layer_re.search(t.name)
        return int(m.group(1)) if m else -1

    shards = [Shard(), Shard()]
    for t in sorted(core_tensors + expert_tensors, key=layer_of):  # layer by layer, experts after core
        shards[0 if layer_of(t) < 1 else 1].add(t)
    write_shards(out, [s for s in shards if s.tensors])
    write_json(out / "config.json", config)
    write_generation_config(out, write_tokenizer_files(out, VOCAB_SIZE))
    write_readme(out, module, seed, f"experts as {layout.description}.")


def _expert_tensor(
    name: str, dtype: str, shape: tuple[int, ...], fan_in: int | None, rng: np.random.Generator
) -> Tensor:
    if dtype == "F8_E4M3":
        values = mx.array(rng.standard_normal(shape).astype(np.float32))
        return Tensor(name, dtype, shape, np.array(mx.to_fp8(values)).tobytes())
    if dtype == "U8":  # packed fp4 codes or E8M0 exponents
        if name.endswith("_scales"):
            return Tensor(name, dtype, shape, np.full(shape, 123, dtype=np.uint8).tobytes())  # 2**-4
        return Tensor(name, dtype, shape, rng.integers(0, 256, shape, dtype=np.uint8).tobytes())
    drawn = rng.standard_normal(shape).astype(np.float32) / math.sqrt(fan_in or 1)
    if name.endswith("weight_scale_inv"):
        drawn = np.abs(drawn) + 1 / math.sqrt(fan_in or 1)
        return Tensor(name, dtype, shape, drawn.astype(np.float32).tobytes())
    return tensor(name, mx.array(drawn).astype(mx.bfloat16))
