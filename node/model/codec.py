"""Turning one expert's upstream bytes into the arrays MLX's kernels take.

An expert arrives as the concatenation of its byte ranges in the upstream shards (see
`ExpertLocation.ranges`). Upstream repos encode expert weights in a few ways, and each maps onto
an MLX kernel without re-quantising, so the streamed model computes exactly what mlx-lm's
in-memory model computes:

| upstream tensors (per projection)                     | MLX kernel                           |
|-------------------------------------------------------|--------------------------------------|
| `weight_packed` U8 + `weight_scale` U8 (mxfp4, K3)    | `gather_qmm`, mode mxfp4             |
| `weight_packed` I32 + `weight_scale` + `weight_shape` | `gather_qmm`, affine, biases = -8·s  |
| `weight` U32 + `scales` (+ `biases`) (MLX-converted)  | `gather_qmm`, as converted           |
| `weight` BF16/F16/F32 (unquantised)                   | `gather_mm`                          |

These are the same conversions the architectures' `sanitize` methods apply to whole stacked
tensors; doing them per expert is what lets an expert be fetched alone. An index of format 2
no longer needs this table: each expert carries its `Recipe`, the operations mlx-lm's own
sanitize applies to its tensors (node/model/expert_trace.py), replayed here in numpy; the table
is how an index of format 1 is still decoded, by tensor name.

Decoding runs on the store's fetch workers, so it evaluates nothing in MLX: the conversions (bit
views, the int4 zero point, the float32 cast on a CPU) are done in numpy, exactly, and each array
is then made from its buffer (`mx.array(values, dtype=...)` converts while it copies, eagerly).
Making an array from a buffer encodes no GPU work and leaves nothing lazy, so the arrays cross to
the MLX thread (node/engine/model_thread.py) as plain data; an `mx.eval` here would encode Metal
work on a fetch worker, beside the MLX thread's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import overload

import mlx.core as mx
import numpy as np

from expertmesh.node.errors import UnsupportedModelError
from expertmesh.node.model.expert_index import ExpertLocation, Recipe
from expertmesh.node.model.expert_trace import SAFETENSORS_DTYPES
from expertmesh.node.model.expert_trace import evaluate as evaluate_recipe
from expertmesh.node.model.mlx_lm_models import BLOCK_PROJECTIONS
from expertmesh.node.model.mlx_quantization import QuantSpec, StoredPacking, prepare, projection_quantization

# Upstream projection names -> SwitchGLU's (for an index of format 1, decoded by name).
PROJECTION_ALIASES = {
    "w1": "gate_proj",
    "w3": "up_proj",
    "w2": "down_proj",
    "gate_proj": "gate_proj",
    "up_proj": "up_proj",
    "down_proj": "down_proj",
}
PROJECTIONS = BLOCK_PROJECTIONS["SwitchGLU"]  # what an expert of a layer the codec was not told of has

_NUMPY_DTYPES = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "U16": np.uint16,
    "I16": np.int16,
    "U32": np.uint32,
    "I32": np.int32,
    "U64": np.uint64,
    "I64": np.int64,
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
    "BF16": np.uint16,  # numpy has no bfloat16: read the bits, view them in MLX
    "F8_E4M3": np.uint8,  # fp8 arrives as bytes, as mx.load gives it; a recipe decodes it
    "F8_E5M2": np.uint8,
    "F8_E8M0": np.uint8,
}


@dataclass
class ProjectionWeights:
    weight: mx.array  # (out, in) dense, or packed (out, in*bits/32) uint32
    scales: mx.array | None = None
    biases: mx.array | None = None
    bias: mx.array | None = None  # an additive bias of the projection (rare: gpt-oss)
    quant: QuantSpec | None = None  # how `gather_qmm` reads it; None: dense

    @property
    def nbytes(self) -> int:
        arrays = (self.weight, self.scales, self.biases, self.bias)
        return sum(a.nbytes for a in arrays if a is not None)


ARRAY_KINDS = ("weight", "scales", "biases", "bias")  # a projection's arrays, as mlx-lm's SwitchLinear names them


@dataclass(frozen=True)
class SlotLayout:
    """How one expert of a layer lies in a RAM-tier slot: for each projection, the shape and dtype
    of each of its arrays (`ARRAY_KINDS`, absent ones left out) and how `gather_qmm` reads them.
    Layers whose experts share a layout can share stacked arrays (node/store/tiers/ram.py)."""

    projections: tuple[tuple[str, tuple[tuple[str, tuple[int, ...], mx.Dtype], ...], QuantSpec | None], ...]

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(shape)) * dtype.size for _, arrays, _ in self.projections for _, shape, dtype in arrays)


@dataclass
class ExpertWeights:
    """One routed expert as decoded, on its way into a RAM-tier slot (node/store/tiers/ram.py), or
    read by the kernels as it is where the tier does not keep it."""

    layer: int
    expert: int
    projections: dict[str, ProjectionWeights]  # by the block's names: gate_proj/up_proj/down_proj, fc1/fc2

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.projections.values())

    def stack(self) -> dict[str, dict[str, mx.array]]:
        """The expert as stacks of one slot (projection -> array kind -> (1, *shape)), as a RAM-tier
        pool holds its slots: views of its arrays, nothing copied."""
        return {
            name: {kind: a[None] for kind in ARRAY_KINDS if (a := getattr(p, kind)) is not None}
            for name, p in self.projections.items()
        }

    def layout(self) -> SlotLayout:
        return SlotLayout(
            tuple(
                (
                    name,
                    tuple(
                        (kind, tuple(a.shape), a.dtype) for kind in ARRAY_KINDS if (a := getattr(p, kind)) is not None
                    ),
                    p.quant,
                )
                for name, p in self.projections.items()
            )
        )


def tensor_offsets(loc: ExpertLocation) -> dict[str, tuple[int, int]]:
    """Where each of the expert's tensors sits in its blob (the ranges concatenated in order)."""
    offsets: dict[str, tuple[int, int]] = {}
    base = 0
    for r in loc.ranges:
        for t in loc.tensors:
            if t.file == r.file and r.start <= t.start and t.end <= r.end:
                offsets[t.name] = (base + t.start - r.start, t.nbytes)
        base += r.nbytes
    return offsets


