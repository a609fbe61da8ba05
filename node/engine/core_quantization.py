"""The core in fewer bits (`pull --core-bits 8|4`, `--core-quant mixed_4_6`): memory halved or
quartered, measured, not assumed.

The pulled BF16 core is loaded as `run` loads it (mlx-lm's model with streaming expert blocks,
so no routed expert exists to be quantised: they are streamed in their upstream precision) and
quantised with mlx-lm's own machinery: `nn.quantize` with a class predicate, and for a mixed
recipe mlx-lm's `mixed_quant_predicate_builder` (what `mlx_lm.convert --quant-predicate` uses),
into affine weights with BF16 scales and biases.

Which layers get which bits, and why:
    --core-bits 8        every quantised layer 8-bit, in the widest group of (128, 64, 32) that
                         divides its input width: 8.25 bits a weight at 128, so 128 where the
                         width allows and 32 only where nothing wider fits (the latent MoE's
                         32-wide `routed_expert_up_proj`, MLA's `unembed_out`)
    --core-bits 4        every quantised layer 4-bit in groups of 64, mlx-lm's default for 4
                         bits: 4.5 bits a weight; groups of 128 would save 0.25 bit a weight and
                         cost more error than the 8-bit core's, and a layer 64 does not divide
                         stays BF16, as in mlx-lm's conversion (4 bits in groups of 32 would add
                         the error of both)
    --core-quant RECIPE  mlx-lm's recipe (after llama.cpp's Q4_K_M): the output head (`lm_head`)
                         and, in the first and last eighth of the layers and every third layer
                         between, the value projections (`v_proj`, `v_a_proj`, `v_b_proj`) and
                         `down_proj`s at the high bits (6, or 4 for mixed_3_4), everything else at
                         the low bits, groups of 64: the layers whose error the next ones amplify
What stays in full precision, whatever the bits:
    norms, biases, KDA's decay/conv parameters   not Linear/Embedding layers: not quantised
    the router (`...mlp.gate`, `router`)         a small layer whose scores pick the experts; an
                                                 error there changes which experts run. Below 8
                                                 bits it gets what the architecture's own
                                                 `quant_predicate` asks of mlx-lm for it (8 bits in
                                                 groups of 64 for K3 and Qwen3-MoE: the bytes of
                                                 mlx-lm's conversion), never the low bits; where it
                                                 asks nothing, and in an 8-bit core, it stays BF16
    what the architecture's `quant_predicate` vetoes (K3's `*res_proj`, read as a vector)
    layers whose input width no group size divides (16-wide KDA `f_b_proj`/`g_b_proj`, MLA's
    `embed_q`): mlx-lm skips them too
The embedding and the output head are quantised (as mlx-lm's own `convert -q` does): they are a
large share of a small model's core, and the measured quality includes their error.

Quality is measured, not assumed: `python benchmarks/bench_core_bits.py` compares each core with
the BF16 one on held-out text (resident bytes, top-1 agreement, KL, perplexity), beside mlx-lm's
own `convert -q` of the whole model at the same bits. Figures in docs/benchmarks.md.

Quantising never holds the BF16 core in memory: the core is loaded lazily (MLX reads a tensor
from its file only when it is evaluated) and the quantised weights are evaluated and written one
shard of at most SHARD_BYTES at a time, so K3's 114 GB BF16 core quantises on a 64 GB Mac. The
shards replace the BF16 ones crash-safely (node/engine/core_replacement.py). They are saved under
mlx-lm's parameter names; mlx-lm's `load_model` recognises quantised layers by their `.scales`
and reads each layer's bits and group size from its shapes (its `infer_quant_config`), so `run`
needs no special path. Where the config names no quantisation at all, a top-level
`"quantization"` entry is added so mlx-lm runs that step; expert packing keeps being read from
the expert tensors themselves.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.convert import QUANT_RECIPES, mixed_quant_predicate_builder
from mlx_lm.models.mla import MultiLinear

from expertmesh.node import constants
from expertmesh.node.engine import core_replacement
from expertmesh.node.engine.blocks import StreamingExperts
from expertmesh.node.errors import ExpertmeshError
from expertmesh.node.hub import local_models
from expertmesh.node.hub.pull import PullResult, pull
from expertmesh.node.model.expert_index import INDEX_FILENAME, ExpertIndex
from expertmesh.node.model.mlx_lm_models import flat_parameters, layer_number

CORE_BITS = (16, 8, 4)  # 16: the upstream precision (BF16), as pulled
RECIPES = tuple(QUANT_RECIPES)  # mlx-lm's mixed recipes: mixed_2_6, mixed_3_4, mixed_3_6, mixed_4_6
DEFAULT_RECIPE = "mixed_4_6"
_GROUP_SIZES = {8: (128, 64, 32)}  # by bits; the widest that divides a layer's input width is used
_LOW_BIT_GROUP_SIZES = (64,)  # mlx-lm's default group for 2-6 bits (a narrower group would add error)
GROUP_SIZE = 64  # the top-level default written into a config that names no quantisation
SHARD_BYTES = 1 << 30  # quantised bytes evaluated and written at once
_ROUTER_NAMES = ("gate", "router")


class CoreBitsError(ExpertmeshError):
    pass


@dataclass
class CoreQuantization:
    bits: int  # the low bits of a recipe
    recipe: str | None
    core_bytes_before: int
    core_bytes_after: int
    layer_bits: dict[str, int]  # quantised layer path -> its bits
    kept_layers: list[str]  # Linear/Embedding/MultiLinear layers left in full precision
    files: list[str] = field(default_factory=list)

    def by_bits(self) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for path, bits in sorted(self.layer_bits.items()):
            out.setdefault(bits, []).append(path)
        return out


def core_parameter_bytes(model: nn.Module) -> int:
    """Bytes of the core's parameters as they sit in memory (the resident core); for a lazily
    loaded or built model, what they would take (shapes are known without evaluating)."""
    return sum(v.nbytes for v in flat_parameters(model).values())


def is_router(path: str) -> bool:
    return path.rsplit(".", 1)[-1] in _ROUTER_NAMES


_LAYERS = (nn.Linear, nn.Embedding, MultiLinear)  # MultiLinear: MLA's per-head embed_q/unembed_out


def group_sizes(bits: int) -> tuple[int, ...]:
    """The group sizes a layer of `bits` bits may take, preferred first."""
    return _GROUP_SIZES.get(bits, _LOW_BIT_GROUP_SIZES)


def group_size_for(width: int, sizes: tuple[int, ...] = _GROUP_SIZES[8]) -> int | None:
    """The first of `sizes` that divides a layer's input `width`, or None if none does."""
    return next((g for g in sizes if width % g == 0), None)


