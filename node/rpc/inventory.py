"""Inventory bitmaps (proto LayerBitmap): which experts of each MoE layer a node's disk holds.

Both ends live here so the format is defined once: bit `e % 8` of byte `e // 8` is expert `e`.
A node answers GetInventory with one bitmap per layer of its index; a peer's answer is read only
as far as it fits the model this node has, because it is hostile input: a bitmap for a layer the
model lacks, or whose size is not the layer's, would otherwise become millions of keys.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Container, Mapping
from typing import TYPE_CHECKING

from expertmesh.v1 import node_pb2

if TYPE_CHECKING:
    from expertmesh.node.model.expert_index import ExpertIndex

logger = logging.getLogger(__name__)


def layer_sizes(index: ExpertIndex) -> dict[int, int]:
    """Experts per MoE layer, in one pass over the index (its experts are numbered 0..E-1 per
    layer, see expert_index._check_consistent): count it once and keep it, it never changes."""
    return dict(sorted(Counter(layer for layer, _ in index.experts).items()))


def bitmap_bytes(num_experts: int) -> int:
    """The length of a layer's bitmap: one bit per expert, rounded up to whole bytes."""
    return (num_experts + 7) // 8


def encode_inventory(sizes: Mapping[int, int], held: Container[tuple[int, int]]) -> list[node_pb2.LayerBitmap]:
    """One bitmap per layer of `sizes` (from `layer_sizes`), marking the keys in `held`."""
    layers = []
    for layer, n in sizes.items():
        bits = bytearray(bitmap_bytes(n))
        for e in range(n):
            if (layer, e) in held:
                bits[e >> 3] |= 1 << (e & 7)
        layers.append(node_pb2.LayerBitmap(layer=layer, num_experts=n, bits=bytes(bits)))
    return layers


def inventory_keys(
    inv: node_pb2.InventoryResponse,
    sizes: Mapping[int, int],
    source: str = "a peer",
    model: node_pb2.ModelKey | None = None,
) -> set[tuple[int, int]]:
    """The (layer, expert) keys an InventoryResponse marks as held, read against this node's model.

    Given the `model` asked for, an answer for another model (or revision) holds nothing: a node
    refuses an inventory of a model it does not serve (NOT_FOUND), so such an answer is a lie, and
    its bitmaps, however well they fit, name experts of something else. A bitmap is kept only if
    its layer is one of `sizes` (from `layer_sizes`), its `num_experts` is that layer's count and
    its `bits` are exactly `bitmap_bytes` long, and only the first for a layer; the rest are
    dropped with one warning naming `source`. So the keys are at most the model's experts, and the
    work is linear in them: `bits` is read from the message once per bitmap (each access to a
    protobuf bytes field copies it).
    """
    if model is not None and inv.model != model:
        logger.warning(
            "%s answered the inventory of %s@%s for another model (%r@%r): taken as holding nothing",
            source,
            model.repo_id,
            model.commit[:12],
            inv.model.repo_id[:100],
            inv.model.commit[:40],
        )
        return set()
    held: set[tuple[int, int]] = set()
    seen: set[int] = set()
    dropped, reasons = 0, list[str]()
    for lb in inv.layers:
        layer, n, bits = lb.layer, lb.num_experts, lb.bits
        problem = _misfit(layer, n, len(bits), sizes, seen)
        if problem:
            dropped += 1
            if len(reasons) < 3:
                reasons.append(problem)
            continue
        seen.add(layer)
        _expand(layer, n, bits, held.add)
    if dropped:
        more = " ..." if dropped > len(reasons) else ""
        logger.warning(
            "%s sent %d inventory bitmap(s) that do not fit the model, dropped: %s%s",
            source,
            dropped,
            "; ".join(reasons),
            more,
        )
    return held


def _misfit(layer: int, n: int, nbytes: int, sizes: Mapping[int, int], seen: set[int]) -> str:
    """Why a bitmap does not fit the model ('' when it does)."""
    expected = sizes.get(layer)
    if expected is None:
        return f"layer {layer} is not an MoE layer of the model"
    if layer in seen:
        return f"layer {layer} twice"
    if n != expected:
        return f"layer {layer} with {n} experts, not {expected}"
    if nbytes != bitmap_bytes(n):
        return f"layer {layer} with {nbytes} bytes of bits, not {bitmap_bytes(n)}"
    return ""


def _expand(layer: int, n: int, bits: bytes, add: Callable[[tuple[int, int]], None]) -> None:
    """Add every set bit's key below `n` (a set padding bit of the last byte names no expert)."""
    for i, byte in enumerate(bits):
        if not byte:
            continue
        base = i << 3
        for b in range(8):
            if byte >> b & 1 and base + b < n:
                add((layer, base + b))
