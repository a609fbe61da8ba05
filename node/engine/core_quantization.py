"""The core in 8-bit MLX weights (`pull --core-bits 8`): "halving memory", measured, not assumed.

The pulled BF16 core is loaded as `run` loads it (mlx-lm's model with streaming expert blocks,
so no routed expert exists to be quantised: they are streamed in their upstream precision) and
quantised with mlx-lm's own machinery, `nn.quantize` with a class predicate, into affine 8-bit
weights with BF16 scales and biases. Each layer gets the widest group of GROUP_SIZES (128, 64,
32) that divides its input width: 8.25 bits a weight at 128, 8.5 at 64, 9 at 32, so 128 where
the width allows and 32 only where nothing wider fits (the latent MoE's 32-wide
`routed_expert_up_proj`, MLA's `unembed_out`), which otherwise stayed in BF16 at 16 bits.
What stays in full precision and why:
    norms, biases, KDA's decay/conv parameters   not Linear/Embedding layers: not quantised
    the router (`...mlp.gate`, `router`)         a small layer whose scores pick the experts; an
                                                 error there changes which experts run
    what the architecture's `quant_predicate` vetoes (K3's `*res_proj`, read as a vector)
    layers whose input width no group size divides (16-wide KDA `f_b_proj`/`g_b_proj`, MLA's
    `embed_q`): mlx-lm skips them too
The embedding and the output head are quantised (as mlx-lm's own `convert -q` does): they are a
large share of a small model's core, and the measured quality includes their error.

Quality is measured, not assumed: `python benchmarks/bench_core_bits.py` compares the 8-bit core
with the BF16 one on held-out text (resident bytes, top-1 agreement, KL, and the BF16-in-float32
noise floor). Its figures, and why 8-bit affine weights stop short of exactly half the bytes and of
BF16's agreement on the demo model, are in docs/benchmarks.md.

The result is saved under mlx-lm's parameter names in one `model-core-q8.safetensors`; mlx-lm's
`load_model` recognises quantised layers by their `.scales` and reads each layer's group size
from its shapes (its `infer_quant_config`), so `run` needs no special path. Where the config names
no quantisation at all, a top-level `"quantization"` entry is added so mlx-lm runs that step;
expert packing keeps being read from the expert tensors themselves.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.mla import MultiLinear

from expertmesh.node.errors import ExpertmeshError
from expertmesh.node.hub.pull import PullResult, pull, write_marker
from expertmesh.node.model.expert_index import INDEX_FILENAME, ExpertIndex

CORE_BITS = (16, 8)  # 16: the upstream precision (BF16), as pulled
GROUP_SIZES = (128, 64, 32)  # the widest that divides a layer's input width is used
GROUP_SIZE = 64  # the top-level default written into a config that names no quantisation
QUANTIZED_FILE = "model-core-q8.safetensors"
_ROUTER_NAMES = ("gate", "router")


class CoreBitsError(ExpertmeshError):
    pass


@dataclass
class CoreQuantization:
    bits: int
    group_size: int  # the config's default; each layer's own is in its shapes (group_size_for)
    core_bytes_before: int
    core_bytes_after: int
    quantized_layers: list[str]
    kept_layers: list[str]  # Linear/Embedding/MultiLinear layers left in full precision


def core_parameter_bytes(model: nn.Module) -> int:
    """Bytes of the core's parameters as they sit in memory (the resident core)."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def is_router(path: str) -> bool:
    return path.rsplit(".", 1)[-1] in _ROUTER_NAMES


_LAYERS = (nn.Linear, nn.Embedding, MultiLinear)  # MultiLinear: MLA's per-head embed_q/unembed_out


def group_size_for(width: int, group_sizes: tuple[int, ...] = GROUP_SIZES) -> int | None:
    """The widest group size that divides a layer's input `width`, or None if none does."""
    return next((g for g in group_sizes if width % g == 0), None)


def quantizable(path: str, module: nn.Module, group_sizes: tuple[int, ...] = GROUP_SIZES) -> bool:
    """The class predicate: Linear, Embedding and MultiLinear layers except routers, where the width allows."""
    if not isinstance(module, _LAYERS) or not hasattr(module, "to_quantized"):
        return False
    return not is_router(path) and group_size_for(module.weight.shape[-1], group_sizes) is not None


