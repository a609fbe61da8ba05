"""What every tiny-model layout shares: seeded weights, tensor bytes, shards and repo files.

Weights come from mlx-lm's own module initialisers (seeded), so their scale is what the
architecture expects; each layout then renames and packs them the way its upstream publishes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from expertmesh.node.model import safetensors_format
from expertmesh.node.model.mlx_lm_models import flat_parameters, model_classes

_DTYPES = {
    mx.bfloat16: ("BF16", mx.uint16),
    mx.float16: ("F16", mx.uint16),
    mx.float32: ("F32", mx.float32),
    mx.uint8: ("U8", mx.uint8),
    mx.int32: ("I32", mx.int32),
    mx.uint32: ("U32", mx.uint32),
}


class LazyBytes:
    """Bytes of a known length, made only when they are written: a K3-sized expert (17.5 MB)
    is generated as its shard is written instead of all of a layer's at once."""

    def __init__(self, nbytes: int, make: Callable[[], bytes]):
        self.nbytes, self.make = nbytes, make

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        data = self.make()
        if len(data) != self.nbytes:
            raise ValueError(f"made {len(data)} bytes, {self.nbytes} promised")
        return data


@dataclass
class Tensor:
    """A named tensor ready to be written: safetensors dtype, shape and raw bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes | LazyBytes


def tensor(name: str, a: mx.array) -> Tensor:
    dtype, view = _DTYPES[a.dtype]
    return Tensor(name, dtype, tuple(a.shape), np.array(a.view(view)).tobytes())


def init_parameters(config: dict, seed: int) -> dict[str, mx.array]:
    """mlx-lm's freshly initialised parameters for `config`, by mlx-lm's own names."""
    model_class, args_class = model_classes(config)
    mx.random.seed(seed)
    model: nn.Module = model_class(args_class.from_dict(config))
    params = flat_parameters(model)
    mx.eval(params)
    return params


def perturb(a: mx.array, scale: float, key: mx.array) -> mx.array:
    """Add noise, so that norms and biases are not all ones or zeros (that hides bugs)."""
    return a + scale * mx.random.normal(a.shape, key=key).astype(a.dtype)


@dataclass
class Shard:
    tensors: list[Tensor] = field(default_factory=list)

    def add(self, t: Tensor) -> None:
        self.tensors.append(t)


def fold_kv_b(embed_q: mx.array, unembed_out: mx.array) -> mx.array:
    """Invert mlx-lm's MLA split: (H, r, nope) and (H, v, r) -> upstream kv_b_proj (H*(nope+v), r)."""
    kv_b = mx.concatenate([embed_q.swapaxes(-1, -2), unembed_out], axis=1)
    return kv_b.reshape(-1, kv_b.shape[-1])


CoreFn = Callable[[str, mx.array, dict[str, mx.array]], list[Tensor]]
ExpertsFn = Callable[[dict[str, mx.array], int], list[Tensor]]


def _layer_groups(params: dict[str, mx.array]) -> dict[str, list[str]]:
    """Core tensor names by where they are written: "head", "layerN", "tail"."""
    layer_re = re.compile(r"model\.layers\.(\d+)\.")
    groups: dict[str, list[str]] = {"head": [], "tail": []}
    for name in params:
        if ".switch_mlp." in name:
            continue
        m = layer_re.match(name)
        group = f"layer{m.group(1)}" if m else ("head" if name.startswith("model.embed_tokens") else "tail")
        groups.setdefault(group, []).append(name)
    return groups


def add_noise(params: dict[str, mx.array], num_layers: int, seed: int) -> dict[str, mx.array]:
    """`params` with noise on norms and selection biases, so that they are not all ones or zeros
    (that hides bugs). A maker that must see the written weights before writing them (to
    calibrate something on them) adds it itself and writes with `noise=False`."""
    key = mx.random.key(seed + 7919)
    groups = _layer_groups(params)
    out = dict(params)
    for group in ("head", *(f"layer{i}" for i in range(num_layers)), "tail"):
        for name in groups.get(group, []):
            key, sub = mx.random.split(key)
            if name.endswith(("norm.weight", "layernorm.weight", "e_score_correction_bias")):
                out[name] = perturb(params[name], 0.1, sub)
    return out


def write_layered_repo(
    out: Path,
    params: dict[str, mx.array],
    num_layers: int,
    moe_layers: list[int],
    core_fn: CoreFn,
    experts_fn: ExpertsFn,
    seed: int,
    layers_per_shard: int = 2,
    noise: bool = True,
) -> None:
    """Shard a model the way large upstream checkpoints are: by layers.

    Shard 1 starts with the embeddings; each layer's core tensors are followed by its
    experts; the last shard ends with the final norm and the LM head. `params` use mlx-lm
    names without any wrapper prefix; `core_fn` turns one of them into upstream tensors
    (or none, when another tensor already carried it); norms and biases get noise first
    (`add_noise`) unless `noise` is False.
    """
    groups = _layer_groups(params)
    if noise:
        params = add_noise(params, num_layers, seed)

    def core(group: str) -> list[Tensor]:
        tensors = []
        for name in groups.get(group, []):
            tensors += core_fn(name, params[name], params)
        return tensors

    shards = [Shard() for _ in range((num_layers + layers_per_shard - 1) // layers_per_shard)]
    shards[0].tensors += core("head")
    for layer in range(num_layers):
        shard = shards[layer // layers_per_shard]
        shard.tensors += core(f"layer{layer}")
        if layer in moe_layers:
            shard.tensors += experts_fn(params, layer)
    shards[-1].tensors += core("tail")
    write_shards(out, shards)


def write_shards(out: Path, shards: list[Shard]) -> None:
    """Write `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`."""
    n = len(shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, start=1):
        filename = f"model-{i:05d}-of-{n:05d}.safetensors"
        safetensors_format.write_file(
            out / filename,
            [(t.name, t.dtype, t.shape, t.data) for t in shard.tensors],
            metadata={"format": "pt"},
        )
        for t in shard.tensors:
            weight_map[t.name] = filename
            total += len(t.data)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def write_generation_config(out: Path, eos_token_id: int) -> None:
    write_json(out / "generation_config.json", {"eos_token_id": eos_token_id, "do_sample": False})


def write_readme(out: Path, arch: str, seed: int, note: str) -> None:
    (out / "README.md").write_text(
        f"# tiny {arch} (seed {seed})\n\nRandom weights made by `expertmesh tiny-model`; {note}\n"
        "For tests and demos only: it generates noise.\n"
    )