def recipe_bits(recipe: str) -> int:
    """The low bits of an mlx-lm recipe (`mixed_4_6` -> 4): what most of its layers get."""
    return int(recipe.split("_")[1])


def check_core_format(bits: int | None, recipe: str | None) -> tuple[int | None, str | None]:
    """(bits, recipe) for `--core-bits` and `--core-quant`; a recipe sets the bits to its low bits.

    Raises:
        CoreBitsError: bits not in CORE_BITS, a recipe mlx-lm does not have, or both given and disagreeing.
    """
    if recipe is not None:
        if recipe not in RECIPES:
            raise CoreBitsError(f"--core-quant must be one of {', '.join(RECIPES)} (mlx-lm's recipes), not {recipe!r}")
        low = recipe_bits(recipe)
        if bits is not None and bits != low:
            raise CoreBitsError(
                f"--core-quant {recipe} quantises to {low} bits (6 where it matters): drop --core-bits {bits}"
            )
        return low, recipe
    if bits is not None and bits not in CORE_BITS:
        raise CoreBitsError(f"--core-bits must be one of {', '.join(map(str, CORE_BITS))}, not {bits}")
    return bits, None


def format_name(bits: int, recipe: str | None) -> str:
    """How a core's format is shown: "bf16", "8-bit", "4-bit", "mixed_4_6"."""
    return recipe or ("bf16" if bits == 16 else f"{bits}-bit")