def _projection_and_kind(name: str) -> tuple[str, str]:
    parts = name.split(".")
    return parts[-2], parts[-1]


# A tensor on its way to MLX: numpy values and the MLX dtype they become. BF16, which numpy
# lacks, is widened to float32 on reading (exact) and narrowed back when the array is made.
_Host = tuple[np.ndarray, mx.Dtype]

# what `mx.load` gives each safetensors dtype, but float64 (MLX has none on the GPU; no upstream
# expert is F64)
_MX_DTYPES = {**SAFETENSORS_DTYPES, "F64": mx.float32}


def read_host(blob: memoryview, offset: int, nbytes: int, dtype: str, shape: tuple[int, ...]) -> _Host:
    """A tensor's bytes in `blob` as host values (BF16 widened to float32) and the MLX dtype they become."""
    np_dtype = _NUMPY_DTYPES.get(dtype)
    if np_dtype is None:
        raise UnsupportedModelError(f"expert tensors of dtype {dtype} are not supported yet")
    a: np.ndarray = np.frombuffer(
        blob, dtype=np_dtype, count=nbytes // np.dtype(np_dtype).itemsize, offset=offset
    ).reshape(shape)
    if dtype == "BF16":
        a = (a.astype(np.uint32) << 16).view(np.float32)  # a bfloat16 is the top half of a float32
    return a, _MX_DTYPES[dtype]


def _as_uint32(t: _Host) -> _Host:
    """Packed quantised weights as uint32 words (the bits unchanged), as MLX's kernels take them."""
    return np.ascontiguousarray(t[0]).view(np.uint32), mx.uint32


def _zero_point_biases(scales: _Host) -> _Host:
    """-8·scales, the affine biases of int4 symmetric weights. Computed in float32: exact for
    float16 and bfloat16 scales too (times a power of two), so the narrowing back loses nothing."""
    values, dtype = scales
    with np.errstate(over="ignore", invalid="ignore"):
        return -8 * values.astype(np.float32), dtype


_FLOATS = (mx.float16, mx.bfloat16, mx.float32)


@overload
def _cast(t: _Host, dtype: mx.Dtype) -> _Host: ...


@overload
def _cast(t: None, dtype: mx.Dtype) -> None: ...


