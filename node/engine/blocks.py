"""mlx-lm's own model for the architecture, with every expert block streaming from the store.

The model is built by `mlx_lm.utils.load_model` from the local core, with one change: right
after the architecture's constructor runs, each `SwitchGLU` (or gate-less `SwitchMLP`) is swapped for a `StreamingExperts`
that keeps its call signature. The swapped-out blocks' expert weights were never evaluated (MLX
arrays are lazy), so no routed expert is ever materialised from the repo, and mlx-lm's sanitize,
quantisation and strict weight loading run unchanged on the core. Anything mlx-lm implements with
a `SwitchGLU` or `SwitchMLP` therefore streams, not just the fixtures.

How expert weights reach the kernel: the RAM tier keeps experts in slots of stacked arrays laid
out as mlx-lm's `QuantizedSwitchLinear`/`SwitchLinear` weights are (store/tiers/ram.py), and a
layer runs mlx-lm's own `SwitchGLU.__call__` (or `SwitchMLP`'s) over them, with the router's
expert ids mapped to slot ids: one `gather_qmm` (or `gather_mm`) per projection, sorted as
mlx-lm sorts from 64 rows on. A token copies no resident expert. An arrival the tier does not keep
is never written into a slot (a copy of it that nothing reads again): the same call runs over its
own decoded arrays, a stack of one (`compute`).

Two ways a layer runs:
- resident: every expert of the layer is in a slot. The id -> slot map is an MLX array, so the
  layer runs without a host sync, as mlx-lm's does; its uses are counted once the pass has been
  evaluated (`ForwardPass.count_uses`, which then reads the routing without waiting);
- streamed: the block evaluates the routing (the one synchronisation of the layer, which the
  next layer's guess rides on), asks the store for the layer's distinct experts in one call
  (`layer_groups`), places the arrivals in slots and maps ids to slots on the host.

A forward pass's context comes in explicitly: the `ForwardPass` being built
(engine/forward_pass.py, made by `StreamedModel.forward`) carries a batch's per-row ledgers and the
next-layer guesses the MoE layers leave each other, and the store's answer carries which tier
served each expert. A block reads and writes only the pass, never another block.

What a block asks of the store and of remote execution is written down as two protocols,
`BlockStore` and `RemoteExecution`: the store (node/store/store.py) and the household's
`RemoteExperts` (node/household/remote_experts.py, a layer above, which this module may not
import) satisfy them as they are, and a test may bind a block to anything that does.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear, SwitchMLP
from mlx_lm.utils import load_model

from expertmesh.node.engine.expert_rows import GroupedRows, RoutedRows
from expertmesh.node.engine.forward_pass import building, count_by_row
from expertmesh.node.engine.model_thread import model_thread
from expertmesh.node.errors import UnsupportedModelError
from expertmesh.node.model.codec import QuantSpec
from expertmesh.node.model.expert_index import ExpertIndex
from expertmesh.node.model.mlx_lm_models import BLOCK_PROJECTIONS, layer_number, model_classes
from expertmesh.node.store.prefetch import LayerGuess
from expertmesh.node.store.stats import StoreStats
from expertmesh.node.store.store import ExpertGroup, Placed, Served
from expertmesh.node.store.tiers.ram import RamCache


class BlockStore(Protocol):
    """The expert store as the blocks use it (node/store/store.py's `ExpertStore`): the experts of
    one layer per call, the RAM tier whose slots the kernels read, and the counters of every use."""

    @property
    def index(self) -> ExpertIndex: ...

    @property
    def ram(self) -> RamCache: ...

    @property
    def stats(self) -> StoreStats: ...

    def layer_groups(
        self,
        layer: int,
        experts: Iterable[int],
        guess: LayerGuess | None = None,
        routed: Iterable[int] | None = None,
    ) -> Iterator[ExpertGroup]: ...

    def wants_guesses(self) -> bool: ...

    def resident_uses(self, layer: int, experts: list[int]) -> None: ...


class ExpertOutputs(Protocol):
    """Where a layer's expert outputs go as they are made, a part of an expert's rows at a time:
    a prompt writes each into its chunks' outputs at once, so no part waits for the rest."""

    def put(self, expert: int, first: int, rows: mx.array) -> None:
        """Rows `first`, `first + 1`, ... of `expert`'s outputs (in the order of its input rows)."""
        ...

    def drop(self, expert: int) -> None:
        """Forget what was put of `expert`: it will be put again, whole."""
        ...


class RemoteExecution(Protocol):
    """Running a streamed layer's experts where they are cheapest, here or on the household's
    compute peers (node/household/remote_experts.py's `RemoteExperts`)."""

    def run(
        self, block: StreamingExperts, experts: list[int], rows: RoutedRows, guess: LayerGuess | None
    ) -> tuple[dict[int, mx.array], dict[int, Served]]:
        """Each expert's output rows for `block`'s layer (`rows[e]`: the rows routed to expert e,
        grouped), and which tier (or `remote`) served each."""
        ...

    def run_into(
        self,
        block: StreamingExperts,
        experts: list[int],
        rows: RoutedRows,
        guess: LayerGuess | None,
        outputs: ExpertOutputs,
    ) -> dict[int, Served]:
        """As `run`, each part of an expert's output rows put into `outputs` as it is made;
        expert e's rows gathered only when they are sent (`rows.host(e)`) or computed here
        (`rows[e]`)."""
        ...


class _SlotQuantizedLinear(QuantizedSwitchLinear):
    """mlx-lm's `QuantizedSwitchLinear`, its stacked weights a RAM-tier pool's slots."""

    def __init__(self, quant: QuantSpec):
        nn.Module.__init__(self)
        self.group_size, self.bits, self.mode = quant.group_size, quant.bits, quant.mode
        self.global_scale = None


class _SlotLinear(SwitchLinear):
    """mlx-lm's `SwitchLinear`, its stacked weights a RAM-tier pool's slots."""

    def __init__(self):
        nn.Module.__init__(self)


def _bind_slots(linear: nn.Module, stacks: dict[str, mx.array]) -> None:
    """Point a slot linear at its pool's current stacks (a slot write makes new arrays)."""
    for kind in ("weight", "scales", "biases", "bias"):
        if kind in stacks:
            linear[kind] = stacks[kind]
        elif kind in linear:
            del linear[kind]


class StreamingExperts(nn.Module):
    """A `SwitchGLU` or `SwitchMLP` whose experts come from an expert store, one layer's set per
    call; the same call signature, so the architecture's MoE module calls it unchanged."""

    # Plain attributes (set with object.__setattr__ by `_set`), not parameters or child modules:
    _store: BlockStore | None
    _next: tuple[StreamingExperts, nn.Module] | None  # the next MoE layer's block and its parent MoE module
    _remote: RemoteExecution | None  # set when peers can compute
    _linears: dict[str, nn.Module] | None  # projection -> slot linear, made at the first compute
    _prefill: Any  # while a prompt is prefilled layer-major, its gatherer (engine/prefill.py's LayerMajor)

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
        self.num_experts = getattr(original, self.projections[0]).num_experts
        self._set("_store", None)
        self._set("_next", None)
        self._set("_remote", None)
        self._set("_linears", None)
        self._set("_prefill", None)

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)

    def bind(self, store: BlockStore) -> None:
        self._set("_store", store)

    def bind_remote(self, remote: RemoteExecution) -> None:
        self._set("_remote", remote)

    @property
    def store(self) -> BlockStore | None:
        return self._store

    def _bound_store(self) -> BlockStore:
        if self._store is None:
            raise RuntimeError(f"expert block of layer {self.layer} has no expert store bound")
        return self._store

    @property
    def input_width(self) -> int:
        return self.input_dims[self.projections[0]]

    def runs_resident(self) -> bool:
        """Whether a call now runs without a sync: inside a pass, with every expert resident."""
        return building() is not None and self._store is not None and self._store.ram.resident(self.layer)

    def wants_guesses(self) -> bool:
        """Guess the next layer only where a guess can be fetched in time: this layer syncs (it
        streams), and the next one will ask the store (it does not run resident)."""
        if self._next is None or self._store is None or not self._store.wants_guesses():
            return False
        return not self.runs_resident() and not self._next[0].runs_resident()

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        step = building()
        if step is not None and step.predicts(self.layer):  # a guess of this layer's routing: output unused
            step.guesses[self.layer] = indices
            return mx.zeros((*indices.shape, self.output_dims), dtype=x.dtype)
        if self._prefill is not None:  # a layer-major prompt: every chunk's rows first (engine/prefill.py)
            return self._prefill.park(self, x, indices)
        store = self._bound_store()
        nxt = self._next[0].layer if self._next is not None else None
        guess = step.guesses.pop(nxt, None) if step is not None and nxt is not None else None
        if step is not None and (slot_map := store.ram.slot_map(self.layer)) is not None:
            # every expert resident: no sync, the ids mapped on the device
            step.unread.append((store, self.layer, indices))
            store.stats.record_layer("resident")
            return self._switch(x, slot_map[indices])
        # the one sync of this layer; the guess rides on it, and so do the rows a household reads
        # on the host to send to peers (engine/expert_rows.py)
        mx.eval(indices, *([] if guess is None else [guess]), *([] if self._remote is None else [x]))
        model_thread().between_layers()  # a peer's ComputeExperts waits one layer, not a generation
        flat = np.array(indices).reshape(-1)
        experts = np.unique(flat).tolist()
        next_guess: LayerGuess | None = None
        if guess is not None and nxt is not None:  # only a block with a next layer guesses
            next_guess = LayerGuess(nxt, np.unique(np.array(guess)).tolist(), flat.size // indices.shape[-1])
        if self._remote is not None:  # some experts may run on the peers that hold them
            y, served = self._run_remote(self._remote, x, indices.shape[-1], flat, experts, next_guess)
        else:
            y, served = self._run_here(store, x, indices, flat, experts, next_guess)
        store.stats.record_layer("streamed")
        ledgers = step.ledgers if step is not None else None
        if ledgers is not None:
            count_by_row(ledgers, flat, served)
        return y.reshape(*indices.shape, self.output_dims)

    # -- the kernels ----------------------------------------------------------------------------

    def _switch(self, x: mx.array, slots: mx.array, stacks: dict[str, dict[str, mx.array]] | None = None) -> mx.array:
        """mlx-lm's `SwitchGLU.__call__` (or `SwitchMLP`'s), line for line, over stacked expert
        arrays: the RAM tier's slots (`stacks` None), with `slots` the router's indices mapped to
        slot ids (lazy), or one expert's own arrays as a stack of one (`ExpertWeights.stack`).

        The slot linears hold the stacks only while the call builds its graph: a stack
        referenced anywhere else when a slot is written could not give its buffer to the write,
        and the write would copy the whole stack."""
        pool = self._bound_store().ram.pool(self.layer)
        if stacks is None:
            if pool.arrays is None:  # made at the first slot write: no slot yet that the ids could name
                raise RuntimeError(f"expert block of layer {self.layer}: no expert placed in a RAM slot yet")
            stacks = pool.arrays
        linears = self._linears
        if linears is None:
            quants = {name: quant for name, _, quant in pool.layout.projections}
            linears = {
                p: _SlotQuantizedLinear(q) if (q := quants[p]) is not None else _SlotLinear() for p in self.projections
            }
            self._set("_linears", linears)
        for p, linear in linears.items():
            _bind_slots(linear, stacks[p])
            object.__setattr__(self, p, linear)  # where mlx-lm's call looks for it, outside the parameters
        try:
            # mlx-lm's call, unbound, over this block: it reads only the projections and the
            # activation, which the block holds under the same names
            switch: Callable[..., mx.array] = SwitchGLU.__call__ if self.kind == "SwitchGLU" else SwitchMLP.__call__
            return switch(self, x, slots)
        finally:
            for linear in linears.values():
                _bind_slots(linear, {})

    def compute(self, placed: Placed, x: mx.array, ids: np.ndarray) -> mx.array:
        """`x` (..., width) through the experts `ids` (..., k) names, lazy, shaped as mlx-lm's call
        makes it (..., k, output width): one call over the slots where `placed` has every expert
        in one, else the experts in slots in one call and each loose expert over its own arrays,
        one (row, expert) pair a row, as mlx-lm computes each pair."""
        lut = np.zeros(self.num_experts, dtype=np.uint32)
        lut[list(placed.slots)] = list(placed.slots.values())
        if not placed.loose:
            return self._switch(x, mx.array(lut[ids]))
        k, flat = ids.shape[-1], ids.reshape(-1)
        rows = x.reshape(-1, x.shape[-1])
        parts, where = [], []
        in_slots = np.flatnonzero(np.isin(flat, list(placed.slots)))
        if in_slots.size:
            parts.append(self._switch(rows[mx.array(in_slots // k)], mx.array(lut[flat[in_slots]])[:, None]))
            where.append(in_slots)
        for e, weights in placed.loose.items():
            pairs = np.flatnonzero(flat == e)
            if pairs.size:
                zeros = mx.zeros((pairs.size, 1), dtype=mx.uint32)
                parts.append(self._switch(rows[mx.array(pairs // k)], zeros, weights.stack()))
                where.append(pairs)
        y = mx.concatenate([part.reshape(part.shape[0], -1) for part in parts], axis=0)
        return y[mx.array(np.argsort(np.concatenate(where)))].reshape(*ids.shape, -1)

    def compute_rows(self, placed: Placed, rows: dict[int, mx.array]) -> dict[int, mx.array]:
        """Each expert's rows (n, input width) through it, lazy: the same kernels whether the rows
        are this node's own or arrived from a peer (ComputeExperts). `placed` from `ExpertGroup.placed`."""
        experts = list(rows)
        if not experts:
            return {}
        counts = [rows[e].shape[0] for e in experts]
        x = mx.concatenate([rows[e] for e in experts], axis=0)
        y = self.compute(placed, x, np.repeat(experts, counts)[:, None]).reshape(-1, self.output_dims)
        ends = np.cumsum(counts).tolist()
        return {e: y[end - n : end] for e, n, end in zip(experts, counts, ends)}

    # -- a streamed layer ---------------------------------------------------------------------

    def _run_here(
        self,
        store: BlockStore,
        x: mx.array,
        indices: mx.array,
        flat: np.ndarray,
        experts: list[int],
        next_guess: LayerGuess | None,
    ) -> tuple[mx.array, dict[int, Served]]:
        """The layer on this node: one group (mlx-lm's call over all the rows), or several where
        the layer wants more experts than memory holds (each group computed, then let go)."""
        served: dict[int, Served] = {}
        groups = store.layer_groups(self.layer, experts, guess=next_guess)
        first = next(groups)
        if len(first.served) == len(experts):  # one group held them all: the store has no other
            with first.placed() as placed:
                y = self.compute(placed, x, flat.reshape(indices.shape))
            served.update(first.served)
            return y, served
        k = indices.shape[-1]
        order = np.argsort(flat, kind="stable")
        by_expert = flat[order]
        x_rows = x.reshape(-1, x.shape[-1])[mx.array(order // k)]  # grouped by expert: one gather
        parts = []
        for group in itertools.chain([first], groups):  # one at a time: a group is fetched as the last is computed
            lo, hi = min(group.served), max(group.served)
            a, b = int(np.searchsorted(by_expert, lo)), int(np.searchsorted(by_expert, hi, side="right"))
            with group.placed() as placed:
                part = self.compute(placed, x_rows[a:b], by_expert[a:b, None]).reshape(b - a, -1)
                mx.eval(part)  # computed now, so this group's slots can go to the next one
            parts.append(part)
            served.update(group.served)
        y = mx.concatenate(parts, axis=0)[mx.array(np.argsort(order))]
        return y, served

    def _run_remote(
        self,
        remote: RemoteExecution,
        x: mx.array,
        k: int,
        flat: np.ndarray,
        experts: list[int],
        next_guess: LayerGuess | None,
    ) -> tuple[mx.array, dict[int, Served]]:
        """The layer with compute peers: each expert's rows go where RemoteExperts places them."""
        rows = GroupedRows(x, flat, k)
        out, served = remote.run(self, experts, rows, next_guess)
        y = mx.concatenate([out[e] for e in experts], axis=0)[mx.array(np.argsort(rows.order))]
        return y, served


def _child(parent: nn.Module | list, part: str) -> nn.Module | list:
    """A module's child by one part of its dotted path: a list (mlx-lm's `layers`) is indexed."""
    return parent[int(part)] if isinstance(parent, list) else parent[part]


def _set_module(root: nn.Module, path: str, module: nn.Module) -> None:
    parent: nn.Module | list = root
    parts = path.split(".")
    for part in parts[:-1]:
        parent = _child(parent, part)
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
                step = building()
                if (
                    block is not None
                    and step is not None
                    and step.predicting is None
                    and not step.routing_only
                    and block.wants_guesses()
                ):
                    next_block, next_moe = block._next
                    step.predicting = next_block.layer  # its block records the routing in the pass
                    try:
                        next_moe(x, *args, **kwargs)
                    finally:
                        step.predicting = None
                return super().__call__(x, *args, **kwargs)

        Guessing.__name__ = Guessing.__qualname__ = f"Guessing{moe_class.__name__}"
        _GUESSING_CLASSES[moe_class] = Guessing
    return _GUESSING_CLASSES[moe_class]


def _module_at(root: nn.Module, path: str) -> nn.Module | list:
    node: nn.Module | list = root
    for part in path.split("."):
        node = _child(node, part)
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


def _streaming_classes(
    config: dict, expert_standins: dict[str, tuple[str, tuple[int, ...]]] | None = None
) -> tuple[type[nn.Module], type]:
    model_class: Any  # the architecture's class, found in mlx-lm's registry by the config's name
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


def _sanitize_with_standins(
    model: nn.Module, sanitize: Callable[[dict], dict], weights: dict, standins: dict[str, tuple[str, tuple[int, ...]]]
) -> dict:
    """mlx-lm's sanitize over the core plus lazy zero stand-ins of the expert tensors, for an
    architecture whose sanitize treats the core differently when they are absent (see
    model/expert_index.py, `sanitize_with_experts`). What it makes of the stand-ins is dropped before
    anything is evaluated, so they cost graph nodes, not memory."""
    from expertmesh.node.model.expert_index import streamed_prefixes
    from expertmesh.node.model.expert_trace import SAFETENSORS_DTYPES

    made = sanitize({**weights, **{n: mx.zeros(shape, SAFETENSORS_DTYPES[d]) for n, (d, shape) in standins.items()}})
    streamed = streamed_prefixes({b.path: b.kind for b in streaming_blocks(model)})
    return {k: v for k, v in made.items() if not k.startswith(streamed) and k not in standins}


def core_standins(index: ExpertIndex, core_bits: int) -> dict[str, tuple[str, tuple[int, ...]]] | None:
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