def quantizable(path: str, module: nn.Module, sizes: tuple[int, ...] = _GROUP_SIZES[8]) -> bool:
    """The class predicate: Linear, Embedding and MultiLinear layers except routers, where the width allows."""
    if not isinstance(module, _LAYERS) or not hasattr(module, "to_quantized"):
        return False
    return not is_router(path) and group_size_for(module.weight.shape[-1], sizes) is not None


def quantize_model(model: nn.Module, bits: int = 8, recipe: str | None = None) -> tuple[dict[str, int], list[str]]:
    """Quantise `model`'s core in place (lazily: nothing is evaluated); returns (quantised layer
    path -> bits, kept layer paths).

    The architecture's own `quant_predicate` (mlx-lm's, e.g. K3 keeps `*res_proj`, whose weight is
    read as a vector, not multiplied) vetoes layers, and below 8 bits gives routers the 8 bits it
    asks for them; otherwise routers stay unquantised. A recipe decides each other layer's bits
    (mlx-lm's builder, called on this model), the layer's width its group.

    Raises:
        CoreBitsError: the recipe cannot be applied to this architecture (mlx-lm's builder refuses it).
    """
    arch_predicate = getattr(model, "quant_predicate", None)
    by_recipe: Callable[[str, nn.Module], dict] | None = None
    if recipe is not None:
        try:
            by_recipe = cast(
                Callable[[str, nn.Module], dict],  # mlx-lm annotates a third argument its predicate does not take
                mixed_quant_predicate_builder(
                    recipe,
                    _AsMlxLmBuildsIt(model),  # type: ignore[arg-type]  # mlx-lm reads named_modules() and layers only
                    GROUP_SIZE,
                ),
            )
        except (ValueError, AttributeError, TypeError) as e:
            raise CoreBitsError(
                f"mlx-lm's recipe {recipe} does not apply to this model ({e}): use --core-bits"
            ) from None
    done: dict[str, int] = {}
    kept: list[str] = []

    def predicate(path: str, module: nn.Module) -> bool | dict:
        if not isinstance(module, _LAYERS):
            return False
        asked = arch_predicate(path, module) if arch_predicate is not None else True
        if is_router(path) and bits < 8 and isinstance(asked, dict) and asked.get("bits", 0) >= 8:
            width, group = module.weight.shape[-1], asked.get("group_size", GROUP_SIZE)
            if hasattr(module, "to_quantized") and width % group == 0:  # what mlx-lm's own conversion gives it
                done[path] = asked["bits"]
                return {"group_size": group, "bits": asked["bits"], "mode": asked.get("mode", "affine")}
        layer_bits = by_recipe(path, module)["bits"] if by_recipe is not None else bits
        sizes = group_sizes(layer_bits)
        ok = quantizable(path, module, sizes) and asked is not False
        if not ok:
            kept.append(path)
            return False
        done[path] = layer_bits
        return {"group_size": group_size_for(module.weight.shape[-1], sizes), "bits": layer_bits, "mode": "affine"}

    nn.quantize(model, class_predicate=predicate)
    return done, kept


