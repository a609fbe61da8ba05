"""How mlx-lm's loader quantises a routed-expert projection, read as it reads it.

An MLX conversion (`mlx_lm.convert -q`, what mlx-community publishes) says how each layer is
packed in `config["quantization"]`: top-level defaults, and per-module entries keyed by module
path that its mixed recipes and model predicates write. mlx-lm's `load_model` quantises a
module with the `class_predicate` it hands `nn.quantize`:

- a path with an entry gets that entry, whatever it is: a dict is passed to the module's
  `to_quantized` (a key left out takes that method's default; a `null` passes None, which
  `mx.quantize` reads as the mode's default: groups of 64 for affine, 32 for mxfp4 and mxfp8,
  16 for nvfp4), `true` quantises with the top-level defaults, `false` or `null` leaves it dense;
- a path without one is quantised only if its `scales` were saved, with the packing inferred from
  the saved shapes and the scales' dtype (`mlx_lm.utils.infer_quant_config`), never from the
  top-level defaults, which a predicate's exceptions (a width the group size does not divide, a
  router at 8 bits) make wrong for some layers.

`projection_quantization` replays that for one expert projection: mlx-lm's own pieces where they
are callable (`infer_quant_config`, `SwitchLinear.to_quantized`'s defaults, `mx.quantize`'s shapes)
decide, and the stored tensors are checked against what they build. It is the one place the
codec (decoding an expert) and `pull` (refusing a model before its core is fetched) read an MLX
conversion's quantization, so what pulls is what runs.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.switch_layers import SwitchLinear
from mlx_lm.utils import infer_quant_config

from expertmesh.node.errors import UnsupportedModelError


@dataclass(frozen=True)
class QuantSpec:
    """How one projection's weights feed `gather_qmm`."""

    mode: str
    bits: int
    group_size: int


@dataclass(frozen=True)
class StoredPacking:
    """How one projection of an expert is stored, as the loader would see its tensors (after
    sanitize): the shapes and the scales' dtype are all the packing is read from."""

    in_dims: int  # the projection's input width, from mlx-lm's unquantised module
    weight_shape: tuple[int, ...]
    scales_shape: tuple[int, ...] | None  # None: stored dense
    scales_dtype: mx.Dtype | None
    has_biases: bool

    @property
    def bits(self) -> int:
        return self.weight_shape[-1] * 32 // self.in_dims

    @property
    def group_size(self) -> int:
        assert self.scales_shape is not None
        return self.in_dims // self.scales_shape[-1]


# SwitchLinear.to_quantized's own defaults: what a key an entry leaves out becomes.
_TO_QUANTIZED = inspect.signature(SwitchLinear.to_quantized)


def projection_quantization(
    quantization: Mapping[str, Any] | None, path: str, stored: StoredPacking, where: str
) -> QuantSpec | None:
    """How mlx-lm's loader quantises the projection at module `path` (None: dense), checked
    against how its tensors are stored.

    Args:
        quantization: the config's `quantization` (None when it has none: then, as in mlx-lm,
            nothing has an entry and a projection with scales is inferred from them).
        path: the projection's module path in mlx-lm's model (`model.layers.1.mlp.switch_mlp.gate_proj`).
        stored: its stored tensors' shapes.
        where: how to name the projection to a user (`layer 1 gate_proj`).

    Raises:
        UnsupportedModelError: one line saying what the config asks, what is stored and why it
            cannot be streamed: a packing mlx-lm would not load either, or one the streamed
            kernels do not take (a per-expert global scale).
    """
    entries = quantization or {}
    if path not in entries:
        if stored.scales_shape is None:
            return None
        module = SimpleNamespace(weight=SimpleNamespace(shape=(stored.in_dims,)))
        arrays = {
            f"{path}.scales": SimpleNamespace(shape=stored.scales_shape, dtype=stored.scales_dtype),
            f"{path}.weight": SimpleNamespace(shape=stored.weight_shape),
        }
        try:
            params = infer_quant_config(path, cast(Any, module), arrays)  # it reads shapes and a dtype only
        except ValueError as e:
            raise UnsupportedModelError(f"{where}: {e}") from None
        spec = QuantSpec(params["mode"], params["bits"], params["group_size"])
        _check_scales(spec, stored, where, "inferred from its tensors")
        return spec
    entry = entries[path]
    if not entry:  # false or null: mlx-lm leaves the module dense
        if stored.scales_shape is not None:
            raise UnsupportedModelError(
                f"{where}: the config's quantization leaves it unquantised ({json.dumps(entry)}) but it is "
                f"stored quantised ({stored.bits} bits, groups of {stored.group_size}): mlx-lm would not load it either"
            )
        return None
    if entry is True:  # nn.quantize quantises a module its predicate answers True for with the defaults
        entry = _defaults(quantization)
    if not isinstance(entry, dict):
        raise UnsupportedModelError(f"{where}: the config's quantization entry {entry!r} is neither a table nor true")
    configured = _configured(json.dumps(entry, sort_keys=True), stored.in_dims)
    if isinstance(configured, str):
        raise UnsupportedModelError(f"{where}: {configured}")
    spec = configured
    asked = f"{spec.bits} bits, groups of {spec.group_size}, {spec.mode}"
    if stored.scales_shape is None:
        raise UnsupportedModelError(
            f"{where}: the config's quantization asks for {asked}, but it is stored unquantised: "
            "mlx-lm would not load it either"
        )
    if (stored.bits, stored.group_size) != (spec.bits, spec.group_size):
        raise UnsupportedModelError(
            f"{where}: stored packing ({stored.bits} bits, groups of {stored.group_size}) disagrees with the "
            f"config's quantization ({asked}): mlx-lm would not load it either"
        )
    _check_scales(spec, stored, where, "the config's quantization")
    return spec


