"""The core in 8-bit MLX weights (`pull --core-bits 8`): "halving memory", measured, not assumed.

The pulled BF16 core is loaded as `run` loads it (mlx-lm's model with streaming expert blocks,
so no routed expert exists to be quantised: they are streamed in their upstream precision) and
quantised with mlx-lm's own machinery, `nn.quantize` with a class predicate, into affine 8-bit
weights in groups of 64. What stays in full precision and why:
    norms, biases, KDA's decay/conv parameters   not Linear/Embedding layers: never quantised
    the router (`...mlp.gate`, `router`)         a small layer whose scores pick the experts; an
                                                 error there changes which experts run
    what the architecture's `quant_predicate` vetoes (K3's `*res_proj`, read as a vector)
    layers whose input width is not a multiple of the group size (mlx-lm skips them too)
The embedding and the output head are quantised (as mlx-lm's own `convert -q` does): they are a
large share of a small model's core, and the demo's quality numbers below include their error.

The result is saved under mlx-lm's parameter names in one `model-core-q8.safetensors`; mlx-lm's
`load_model` recognises quantised layers by their `.scales` (its `infer_quant_config`), so `run`
needs no special path. Where the config names no quantisation at all, a top-level
`"quantization"` entry is added so mlx-lm runs that step; expert packing keeps being read from the
expert tensors themselves.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from node.errors import ExpertmeshError

CORE_BITS = (16, 8)  # 16: the upstream precision (BF16), as pulled
GROUP_SIZE = 64
QUANTIZED_FILE = "model-core-q8.safetensors"
_ROUTER_NAMES = ("gate", "router")


class CoreBitsError(ExpertmeshError):
    pass


@dataclass
class CoreQuantization:
    bits: int
    group_size: int
    core_bytes_before: int
    core_bytes_after: int
    quantized_layers: list[str]
    kept_layers: list[str]  # Linear/Embedding layers left in full precision


def core_parameter_bytes(model: nn.Module) -> int:
    """Bytes of the core's parameters as they sit in memory (the resident core)."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def is_router(path: str) -> bool:
    return path.rsplit(".", 1)[-1] in _ROUTER_NAMES


def quantizable(path: str, module: nn.Module, group_size: int = GROUP_SIZE) -> bool:
    """The class predicate: Linear and Embedding layers except routers, where the width allows."""
    if not isinstance(module, (nn.Linear, nn.Embedding)) or not hasattr(module, "to_quantized"):
        return False
    return not is_router(path) and module.weight.shape[-1] % group_size == 0


def quantize_model(model: nn.Module, bits: int = 8, group_size: int = GROUP_SIZE) -> tuple[list[str], list[str]]:
    """Quantise `model`'s core in place; returns (quantised layer paths, kept layer paths).

    The architecture's own `quant_predicate` (mlx-lm's, e.g. K3 keeps `*res_proj`, whose weight
    is read as a vector, not multiplied) can only veto a layer; routers stay unquantised even
    where mlx-lm would give them 8 bits.
    """
    arch_predicate = getattr(model, "quant_predicate", None)
    done, kept = [], []

    def predicate(path: str, module: nn.Module) -> bool:
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            return False
        ok = quantizable(path, module, group_size) and (arch_predicate is None or arch_predicate(path, module) is not False)
        (done if ok else kept).append(path)
        return ok

    nn.quantize(model, group_size=group_size, bits=bits, mode="affine", class_predicate=predicate)
    return done, kept


def quantize_core(model_dir: Path, bits: int = 8, group_size: int = GROUP_SIZE) -> CoreQuantization:
    """Replace the BF16 core shards in `model_dir` by one file of `bits`-bit weights.

    Raises:
        CoreBitsError: `bits` is not one of CORE_BITS.
    """
    from node.engine import load_core_model

    check_core_bits(bits)
    model_dir = Path(model_dir)
    model, _, _ = load_core_model(model_dir)
    before = core_parameter_bytes(model)
    done, kept = quantize_model(model, bits, group_size)
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(list(weights.values()))
    after = sum(v.nbytes for v in weights.values())

    tmp = model_dir / ".core-partial.safetensors"  # not matched by mlx-lm's model*.safetensors
    mx.save_safetensors(str(tmp), weights, metadata={"format": "mlx", "expertmesh": f"core q{bits}"})
    old = [p for p in model_dir.glob("model*.safetensors")]
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    text = config.get("text_config", {})
    if not any(k in config or k in text for k in ("quantization", "quantization_config")):
        config["quantization"] = {"group_size": group_size, "bits": bits, "mode": "affine"}
        _write_atomic(config_path, json.dumps(config, indent=2))
    for p in old:
        p.unlink()
    os.replace(tmp, model_dir / QUANTIZED_FILE)
    index = {"metadata": {"total_size": after, "expertmesh": f"core only, {bits}-bit"},
             "weight_map": {k: QUANTIZED_FILE for k in weights}}  # fmt: skip
    _write_atomic(model_dir / "model.safetensors.index.json", json.dumps(index, indent=1))
    return CoreQuantization(bits, group_size, before, after, done, kept)


def check_core_bits(bits: int) -> int:
    if bits not in CORE_BITS:
        raise CoreBitsError(f"--core-bits must be one of {', '.join(map(str, CORE_BITS))}, not {bits}")
    return bits


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