class _AsMlxLmBuildsIt:
    """The model as mlx-lm's recipe builder reads it: its modules and the expert blocks' own
    projections (`switch_mlp.down_proj`), which mlx-lm builds and `run` swaps for streaming blocks.
    The builder only looks for where a layer's number sits in a `down_proj` path and counts the
    layers, so a core without a dense `down_proj` (Qwen3-MoE's) takes a recipe as mlx-lm's model does."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.layers = model.layers

    def named_modules(self) -> list[tuple[str, nn.Module]]:
        out = list(self.model.named_modules())
        for path, m in list(out):
            if isinstance(m, StreamingExperts):
                out += [(f"{path}.{p}", m) for p in m.projections]
        return out


def quantize_core(model_dir: Path, bits: int = 8, recipe: str | None = None) -> CoreQuantization:
    """Replace the BF16 core in `model_dir` by a quantised one (`bits`, or `recipe`), on the
    process's MLX thread (node/engine/model_thread.py), like every MLX evaluation.

    Raises:
        CoreBitsError: a bad `bits`/`recipe`, or a recipe the architecture cannot take.
    """
    from expertmesh.node.engine.model_thread import model_thread

    checked, recipe = check_core_format(bits, recipe)
    bits = checked if checked is not None else bits
    if bits == 16:
        raise CoreBitsError("a 16-bit core is the one pulled: nothing to quantise")
    model_dir = Path(model_dir)
    with core_replacement.locked(model_dir):
        return model_thread().call(_quantize_core, model_dir, bits, recipe)


def _quantize_core(model_dir: Path, bits: int, recipe: str | None) -> CoreQuantization:
    from expertmesh.node.engine.blocks import core_standins, load_core_model

    index = ExpertIndex.load(model_dir / INDEX_FILENAME)
    model, config, blocks = load_core_model(model_dir, core_standins(index, 16), lazy=True)  # BF16 only
    before = core_parameter_bytes(model)
    layer_bits, kept = quantize_model(model, bits, recipe)
    weights = flat_parameters(model)
    del model, blocks  # from here on only `weights` holds the arrays: each goes once written
    after = sum(v.nbytes for v in weights.values())

    old = sorted(p.name for p in model_dir.glob("model*.safetensors"))
    staging = core_replacement.new_staging(model_dir)
    tag = recipe or f"q{bits}"
    shards = _shards(weights)
    weight_map = {}
    for n, names in enumerate(shards, 1):
        name = f"model-core-{tag}-{n:05d}-of-{len(shards):05d}.safetensors"
        part = {k: weights.pop(k) for k in names}
        mx.save_safetensors(str(staging / name), part, metadata={"format": "mlx", "expertmesh": f"core {tag}"})
        del part  # evaluated, written, and let go before the next shard is read
        weight_map.update(dict.fromkeys(names, name))
    if not any(k in config or k in config.get("text_config", {}) for k in ("quantization", "quantization_config")):
        raw = json.loads((model_dir / "config.json").read_text())
        raw["quantization"] = {"group_size": GROUP_SIZE, "bits": bits, "mode": "affine"}
        (staging / "config.json").write_text(json.dumps(raw, indent=2))
    index_doc = {"metadata": {"total_size": after, "expertmesh": f"core only, {format_name(bits, recipe)}"},
                 "weight_map": weight_map}  # fmt: skip
    (staging / "model.safetensors.index.json").write_text(json.dumps(index_doc, indent=1))
    marker = {**local_models.read_marker(model_dir), "core_bits": bits, "core_quant": recipe, "core_bytes": after}
    core_replacement.commit(model_dir, [p for p in old if p != "model.safetensors.index.json"], marker)
    return CoreQuantization(bits, recipe, before, after, layer_bits, kept, sorted(set(weight_map.values())))


def _shards(weights: dict[str, mx.array]) -> list[list[str]]:
    """Parameter names in layer order, cut into shards of at most SHARD_BYTES (one tensor may exceed it)."""
    order = sorted(weights, key=lambda k: (layer_number(k) if layer_number(k) is not None else -1, k))
    shards: list[list[str]] = [[]]
    size = 0
    for k in order:
        if shards[-1] and size + weights[k].nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += weights[k].nbytes
    return shards


# Core tensors that say the upstream core is quantised already: MLX's scales, FP8 and
# compressed-tensors' scales, packed integer or 8-bit float weights.
_QUANTISED_SUFFIXES = (".scales", ".weight_scale", ".weight_scale_inv", ".weight_packed")
_QUANTISED_DTYPES = ("U32", "I32", "U8", "I8", "F8_E4M3", "F8_E5M2")


def refuse_requantising(repo_id: str, index: ExpertIndex, core_bits: int | None, flag: str = "--core-bits") -> None:
    """Quantising a core published quantised (an mlx-lm conversion, an FP8 checkpoint) would make
    nothing smaller, and recording fewer bits would say otherwise: refuse before anything is fetched."""
    if core_bits in (None, 16):
        return
    sign = next(
        (t for t in index.core.values() if t.name.endswith(_QUANTISED_SUFFIXES) or t.dtype in _QUANTISED_DTYPES), None
    )
    if sign is not None:
        raise CoreBitsError(
            f"{repo_id}'s core is already quantised as published (it has {sign.name}, {sign.dtype}): {flag} "
            f"would not make it smaller; pull it without {flag.split()[0]}"
        )


def finish_interrupted(home: Path, repo_id: str) -> None:
    """Complete any core replacement of `repo_id`'s pulls that a crash interrupted after its commit
    point; drop what an interrupted staging left (the BF16 pull beside it is intact)."""
    for path in sorted(local_models.model_root(home, repo_id).glob(f"*/{core_replacement.READY}")):
        core_replacement.finish_replacement(path.parent)
    for path in sorted(local_models.model_root(home, repo_id).glob(f"*/{core_replacement.STAGING}")):
        with core_replacement.locked(path.parent):
            shutil.rmtree(path, ignore_errors=True)


def _recipes_pulled(home: Path, repo_id: str) -> dict[str, str | None]:
    """commit -> the recipe its marker records, for each pulled commit of `repo_id` whose marker reads."""
    out = {}
    for m in local_models.pulled_models(home, repo_id):
        if m.state == "complete":
            out[m.commit] = m.core_quant
    return out


def pull_with_core_bits(
    repo_id: str, core_bits: int | None = None, core_quant: str | None = None, **pull_args
) -> PullResult:
    """`pull` (node/hub/pull.py), then the core quantised to `core_bits` (or mlx-lm's recipe
    `core_quant`) where asked: what `expertmesh pull --core-bits/--core-quant` runs. None keeps
    what is pulled (16, the upstream BF16, if new); a quantised core that `pull` found damaged and
    pulled anew is quantised again.

    The marker is rewritten only once the quantised core is in place, so an interrupted
    quantisation leaves a complete BF16 pull that the next run quantises (core_replacement.py).

    Raises:
        CoreBitsError: a `core_bits` other than one of CORE_BITS, an unknown recipe, a core
            published quantised already (refused before its bytes are fetched), or another
            format asked of a core stored quantised.
        and what `pull` raises.
    """
    core_bits, core_quant = check_core_format(core_bits, core_quant)
    flag = f"--core-quant {core_quant}" if core_quant else f"--core-bits {core_bits}"
    home = Path(pull_args.get("home") or constants.expertmesh_home())
    finish_interrupted(home, repo_id)
    recipes = _recipes_pulled(home, repo_id)  # what a core `pull` may find damaged was quantised with
    result = pull(repo_id, check_index=lambda index: refuse_requantising(repo_id, index, core_bits, flag), **pull_args)
    if core_bits is None and result.repaired_core_bits is not None:  # quantise what `pull` repaired, as it was
        core_bits, core_quant = result.repaired_core_bits, recipes.get(result.commit)
    wanted = (core_bits, core_quant if core_bits != 16 else None)
    if core_bits is None or wanted == (result.core_bits, result.core_quant) or result.core_bytes == 0:
        return result  # as pulled, or --index-only
    if result.core_bits != 16:
        raise CoreBitsError(
            f"{repo_id} @ {result.commit[:12]} is pulled with a {format_name(result.core_bits, result.core_quant)} "
            f"core; the BF16 core is no longer here: delete {result.path} and pull again"
        )
    refuse_requantising(repo_id, ExpertIndex.load(result.path / INDEX_FILENAME), core_bits, flag)
    q = quantize_core(result.path, core_bits, core_quant)  # the BF16 core is here: quantise it in place
    return dataclasses.replace(
        result, core_bits=core_bits, core_quant=core_quant, core_bytes=q.core_bytes_after, already_complete=False
    )
