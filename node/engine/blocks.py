"""mlx-lm's own model for the architecture, with every expert block streaming from the store.

The model is built by `mlx_lm.utils.load_model` from the local core, with one change: right
after the architecture's constructor runs, each `SwitchGLU` (or gate-less `SwitchMLP`) is swapped for a `StreamingExperts`
that keeps its call signature. The swapped-out blocks' expert weights were never evaluated (MLX
arrays are lazy), so no routed expert is ever materialised from the repo, and mlx-lm's sanitize,
quantisation and strict weight loading run unchanged on the core. Anything mlx-lm implements with
a `SwitchGLU` or `SwitchMLP` therefore streams, not just the fixtures.

How expert weights reach the kernel: at a MoE layer the block evaluates the routing (one
synchronisation per layer), asks the store for the layer's distinct experts in one call, gathers
the activation rows once so each expert's rows are contiguous, and runs them through
`quantized_matmul` (or a plain matmul for BF16 experts) with that expert's own arrays from the RAM
tier. A token therefore copies no resident expert; the only per-token copies are the routed
activation rows (k rows of the model width per token) and the outputs.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP
from mlx_lm.utils import load_model

from expertmesh.node.engine.model_thread import model_thread
from expertmesh.node.errors import UnsupportedModelError
from expertmesh.node.model.codec import ExpertWeights, ProjectionWeights
from expertmesh.node.model.mlx_lm_models import BLOCK_PROJECTIONS, layer_number, model_classes
from expertmesh.node.store.stats import StoreStats, tapped, thread_value

_by_row = threading.local()  # the ledgers of the rows of the forward pass running on this thread


def expert_uses_by_row(ledgers: list[StoreStats]):
    """While inside, every expert block called on this thread also counts, in `ledgers[r]`, the
    experts the tokens of batch row r routed to, each under the source that served it to the
    layer (engine/batching.py: a batched request's own expert uses). Rows are the leading
    dimension of the model's input, in order."""
    return thread_value(_by_row, "ledgers", ledgers)


class StreamingExperts(nn.Module):
    """A `SwitchGLU` or `SwitchMLP` whose experts come from an expert store, one layer's set per
    call; the same call signature, so the architecture's MoE module calls it unchanged."""

    def __init__(self, layer: int, path: str, original: SwitchGLU | SwitchMLP):
        super().__init__()
        self.layer = layer
        self.path = path
        self.kind = "SwitchGLU" if isinstance(original, SwitchGLU) else "SwitchMLP"  # a subclass is its base
        self.projections = BLOCK_PROJECTIONS[self.kind]
        self.activation = original.activation
        for name, member in original.items():  # anything beside the projections stays, as core
            if name not in self.projections and name != "activation":  # (muse_spark's post_expert_norm)
                self[name] = member
        self.input_dims = {p: getattr(original, p).input_dims for p in self.projections}
        self.output_dims = getattr(original, self.projections[-1]).output_dims
        # Plain attributes (object.__setattr__), not parameters or child modules:
        self._set("_store", None)
        self._set("_next", None)  # (next MoE layer's block, its parent MoE module), for guesses
        self._set("_predicting", False)  # while True, a call only records its routing
        self._set("_predicted", None)
        self._set("_guess", None)  # the next layer's routing guessed from this layer's input
        self._set("_remote", None)  # a RemoteExperts (node/household/remote_experts.py) when peers can compute

    def _set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)

    def bind(self, store) -> None:
        self._set("_store", store)

    def bind_remote(self, remote) -> None:
        self._set("_remote", remote)

    @property
    def store(self):
        return self._store

    @property
    def input_width(self) -> int:
        return self.input_dims[self.projections[0]]

    def wants_guesses(self) -> bool:
        return self._next is not None and self._store is not None and self._store.wants_guesses()

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if self._predicting:  # a guess of this layer's routing: no experts needed, output unused
            self._set("_predicted", indices)
            return mx.zeros((*indices.shape, self.output_dims), dtype=x.dtype)
        store = self._store
        if store is None:
            raise RuntimeError(f"expert block of layer {self.layer} has no expert store bound")
        model_thread().between_layers()  # a peer's ComputeExperts waits one layer, not a generation
        guess = self._guess
        self._set("_guess", None)
        if guess is not None:
            mx.eval(indices, guess)  # the guess rides on the same sync as the routing
        k = indices.shape[-1]
        flat = np.array(indices.reshape(-1))  # evaluates the routing: the one sync per layer
        order = np.argsort(flat, kind="stable")
        experts, starts = np.unique(flat[order], return_index=True)
        next_guess = None
        if guess is not None:
            next_guess = (self._next[0].layer, np.unique(np.array(guess)).tolist())
        x_rows = x.reshape(-1, x.shape[-1])[mx.array(order // k)]  # grouped by expert: one gather
        ends = [*starts[1:].tolist(), len(order)]
        experts = experts.tolist()
        rows = {e: x_rows[start:end] for e, start, end in zip(experts, starts.tolist(), ends)}
        ledgers = getattr(_by_row, "ledgers", None)
        served: dict[int, tuple[str, int, float]] = {}

        def tap(key, source: str, nbytes: int, seconds: float) -> None:
            if key is not None and key[0] == self.layer:
                served[key[1]] = (source, nbytes, seconds)

        with tapped(tap) if ledgers is not None else contextlib.nullcontext():
            out = self._run(store, experts, rows, next_guess)
        if ledgers is not None:
            _count_by_row(ledgers, flat, served)
        y = mx.concatenate([out[e] for e in experts], axis=0)[mx.array(np.argsort(order))]
        return y.reshape(*indices.shape, y.shape[-1])

    def _run(self, store, experts: list[int], rows: dict[int, mx.array], next_guess) -> dict[int, mx.array]:
        """Each routed expert's output for its rows (lazy), computed here or on peers."""
        if self._remote is not None:  # some experts may run on the peers that hold them
            return self._remote.run(self, experts, rows, next_guess)
        out = {}
        groups = store.layer_groups(self.layer, experts, guess=next_guess)
        for n, weights in enumerate(groups):
            part = self.compute(weights, {e: rows[e] for e in weights})
            if n or len(weights) < len(experts):  # more experts than memory holds: compute
                mx.eval(list(part.values()))  # this group now, so its weights can go
            out.update(part)
            del weights
        return out

    def compute(self, weights: dict[int, ExpertWeights], rows: dict[int, mx.array]) -> dict[int, mx.array]:
        """Each expert's rows through it (lazy): the same kernels whether the rows are this node's
        own or arrived from a peer (ComputeExperts)."""
        forward = _glu_forward if self.kind == "SwitchGLU" else _mlp_forward
        return {e: forward(weights[e].projections, self.activation, rows[e]) for e in rows}


def _count_by_row(ledgers: list[StoreStats], flat: np.ndarray, served: dict[int, tuple[str, int, float]]) -> None:
    """Count in each row's ledger the distinct experts its tokens routed to (`flat`: the layer's
    routing, row after row). An expert the store did not serve here ran on a peer (`remote`).
    A routing that does not split into the rows (no architecture does so) counts the whole
    layer's experts for every row rather than guessing."""
    per_row, extra = divmod(len(flat), len(ledgers))
    for r, ledger in enumerate(ledgers):
        mine = flat if extra else flat[r * per_row : (r + 1) * per_row]
        for e in np.unique(mine).tolist():
            ledger.record(*served.get(e, ("remote", 0, 0.0)))


def _glu_forward(w: dict[str, ProjectionWeights], activation, x: mx.array) -> mx.array:
    """(n, in) rows through one `SwitchGLU` expert -> (n, out), with the kernels of mlx-lm's
    quantized layers; mlx-lm's activation takes (up, gate)."""
    return _project(w["down_proj"], activation(_project(w["up_proj"], x), _project(w["gate_proj"], x)))


def _mlp_forward(w: dict[str, ProjectionWeights], activation, x: mx.array) -> mx.array:
    """(n, in) rows through one `SwitchMLP` expert: fc2(act(fc1(x)))."""
    return _project(w["fc2"], activation(_project(w["fc1"], x)))


def _project(p: ProjectionWeights, x: mx.array) -> mx.array:
    if p.quant is not None:
        y = mx.quantized_matmul(
            x,
            p.weight,
            p.scales,
            p.biases,
            transpose=True,
            group_size=p.quant.group_size,
            bits=p.quant.bits,
            mode=p.quant.mode,
        )
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


def install_streaming_blocks(model: nn.Module) -> list[StreamingExperts]:
    """Swap every SwitchGLU and SwitchMLP of `model` for a streaming block; returns them in layer order."""
    blocks = []
    for path, module in list(model.named_modules()):
        if isinstance(module, (SwitchGLU, SwitchMLP)):
            layer = layer_number(path)
            if layer is None:
                raise UnsupportedModelError(f"expert block {path} is not inside a numbered layer")
            block = StreamingExperts(layer, path, module)
            _set_module(model, path, block)
            blocks.append(block)
    return sorted(blocks, key=lambda b: b.layer)


_GUESSING_CLASSES: dict[type, type] = {}


def _guessing_class(moe_class: type) -> type:
    """`moe_class` whose call first runs the next MoE layer's router on this layer's input.

    Any MoE module that routes and then calls its expert block works: the next layer's module is
    called with its block in predicting mode, so only the router's part of that lazy graph is
    ever evaluated (shared experts and the rest are never computed). The guess is the routing
    that layer would choose for this hidden state, which is usually close to its real input.
    """
    if moe_class not in _GUESSING_CLASSES:

        class Guessing(moe_class):
            def __call__(self, x, *args, **kwargs):
                block = self.__dict__.get("_expertmesh_block")
                if block is not None and not block._predicting and block.wants_guesses():
                    next_block, next_moe = block._next
                    next_block._set("_predicting", True)
                    try:
                        next_moe(x, *args, **kwargs)
                    finally:
                        next_block._set("_predicting", False)
                    block._set("_guess", next_block._predicted)
                return super().__call__(x, *args, **kwargs)

        Guessing.__name__ = Guessing.__qualname__ = f"Guessing{moe_class.__name__}"
        _GUESSING_CLASSES[moe_class] = Guessing
    return _GUESSING_CLASSES[moe_class]


def _module_at(root: nn.Module, path: str) -> nn.Module:
    node: object = root
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def link_next_layer_guesses(model: nn.Module, blocks: list[StreamingExperts]) -> None:
    """Let each MoE module guess the next MoE layer's experts (see `_guessing_class`)."""
    for block, nxt in zip(blocks, blocks[1:]):
        moe, next_moe = (_module_at(model, b.path.rsplit(".", 1)[0]) for b in (block, nxt))
        if not isinstance(moe, nn.Module) or not isinstance(next_moe, nn.Module):
            continue
        moe.__class__ = _guessing_class(type(moe))
        object.__setattr__(moe, "_expertmesh_block", block)
        block._set("_next", (nxt, next_moe))


def streaming_blocks(model: nn.Module) -> list[StreamingExperts]:
    return sorted((m for _, m in model.named_modules() if isinstance(m, StreamingExperts)), key=lambda b: b.layer)


def _streaming_classes(config: dict, expert_standins: dict[str, tuple[str, tuple[int, ...]]] | None = None):
    model_class, args_class = model_classes(config)

    class StreamingModel(model_class):
        def __init__(self, args):
            super().__init__(args)
            install_streaming_blocks(self)

        if expert_standins:

            def sanitize(self, weights):
                return _sanitize_with_standins(self, super().sanitize, weights, expert_standins)

    StreamingModel.__name__ = f"Streaming{model_class.__name__}"
    return StreamingModel, args_class


def _sanitize_with_standins(model: nn.Module, sanitize, weights: dict, standins: dict) -> dict:
    """mlx-lm's sanitize over the core plus lazy zero stand-ins of the expert tensors, for an
    architecture whose sanitize treats the core differently when they are absent (see
    model/expert_index.py, `sanitize_with_experts`). What it makes of the stand-ins is dropped before
    anything is evaluated, so they cost graph nodes, not memory."""
    from expertmesh.node.model.expert_index import streamed_prefixes
    from expertmesh.node.model.expert_trace import SAFETENSORS_DTYPES

    made = sanitize({**weights, **{n: mx.zeros(shape, SAFETENSORS_DTYPES[d]) for n, (d, shape) in standins.items()}})
    streamed = streamed_prefixes({b.path: b.kind for b in streaming_blocks(model)})
    return {k: v for k, v in made.items() if not k.startswith(streamed) and k not in standins}


def core_standins(index, core_bits: int) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    """The stand-ins `load_core_model` needs for this index's core: only while the core is still
    the upstream one (16 bits); an 8-bit core was saved already sanitized (engine/core_quantization.py)."""
    return index.expert_tensors() if index.sanitize_with_experts and core_bits == 16 else None


def load_core_model(
    model_dir: Path, expert_standins: dict[str, tuple[str, tuple[int, ...]]] | None = None, lazy: bool = False
) -> tuple[nn.Module, dict, list[StreamingExperts]]:
    """mlx-lm's model of a pulled repo with the core in memory and streaming expert blocks.

    `expert_standins` (name -> safetensors dtype, shape) is given for a core still in its upstream
    form whose architecture's sanitize needs to see the experts (`ExpertIndex.sanitize_with_experts`).
    `lazy` leaves the core's parameters unevaluated: MLX reads each from its file when it is
    first evaluated (quantising shard by shard, a core streamed layer by layer).

    Raises:
        UnsupportedModelError: mlx-lm has no such architecture, or it has no SwitchGLU or SwitchMLP experts.
    """
    try:
        model, config = load_model(
            Path(model_dir),
            lazy=lazy,
            strict=True,
            get_model_classes=functools.partial(_streaming_classes, expert_standins=expert_standins),
        )
    except ValueError as e:
        if "not supported" in str(e) or "Model type" in str(e) or "trust_remote_code" in str(e):
            raise UnsupportedModelError(str(e)) from None
        raise
    blocks = streaming_blocks(model)
    link_next_layer_guesses(model, blocks)
    if not blocks:
        raise UnsupportedModelError(
            f"{config.get('model_type')}: mlx-lm builds no SwitchGLU or SwitchMLP expert blocks for this model, so there is "
            "nothing to stream (is it a Mixture-of-Experts model?)"
        )
    return model, config, blocks