def _cast(t: _Host | None, dtype: mx.Dtype) -> _Host | None:
    """`t` in `dtype` if it is a float array (packed words and byte scales are left as they are)."""
    if t is None or t[1] not in _FLOATS or t[1] == dtype:
        return t
    if dtype != mx.float32:
        raise UnsupportedModelError(f"expert weights can be cast to float32 only, not {dtype}")
    return t[0].astype(np.float32), mx.float32


@overload
def to_mx(t: _Host) -> mx.array: ...


@overload
def to_mx(t: None) -> None: ...


def to_mx(t: _Host | None) -> mx.array | None:
    """The MLX array of `t`, made from its buffer: no graph, nothing to evaluate."""
    if t is None:
        return None
    values, dtype = t
    return mx.array(np.ascontiguousarray(values), dtype=dtype)


def _plain(loc: ExpertLocation, recipe: Recipe) -> bool:
    """Whether every parameter of the expert's recipe is an upstream tensor as stored (or its
    bytes viewed) whose name says the same projection: then decoding by name gives the same arrays."""
    if sorted(recipe.inputs) != list(range(len(loc.tensors))):
        return False  # tensors the recipe leaves out, or takes twice
    for param, node in recipe.parameters.items():
        if node[0] == "view":
            node = node[1]
        if node[0] != "in":
            return False
        proj = _projection_and_kind(loc.tensors[recipe.inputs[node[1]]].name)[0]
        if PROJECTION_ALIASES.get(proj) != param.rpartition(".")[0]:
            return False
    return True


