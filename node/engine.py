"""mlx-lm's own model for the architecture, with every expert block streaming from the store.

The model is built by `mlx_lm.utils.load_model` from the local core, with one change: right
after the architecture's constructor runs, each `SwitchGLU` is swapped for a `StreamingSwitchGLU`
that keeps its call signature. The swapped-out blocks' expert weights were never evaluated (MLX
arrays are lazy), so no routed expert is ever materialised from the repo, and mlx-lm's sanitize,
quantisation and strict weight loading run unchanged on the core. Anything mlx-lm implements with
a `SwitchGLU` therefore streams, not just the fixtures.

How expert weights reach the kernel: at a MoE layer the block evaluates the routing (one
synchronisation per layer), asks the store for the layer's distinct experts in one call, gathers
the activation rows once so each expert's rows are contiguous, and runs them through
`quantized_matmul` (or a plain matmul for BF16 experts) with that expert's own arrays from the RAM
tier. A token therefore copies no resident expert; the only per-token copies are the routed
activation rows (k rows of the model width per token) and the outputs.
"""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import SwitchGLU
from mlx_lm.utils import _get_classes, load_model

from node.errors import UnsupportedModelError
from node.expert_codec import ExpertWeights, ProjectionWeights

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class StreamingSwitchGLU(nn.Module):
    """A `SwitchGLU` whose experts come from an expert store, one layer's set per call."""

    def __init__(self, layer: int, path: str, original: SwitchGLU):
        super().__init__()
        self.layer = layer
        self.path = path
        self.activation = original.activation
        self.input_dims = {p: getattr(original, p).input_dims for p in ("gate_proj", "up_proj", "down_proj")}
        object.__setattr__(self, "_store", None)  # a plain attribute: not a parameter or child module

    def bind(self, store) -> None:
        object.__setattr__(self, "_store", store)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        store = self._store
        if store is None:
            raise RuntimeError(f"expert block of layer {self.layer} has no expert store bound")
        k = indices.shape[-1]
        flat = np.array(indices.reshape(-1))  # evaluates the routing: the one sync per layer
        order = np.argsort(flat, kind="stable")
        experts, starts = np.unique(flat[order], return_index=True)
        weights = store.get_layer(self.layer, experts.tolist())
        x_rows = x.reshape(-1, x.shape[-1])[mx.array(order // k)]  # grouped by expert: one gather
        ends = [*starts[1:].tolist(), len(order)]
        outputs = [_expert_forward(weights[e], self.activation, x_rows[start:end])
                   for e, start, end in zip(experts.tolist(), starts.tolist(), ends)]  # fmt: skip
        y = mx.concatenate(outputs, axis=0)[mx.array(np.argsort(order))]
        return y.reshape(*indices.shape, y.shape[-1])


def _expert_forward(w: ExpertWeights, activation, x: mx.array) -> mx.array:
    """(n, in) rows through one expert -> (n, out), with the kernels of mlx-lm's quantized layers."""
    return _project(w.down_proj, activation(_project(w.up_proj, x), _project(w.gate_proj, x)))


def _project(p: ProjectionWeights, x: mx.array) -> mx.array:
    if p.quant is not None:
        y = mx.quantized_matmul(x, p.weight, p.scales, p.biases, transpose=True, group_size=p.quant.group_size,
                                bits=p.quant.bits, mode=p.quant.mode)  # fmt: skip
    else:
        y = x @ p.weight.T
    if p.bias is not None:
        y = y + p.bias
    return y


def _set_module(root: nn.Module, path: str, module: nn.Module) -> None:
    parent: object = root
    parts = path.split(".")
    for part in parts[:-1]:
        parent = parent[int(part)] if isinstance(parent, list) else parent[part]
    if isinstance(parent, list):
        parent[int(parts[-1])] = module
    else:
        setattr(parent, parts[-1], module)


def install_streaming_blocks(model: nn.Module) -> list[StreamingSwitchGLU]:
    """Swap every SwitchGLU of `model` for a streaming block; returns them in layer order."""
    blocks = []
    for path, module in list(model.named_modules()):
        if isinstance(module, SwitchGLU):
            m = _LAYER_RE.search(path + ".")
            if m is None:
                raise UnsupportedModelError(f"expert block {path} is not inside a numbered layer")
            block = StreamingSwitchGLU(int(m.group(1)), path, module)
            _set_module(model, path, block)
            blocks.append(block)
    return sorted(blocks, key=lambda b: b.layer)


def streaming_blocks(model: nn.Module) -> list[StreamingSwitchGLU]:
    return sorted((m for _, m in model.named_modules() if isinstance(m, StreamingSwitchGLU)), key=lambda b: b.layer)


def _streaming_classes(config: dict):
    model_class, args_class = _get_classes(config=config)

    class StreamingModel(model_class):
        def __init__(self, args):
            super().__init__(args)
            install_streaming_blocks(self)

    StreamingModel.__name__ = f"Streaming{model_class.__name__}"
    return StreamingModel, args_class


def load_core_model(model_dir: Path) -> tuple[nn.Module, dict, list[StreamingSwitchGLU]]:
    """mlx-lm's model of a pulled repo with the core in memory and streaming expert blocks.

    Raises:
        UnsupportedModelError: mlx-lm has no such architecture, or it has no SwitchGLU experts.
    """
    try:
        model, config = load_model(Path(model_dir), lazy=False, strict=True, get_model_classes=_streaming_classes)
    except ValueError as e:
        if "not supported" in str(e) or "Model type" in str(e) or "trust_remote_code" in str(e):
            raise UnsupportedModelError(str(e)) from None
        raise
    blocks = streaming_blocks(model)
    if not blocks:
        raise UnsupportedModelError(
            f"{config.get('model_type')}: mlx-lm builds no SwitchGLU expert blocks for this model, so there is "
            "nothing to stream (is it a Mixture-of-Experts model?)"
        )
    return model, config, blocks
