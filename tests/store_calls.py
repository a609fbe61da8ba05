"""Asking an expert store for a layer's experts as the engine does, for tests about the store.

A block takes `layer_groups` a group at a time and places each group in RAM-tier slots on the MLX
thread (engine/blocks.py); these helpers do the same from a test's thread, and read back what the
slots hold or what the experts compute.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from expertmesh.node.engine.model_thread import model_thread


def take_layer(store, layer: int, experts, **kw) -> dict[int, dict[str, np.ndarray]]:
    """Every group of `store.layer_groups(layer, experts, **kw)`, placed and let go, as a block
    takes them; each expert's arrays (`projection.kind`) as the kernels read them: from its slot,
    or as decoded where the RAM tier does not keep it."""
    out: dict[int, dict[str, np.ndarray]] = {}
    for group in store.layer_groups(layer, experts, **kw):
        out.update(model_thread().call(_read_back, store.ram, group))
    return out


def _read_back(ram, group) -> dict[int, dict[str, np.ndarray]]:
    with group.placed() as placed:
        out = {
            e: {f"{p}.{kind}": np.array(a[0]) for p, arrays in weights.stack().items() for kind, a in arrays.items()}
            for e, weights in placed.loose.items()
        }
        stacks = ram.pool(group.layer).arrays or {}
        for e, s in placed.slots.items():
            out[e] = {f"{p}.{kind}": np.array(a[s]) for p, arrays in stacks.items() for kind, a in arrays.items()}
        return out


def compute_here(block, store, experts: list[int], rows: dict[int, mx.array]) -> dict[int, mx.array]:
    """`experts` of `block`'s layer computed on this node on `rows`, evaluated (not a pass of its own)."""
    out: dict[int, mx.array] = {}
    for group in store.layer_groups(block.layer, experts, routed=[]):
        out.update(model_thread().call(_compute, block, group, rows))
    return out


def _compute(block, group, rows: dict[int, mx.array]) -> dict[int, mx.array]:
    with group.placed() as placed:
        part = block.compute_rows(placed, {e: rows[e] for e in group.served})
        mx.eval(list(part.values()))
    return part