class ExpertCodec:
    """Decodes expert blobs of one model.

    Args:
        quantization: mlx-lm's resolved `config["quantization"]` (defaults and per-module
            entries keyed by module path), or None for an unquantised model: read as mlx-lm's
            loader reads it (node/model/mlx_quantization.py).
        block_paths: layer -> the module path of that layer's expert block, for the overrides.
        input_dims: layer -> {projection: input width}, in the block's order: which projections an
            expert of the layer has (`BLOCK_PROJECTIONS`), and the input widths that check the packing we infer.
        dense_dtype: cast experts' float arrays to this dtype once, on decode, as the model's
            were (MLX's CPU `gather_mm` takes only float32, so a model with any unquantised
            expert projection runs in float32 there); None keeps the upstream dtype.
    """

    def __init__(
        self,
        quantization: dict | None,
        block_paths: dict[int, str],
        input_dims: dict[int, dict[str, int]],
        dense_dtype: mx.Dtype | None = None,
    ):
        self.quantization = quantization or {}
        self.block_paths = block_paths
        self.input_dims = input_dims
        self.dense_dtype = dense_dtype
        self._layouts: dict[tuple, SlotLayout] = {}
        self._specs: dict[tuple, QuantSpec | None] = {}  # read once per way a projection is stored
        prepare(
            self.quantization,
            {f"{block_paths.get(layer, '')}.{p}": d for layer, dims in input_dims.items() for p, d in dims.items()},
        )

    def layout(self, loc: ExpertLocation) -> SlotLayout:
        """The slot layout of `loc`'s layer, without its bytes: an expert of zeros decoded once per
        distinct way of storing one (a model has one or a few), so the RAM tier can plan its slots
        before any expert arrives.

        Raises:
            UnsupportedModelError: as `decode`.
        """
        path = self.block_paths.get(loc.layer, "")
        key = (
            tuple((*_projection_and_kind(t.name), t.dtype, tuple(t.shape)) for t in loc.tensors),
            (loc.recipe.text, loc.recipe.inputs) if loc.recipe is not None else None,
            tuple(self.input_dims.get(loc.layer, {}).items()),
            tuple(
                sorted((k[len(path) + 1 :], repr(v)) for k, v in self.quantization.items() if k.startswith(f"{path}."))
            ),
        )
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = self.decode(loc, bytes(loc.nbytes)).layout()
        return layout

    def decode(self, loc: ExpertLocation, blob: bytes | bytearray | memoryview) -> ExpertWeights:
        """The expert's kernel arrays. Raises UnsupportedModelError for an unknown encoding."""
        view = memoryview(blob)
        recipe = loc.recipe
        if recipe is not None and not _plain(loc, recipe):
            by_proj = self._from_recipe(
                loc, recipe, view
            )  # what mlx-lm's sanitize makes of these bytes (model/expert_trace.py)
        else:
            # an index of format 1, or a recipe that only takes tensors as they are stored: by
            # name, which peaks at far less memory than the recipe's path for the same values
            # (docs/benchmarks.md, "One-off measurements without a script": decode paths).
            try:
                by_proj = self._by_name(loc, view)
            except UnsupportedModelError:
                if recipe is None:
                    raise
                by_proj = self._from_recipe(loc, recipe, view)
        wanted = tuple(self.input_dims.get(loc.layer, ())) or PROJECTIONS
        missing = [p for p in wanted if p not in by_proj]
        if missing:
            raise UnsupportedModelError(f"expert {loc.layer}/{loc.expert} has no {', '.join(missing)} tensors")
        return ExpertWeights(loc.layer, loc.expert, {p: self._projection(loc.layer, p, by_proj[p]) for p in wanted})

    def _from_recipe(self, loc: ExpertLocation, recipe: Recipe, view: memoryview) -> dict[str, dict[str, _Host]]:
        offsets = loc.blob_offsets()
        inputs = [
            read_host(view, offsets[i], loc.tensors[i].nbytes, loc.tensors[i].dtype, loc.tensors[i].shape)
            for i in recipe.inputs
        ]
        by_proj: dict[str, dict[str, _Host]] = {}
        for name, host in evaluate_recipe(recipe.parameters, inputs).items():
            proj, _, kind = name.rpartition(".")
            by_proj.setdefault(proj, {})[kind] = host
        return by_proj

    def _by_name(self, loc: ExpertLocation, view: memoryview) -> dict[str, dict[str, _Host]]:
        offsets = tensor_offsets(loc)
        by_proj: dict[str, dict[str, _Host]] = {}
        for t in loc.tensors:
            proj, kind = _projection_and_kind(t.name)
            if proj not in PROJECTION_ALIASES:
                raise UnsupportedModelError(f"expert tensor {t.name}: unknown projection {proj!r}")
            offset, nbytes = offsets[t.name]
            by_proj.setdefault(PROJECTION_ALIASES[proj], {})[kind] = read_host(view, offset, nbytes, t.dtype, t.shape)
        return by_proj

    def _projection(self, layer: int, proj: str, t: dict[str, _Host]) -> ProjectionWeights:
        bias = t.get("bias")
        if "weight_packed" in t:  # compressed-tensors pack-quantized
            weight, scales = _as_uint32(t["weight_packed"]), t["weight_scale"]
            biases = _zero_point_biases(scales) if "weight_shape" in t else None  # int4 symmetric: zero point 8
        elif "scales" in t:  # MLX-quantized
            weight, scales, biases = t["weight"], t["scales"], t.get("biases")
        elif "weight" in t:
            weight, scales, biases = t["weight"], None, None
        else:
            raise UnsupportedModelError(f"layer {layer} {proj}: unknown expert encoding {sorted(t)}")
        quant = self._quant(layer, proj, weight, scales, biases is not None)
        if (dtype := self.dense_dtype) is not None:  # every float array, as `set_dtype` casts the model's
            weight, scales, biases, bias = (
                _cast(weight, dtype),
                _cast(scales, dtype),
                _cast(biases, dtype),
                _cast(bias, dtype),
            )
        return ProjectionWeights(to_mx(weight), to_mx(scales), to_mx(biases), to_mx(bias), quant)

    def _quant(self, layer: int, proj: str, weight: _Host, scales: _Host | None, has_biases: bool) -> QuantSpec | None:
        """How mlx-lm's loader quantises this projection (None: dense), checked against its arrays."""
        in_dims = self.input_dims.get(layer, {}).get(proj)
        if in_dims is None:
            raise UnsupportedModelError(f"layer {layer} has no expert block in the model")
        stored = StoredPacking(
            in_dims,
            tuple(weight[0].shape),
            None if scales is None else tuple(scales[0].shape),
            None if scales is None else scales[1],
            has_biases,
        )
        key = (layer, proj, stored)
        if key not in self._specs:
            path = f"{self.block_paths.get(layer, '')}.{proj}"
            self._specs[key] = projection_quantization(self.quantization, path, stored, f"layer {layer} {proj}")
        return self._specs[key]