def quantize_model(
    model: nn.Module, bits: int = 8, group_sizes: tuple[int, ...] = GROUP_SIZES
) -> tuple[list[str], list[str]]:
    """Quantise `model`'s core in place; returns (quantised layer paths, kept layer paths).

    Each layer is packed in the widest of `group_sizes` that divides its input width. The
    architecture's own `quant_predicate` (mlx-lm's, e.g. K3 keeps `*res_proj`, whose weight is
    read as a vector, not multiplied) can only veto a layer; routers stay unquantised even where
    mlx-lm would give them 8 bits.
    """
    arch_predicate = getattr(model, "quant_predicate", None)
    done, kept = [], []

    def predicate(path: str, module: nn.Module) -> bool | dict:
        if not isinstance(module, _LAYERS):
            return False
        ok = quantizable(path, module, group_sizes) and (
            arch_predicate is None or arch_predicate(path, module) is not False
        )
        (done if ok else kept).append(path)
        if not ok:
            return False
        return {"group_size": group_size_for(module.weight.shape[-1], group_sizes), "bits": bits, "mode": "affine"}

    nn.quantize(model, class_predicate=predicate)
    return done, kept


def quantize_core(model_dir: Path, bits: int = 8, group_sizes: tuple[int, ...] = GROUP_SIZES) -> CoreQuantization:
    """Replace the BF16 core shards in `model_dir` by one file of `bits`-bit weights, on the
    process's MLX thread (node/engine/model_thread.py), like every MLX evaluation.

    Raises:
        CoreBitsError: `bits` is not one of CORE_BITS.
    """
    from expertmesh.node.engine.model_thread import model_thread

    check_core_bits(bits)
    return model_thread().call(_quantize_core, Path(model_dir), bits, group_sizes)


def _quantize_core(model_dir: Path, bits: int, group_sizes: tuple[int, ...]) -> CoreQuantization:
    from expertmesh.node.engine.blocks import core_standins, load_core_model

    index = ExpertIndex.load(model_dir / INDEX_FILENAME)
    model, _, _ = load_core_model(model_dir, core_standins(index, 16))  # only a BF16 core is quantised
    before = core_parameter_bytes(model)
    done, kept = quantize_model(model, bits, group_sizes)
    group_size = GROUP_SIZE if GROUP_SIZE in group_sizes else group_sizes[0]
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
    index = {
        "metadata": {"total_size": after, "expertmesh": f"core only, {bits}-bit"},
        "weight_map": {k: QUANTIZED_FILE for k in weights},
    }
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


# Core tensors that say the upstream core is quantised already: MLX's scales, FP8 and
# compressed-tensors' scales, packed integer or 8-bit float weights.
_QUANTISED_SUFFIXES = (".scales", ".weight_scale", ".weight_scale_inv", ".weight_packed")
_QUANTISED_DTYPES = ("U32", "I32", "U8", "I8", "F8_E4M3", "F8_E5M2")


def refuse_requantising(repo_id: str, index: ExpertIndex, core_bits: int | None) -> None:
    """`--core-bits 8` on a core published quantised (an mlx-lm conversion, an FP8 checkpoint) would
    make nothing smaller, and recording 8 bits would say otherwise: refuse before anything is fetched."""
    if core_bits in (None, 16):
        return
    sign = next(
        (t for t in index.core.values() if t.name.endswith(_QUANTISED_SUFFIXES) or t.dtype in _QUANTISED_DTYPES), None
    )
    if sign is not None:
        raise CoreBitsError(
            f"{repo_id}'s core is already quantised as published (it has {sign.name}, {sign.dtype}): --core-bits "
            f"{core_bits} would not make it smaller; pull it without --core-bits"
        )


def pull_with_core_bits(repo_id: str, core_bits: int | None = None, **pull_args) -> PullResult:
    """`pull` (node/hub/pull.py), then the core quantised to `core_bits` where asked: what
    `expertmesh pull --core-bits` runs. None keeps what is pulled (16, the upstream BF16, if new);
    a quantised core that `pull` found damaged and pulled anew is quantised again.

    The marker is rewritten only once the quantised core is in place, so an interrupted
    quantisation leaves a complete BF16 pull that the next run quantises.

    Raises:
        CoreBitsError: a `core_bits` other than one of CORE_BITS, a core published quantised
            already (refused before its bytes are fetched), or 16 for a core stored in 8 bits.
        and what `pull` raises.
    """
    if core_bits is not None:
        check_core_bits(core_bits)
    result = pull(repo_id, check_index=lambda index: refuse_requantising(repo_id, index, core_bits), **pull_args)
    wanted = core_bits or result.repaired_core_bits
    if wanted is None or wanted == result.core_bits or result.core_bytes == 0:  # as pulled, or --index-only
        return result
    if result.core_bits != 16:
        raise CoreBitsError(
            f"{repo_id} @ {result.commit[:12]} is pulled with a {result.core_bits}-bit core; the BF16 core "
            f"is no longer here: delete {result.path} and pull again"
        )
    refuse_requantising(repo_id, ExpertIndex.load(result.path / INDEX_FILENAME), wanted)
    q = quantize_core(result.path, wanted)  # the BF16 core is here: quantise it in place
    result = dataclasses.replace(result, core_bits=wanted, core_bytes=q.core_bytes_after, already_complete=False)
    write_marker(result.path, result)
    return result
