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
tensors; doing them per expert is what lets an expert be fetched alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from expertmesh.node.errors import UnsupportedModelError
from expertmesh.node.hub.expert_index import ExpertLocation

# Upstream projection names -> SwitchGLU's.
PROJECTION_ALIASES = {
    "w1": "gate_proj",
    "w3": "up_proj",
    "w2": "down_proj",
    "gate_proj": "gate_proj",
    "up_proj": "up_proj",
    "down_proj": "down_proj",
}
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

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
}


@dataclass(frozen=True)
class QuantSpec:
    """How one projection's weights feed `gather_qmm`; None in `ProjectionWeights.quant` = dense."""

    mode: str
    bits: int
    group_size: int


@dataclass
class ProjectionWeights:
    weight: mx.array  # (out, in) dense, or packed (out, in*bits/32) uint32
    scales: mx.array | None = None
    biases: mx.array | None = None
    bias: mx.array | None = None  # an additive bias of the projection (rare: gpt-oss)
    quant: QuantSpec | None = None

    @property
    def nbytes(self) -> int:
        arrays = (self.weight, self.scales, self.biases, self.bias)
        return sum(a.nbytes for a in arrays if a is not None)


@dataclass
class ExpertWeights:
    """One routed expert, ready for the kernels: held in the RAM tier and passed by reference."""

    layer: int
    expert: int
    gate_proj: ProjectionWeights
    up_proj: ProjectionWeights
    down_proj: ProjectionWeights

    @property
    def nbytes(self) -> int:
        return self.gate_proj.nbytes + self.up_proj.nbytes + self.down_proj.nbytes


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


def _to_mx(blob: memoryview, offset: int, nbytes: int, dtype: str, shape: tuple[int, ...]) -> mx.array:
    np_dtype = _NUMPY_DTYPES.get(dtype)
    if np_dtype is None:
        raise UnsupportedModelError(f"expert tensors of dtype {dtype} are not supported yet")
    a = mx.array(
        np.frombuffer(blob, dtype=np_dtype, count=nbytes // np.dtype(np_dtype).itemsize, offset=offset).reshape(shape)
    )
    return a.view(mx.bfloat16) if dtype == "BF16" else a


class ExpertCodec:
    """Decodes expert blobs of one model.

    Args:
        quantization: mlx-lm's resolved `config["quantization"]` (defaults and per-module
            overrides keyed by module path), or None for an unquantised model.
        block_paths: layer -> the module path of that layer's expert block, for the overrides.
        input_dims: layer -> {projection: input width}, to check the packing we infer.
        dense_dtype: cast unquantised experts to this dtype once, on decode (MLX's CPU
            `gather_mm` takes only float32); None keeps the upstream dtype.
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

    def decode(self, loc: ExpertLocation, blob: bytes | bytearray | memoryview) -> ExpertWeights:
        """The expert's kernel arrays. Raises UnsupportedModelError for an unknown encoding."""
        view = memoryview(blob)
        offsets = tensor_offsets(loc)
        by_proj: dict[str, dict[str, mx.array]] = {}
        for t in loc.tensors:
            proj, kind = _projection_and_kind(t.name)
            if proj not in PROJECTION_ALIASES:
                raise UnsupportedModelError(f"expert tensor {t.name}: unknown projection {proj!r}")
            offset, nbytes = offsets[t.name]
            by_proj.setdefault(PROJECTION_ALIASES[proj], {})[kind] = _to_mx(view, offset, nbytes, t.dtype, t.shape)
        missing = [p for p in PROJECTIONS if p not in by_proj]
        if missing:
            raise UnsupportedModelError(f"expert {loc.layer}/{loc.expert} has no {', '.join(missing)} tensors")
        projections = {p: self._projection(loc.layer, p, by_proj[p]) for p in PROJECTIONS}
        # Materialise here, on the fetching thread: a lazy array would carry this thread's MLX
        # stream into the generating thread's graph, and MLX streams are per thread.
        mx.eval([a for w in projections.values() for a in (w.weight, w.scales, w.biases, w.bias) if a is not None])
        return ExpertWeights(loc.layer, loc.expert, **projections)

    def _projection(self, layer: int, proj: str, t: dict[str, mx.array]) -> ProjectionWeights:
        bias = t.get("bias")
        if "weight_packed" in t:  # compressed-tensors pack-quantized
            weight = t["weight_packed"].view(mx.uint32)
            scales = t["weight_scale"]
            biases = -8 * scales if "weight_shape" in t else None  # int4 symmetric: zero point 8
            return ProjectionWeights(weight, scales, biases, bias, self._quant(layer, proj, weight, scales, biases))
        if "scales" in t:  # MLX-quantized
            weight, scales, biases = t["weight"], t["scales"], t.get("biases")
            return ProjectionWeights(weight, scales, biases, bias, self._quant(layer, proj, weight, scales, biases))
        if "weight" in t:
            weight = t["weight"]
            if self.dense_dtype is not None and weight.dtype != self.dense_dtype:
                weight = weight.astype(self.dense_dtype)
                bias = bias.astype(self.dense_dtype) if bias is not None else None
            return ProjectionWeights(weight, bias=bias)
        raise UnsupportedModelError(f"layer {layer} {proj}: unknown expert encoding {sorted(t)}")

    def _quant(self, layer: int, proj: str, weight: mx.array, scales: mx.array, biases: mx.array | None) -> QuantSpec:
        path = f"{self.block_paths.get(layer, '')}.{proj}"
        params = self.quantization.get(path)
        if not isinstance(params, dict):
            params = self.quantization
        in_dims = self.input_dims.get(layer, {}).get(proj)
        if in_dims is None:
            raise UnsupportedModelError(f"layer {layer} has no expert block in the model")
        bits = weight.shape[-1] * 32 // in_dims
        group_size = in_dims // scales.shape[-1]
        mode = params.get("mode") or ("affine" if biases is not None else "mxfp4")
        if params.get("bits", bits) != bits or params.get("group_size", group_size) != group_size:
            raise UnsupportedModelError(
                f"layer {layer} {proj}: expert packing ({bits} bits, groups of {group_size}) disagrees "
                f"with the config's quantization ({params.get('bits')} bits, groups of {params.get('group_size')})"
            )
        return QuantSpec(mode, bits, group_size)