def prepare(quantization: Mapping[str, Any] | None, projections: Mapping[str, int]) -> None:
    """Work out, on the calling thread, the packing the config's entries ask for each projection
    (module path -> input width), so that `projection_quantization` later makes no MLX operation:
    the codec calls it on the MLX thread, and checks experts on fetch workers."""
    for path, in_dims in projections.items():
        entry = (quantization or {}).get(path)
        if entry is True:
            entry = _defaults(quantization)
        if isinstance(entry, dict):
            _configured(json.dumps(entry, sort_keys=True), in_dims)


def _defaults(quantization: Mapping[str, Any] | None) -> dict:
    """The top-level arguments `nn.quantize` gives a module its predicate answers True for."""
    return {k: quantization[k] for k in ("group_size", "bits", "mode") if quantization and k in quantization}


@functools.cache
def _configured(entry_json: str, in_dims: int) -> QuantSpec | str:
    """The packing mlx-lm builds for a module whose predicate answers `entry`, or why it cannot:
    its arguments bound to `SwitchLinear.to_quantized` as that method receives them, then
    `mx.quantize`'s shapes for a row of that width (nothing is evaluated: shapes are known when
    an operation is made)."""
    entry = json.loads(entry_json)
    if "quantize_input" in entry and not entry["quantize_input"]:
        del entry["quantize_input"]  # as nn.quantize drops it before calling to_quantized
    try:
        bound = _TO_QUANTIZED.bind(None, **entry)
    except TypeError as e:
        return f"the config's quantization entry {entry_json} is not one mlx-lm takes ({e})"
    bound.apply_defaults()
    args = bound.arguments
    if args["global_scale"]:
        return f"quantised with a global scale per expert ({args['mode']}), which expertmesh cannot stream yet"
    try:
        packed = mx.quantize(mx.zeros((1, in_dims)), args["group_size"], args["bits"], mode=args["mode"])
    except ValueError as e:
        return f"mlx cannot quantise it as the config asks ({e})"
    weight, scales = packed[0], packed[1]
    return QuantSpec(args["mode"], weight.shape[-1] * 32 // in_dims, in_dims // scales.shape[-1])


def _check_scales(spec: QuantSpec, stored: StoredPacking, where: str, source: str) -> None:
    """Affine keeps its scales in the weights' float dtype beside additive biases; the
    microscaling modes keep one byte a group and no biases (what `mx.quantize` makes of each,
    and so the parameters mlx-lm's quantised layer loads)."""
    float_scales = stored.scales_dtype is not None and stored.scales_dtype != mx.uint8
    if spec.mode == "affine":
        fits = float_scales and stored.has_biases
    else:
        fits = not float_scales and not stored.has_biases
    if not fits:
        kind = "float scales" if float_scales else "byte scales"
        biases = "with" if stored.has_biases else "without"
        raise UnsupportedModelError(
            f"{where}: stored with {kind} {biases} biases, which is not {spec.mode} as {source} says"
        )
