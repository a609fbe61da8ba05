"""The RAM tier: experts in stacked slot arrays within a byte budget, kept by a replacement policy
(store/policies.py).

Why slots: the kernels mlx-lm runs for a MoE layer (one `gather_qmm` per projection, or
`gather_mm` for float experts: mlx_lm/models/switch_layers.py) read the layer's experts from one
stacked array per projection array, indexed by expert. Here the stacks hold slots: a slot is one
expert's place in every array of its layout (node/model/codec.py's `SlotLayout`), and a layer runs
those same kernels with its experts' ids mapped to slots (engine/blocks.py). An expert the policy
keeps is written into its slot once, when it arrives, never re-stacked per token; the slots are
the tier, there is no second copy of a resident expert. An arrival the policy does not keep takes
no slot: its kernels read the arrays it was decoded into (`place` answers None), since a slot write
would copy, on the MLX thread, an expert that is used once and let go.

Writing a slot is `mx.slice_update` of each stack, on the MLX thread. MLX arrays are immutable,
so the update makes a new array; when nothing else references the old one, MLX donates its buffer
to the new one and copies only the slot (measured in docs/benchmarks.md, "Slot writes"). The
engine writes slots only after a layer's sync, when no lazy graph still reads a stack; a write
while one did would still compute the right thing, at the price of a copy of the whole stack.

Memory: the budget is a number of slots of one expert's size, kept by the policy; beside them
`spare_slots` (one per fetch worker) hold experts in use that the policy let go of since they were
placed, so the stacks stay within the budget plus one expert per fetch worker however many experts
a layer wants at once (the store's `hold_limit`). An expert in use is pinned: its slot is not
reused until it is released, even if the policy evicts it meanwhile. When every slot is resident
or pinned, the least recently used unpinned expert gives its slot up; when every slot is pinned,
an arrival takes none, as one the policy does not keep. Layers whose experts are
stored alike share one pool of slots (every model we know has one layout); a model with several
splits the budget between them by their numbers of layers, and so does a pool whose stacks would
be larger than the device's largest buffer (Metal's `max_buffer_length`), split into runs of
consecutive layers. A pool's stacks are made when its first expert arrives, at its full capacity
(never grown: growing would copy them).

Thread-safety: the bookkeeping (which expert is in which slot, pins, the policy) is under one lock
and may be asked from any thread; the arrays are made and written on the MLX thread only.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import cast

import mlx.core as mx
import numpy as np

from expertmesh.node.model.codec import ExpertCodec, ExpertWeights, SlotLayout
from expertmesh.node.model.expert_index import ExpertIndex, ExpertLocation
from expertmesh.node.store.policies import DEFAULT_POLICY, Policy, make_policy
from expertmesh.node.store.stats import ExpertKey


@dataclass
class SlotPool:
    """The stacked arrays of one layout: slot s of every array is one expert."""

    layout: SlotLayout
    capacity: int
    layers: frozenset[int]
    policy: Policy
    keeps_all: bool = False  # the policy's budget holds every expert of the layers: it never evicts
    free: list[int] = field(default_factory=list)
    # projection -> array kind -> (capacity, *shape); made at the first write (on the MLX thread)
    arrays: dict[str, dict[str, mx.array]] | None = None
    recent: OrderedDict = field(default_factory=OrderedDict)  # resident keys, least recently used first

    def write(self, slot: int, weights: ExpertWeights) -> None:
        """Put `weights` into `slot` of every stack (lazy; MLX thread only)."""
        if self.arrays is None:
            self.arrays = {
                name: {kind: mx.zeros((self.capacity, *shape), dtype) for kind, shape, dtype in arrays}
                for name, arrays, _ in self.layout.projections
            }
        at = mx.array([slot])
        one = weights.stack()
        for name, stacks in self.arrays.items():
            for kind, stack in stacks.items():
                stacks[kind] = mx.slice_update(stack, one[name][kind], at, (0,))

    @property
    def allocated_bytes(self) -> int:
        return self.capacity * self.layout.nbytes if self.arrays is not None else 0


class RamCache:
    """Experts of one model in slots, by layer (see the module docstring).

    Args:
        budget_bytes: what the policy may keep.
        layouts: each MoE layer's slot layout (`ExpertCodec.layout`).
        experts: each MoE layer's number of routed experts.
        policy: the replacement policy's name (store/policies.py).
        spare_slots: slots beyond the budget for experts in use that the policy does not keep.
        max_stack_bytes: the largest array the device makes (Metal's `max_buffer_length`); a pool
            whose stacks would be larger is split into pools of fewer layers. None: no limit.
    """

    def __init__(
        self,
        budget_bytes: int,
        layouts: dict[int, SlotLayout],
        experts: dict[int, int],
        policy: str = DEFAULT_POLICY,
        spare_slots: int = 0,
        max_stack_bytes: int | None = None,
    ):
        self.budget_bytes = budget_bytes
        self.policy_name = policy
        make_policy(policy, 0)  # an unknown name fails here, not at the first expert
        self.experts = dict(experts)
        self._lock = threading.Lock()
        self._pools: dict[int, SlotPool] = {}  # layer -> its pool
        by_layout: dict[SlotLayout, list[int]] = {}
        for layer, layout in sorted(layouts.items()):
            by_layout.setdefault(layout, []).append(layer)
        for layout, layers in by_layout.items():
            for part in _split(layers, layout, budget_bytes, len(layouts), spare_slots, max_stack_bytes):
                self._add_pool(layout, part, budget_bytes * len(part) // max(1, len(layouts)), spare_slots)
        self._slot: dict[ExpertKey, int] = {}  # every expert that has a slot: resident or pinned
        self._pins: dict[ExpertKey, int] = {}
        self._resident: dict[int, int] = dict.fromkeys(self.experts, 0)  # layer -> experts the policy keeps
        self._changed: dict[int, int] = dict.fromkeys(self.experts, 0)  # layer -> a count of its changes
        self._maps: dict[int, tuple[int, mx.array]] = {}  # layer -> (its change count, expert -> slot)
        self.nbytes = 0  # of the experts the policy keeps
        self.evictions = 0
        self.slot_writes = 0  # experts written into slots (each copies one expert's bytes)

    def _add_pool(self, layout: SlotLayout, layers: list[int], budget_bytes: int, spare_slots: int) -> None:
        kept = budget_bytes // max(1, layout.nbytes)
        total = sum(self.experts.get(la, 0) for la in layers)
        capacity = min(kept + max(0, spare_slots), total)
        pool = SlotPool(layout, capacity, frozenset(layers), make_policy(self.policy_name, kept), kept >= total)
        pool.free = list(range(capacity))[::-1]
        for layer in layers:
            self._pools[layer] = pool

    @classmethod
    def for_model(
        cls,
        budget_bytes: int,
        index: ExpertIndex,
        codec: ExpertCodec,
        policy: str = DEFAULT_POLICY,
        spare_slots: int = 0,
        max_stack_bytes: int | None = None,
    ) -> RamCache:
        """The tier for `index`'s model: each MoE layer's layout from `codec`, its size from the index."""
        first: dict[int, ExpertLocation] = {}
        experts: dict[int, int] = {}
        for (layer, _), loc in index.experts.items():
            first.setdefault(layer, loc)
            experts[layer] = experts.get(layer, 0) + 1
        layouts = {layer: codec.layout(loc) for layer, loc in first.items()}
        return cls(budget_bytes, layouts, experts, policy, spare_slots, max_stack_bytes)

    # -- what is held (any thread) ------------------------------------------------------------

    def slots(self, expert_bytes: int) -> int:
        """How many experts of about `expert_bytes` the budget holds."""
        return self.budget_bytes // max(1, expert_bytes)

    @property
    def capacity(self) -> int:
        """The fewest slots of any pool: how many experts of one layer can be in slots at once."""
        return min((p.capacity for p in self._pools.values()), default=0)

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the stacks made so far (their full capacity, whatever they hold)."""
        return sum(p.allocated_bytes for p in {id(p): p for p in self._pools.values()}.values())

    def keys(self) -> list[ExpertKey]:
        with self._lock:
            return list(self._slot)

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, key: object) -> bool:
        return key in self._slot

    def resident(self, layer: int) -> bool:
        """Whether every expert of `layer` is kept in a slot (the layer can run without a sync)."""
        n = self.experts.get(layer, 0)
        return n > 0 and self._resident.get(layer, 0) == n

    def pool(self, layer: int) -> SlotPool:
        return self._pools[layer]

    # -- using experts --------------------------------------------------------------------------

    def acquire(self, keys: list[ExpertKey]) -> dict[ExpertKey, int]:
        """Pin each of `keys` that has a slot (a use: the policy hears of it); their slots."""
        out = {}
        with self._lock:
            for key in keys:
                slot = self._slot.get(key)
                if slot is None:
                    continue
                self._pins[key] = self._pins.get(key, 0) + 1
                pool = self._pools[key[0]]
                if key in pool.recent:
                    pool.policy.access(key)  # a hit: nothing is evicted
                    pool.recent.move_to_end(key)
                out[key] = slot
        return out

    def touch(self, keys: list[ExpertKey]) -> None:
        """Uses of resident experts that ran without pins (engine/blocks.py's resident layers).
        A pool that keeps every expert of its layers evicts nothing: its policy need not hear."""
        if keys and self._pools[keys[0][0]].keeps_all:
            return
        with self._lock:
            for key in keys:
                pool = self._pools[key[0]]
                if key in pool.recent:
                    pool.policy.access(key)
                    pool.recent.move_to_end(key)

    def place(self, key: ExpertKey, weights: ExpertWeights) -> int | None:
        """Write an arrived expert that the policy keeps into a slot and pin it; its slot (MLX
        thread only). None: not kept, or every slot pinned; the caller computes it from `weights`
        (a slot write would copy an expert that is used once and let go)."""
        with self._lock:
            slot = self._slot.get(key)
            pool = self._pools[key[0]]
            if slot is not None:  # placed meanwhile (by another group, or a peer's call)
                self._pins[key] = self._pins.get(key, 0) + 1
                return slot
            if not pool.free and all(k in self._pins for k in pool.recent):
                return None  # every slot in use: the policy is not even asked
            _, evicted = pool.policy.access(key)
            for old in cast(list[ExpertKey], evicted):  # the policy holds only the keys this tier gave it
                self.evictions += 1
                if old != key:
                    self._let_go(pool, old)
            if key in evicted:
                return None
            if not pool.free:
                self._free_one(pool)
            slot = pool.free.pop()
            self._slot[key] = slot
            self._pins[key] = 1
            pool.recent[key] = None
            self._keep(key, +1)
            self.slot_writes += 1
        pool.write(slot, weights)
        return slot

    def release(self, keys: list[ExpertKey]) -> None:
        """Unpin; an expert the policy does not keep gives its slot back."""
        with self._lock:
            for key in keys:
                n = self._pins.get(key, 0) - 1
                if n > 0:
                    self._pins[key] = n
                    continue
                self._pins.pop(key, None)
                pool = self._pools[key[0]]
                if key not in pool.recent and key in self._slot:
                    pool.free.append(self._slot.pop(key))

    def discard(self, keys: list[ExpertKey]) -> None:
        """Keep none of `keys` from now on: their records were forgotten as wrong
        (store/tier_chain.py). A slot in use stays its user's until released, then goes free."""
        with self._lock:
            for key in keys:
                pool = self._pools.get(key[0])
                if pool is None or key not in pool.recent:
                    continue
                pool.policy.discard(key)
                self.evictions += 1
                self._let_go(pool, key)

    def slot_map(self, layer: int) -> mx.array | None:
        """Expert id -> slot of `layer` as an MLX array, if every expert of it is resident (MLX thread)."""
        if not self.resident(layer):
            return None
        with self._lock:
            version = self._changed[layer]
            made = self._maps.get(layer)
            if made is not None and made[0] == version:
                return made[1]
            slots = [self._slot[(layer, e)] for e in range(self.experts[layer])]
        slot_map = mx.array(slots, dtype=mx.uint32)  # as mlx-lm's router gives its indices
        self._maps[layer] = (version, slot_map)
        return slot_map

    def stack_buffers(self) -> dict[tuple[int, str, str], tuple[int, int]]:
        """Where each stack's buffer is, and its bytes, by (pool, projection, kind): a write that
        copied a stack instead of writing its slot in place moves it (tests and `bench --compute`
        look). Reading evaluates the stacks (MLX thread)."""
        out = {}
        for n, pool in enumerate({id(p): p for p in self._pools.values()}.values()):
            for name, stacks in (pool.arrays or {}).items():
                for kind, stack in stacks.items():
                    view = memoryview(stack)  # type: ignore[arg-type]  # mlx's stubs omit the buffer protocol mx.array has
                    try:
                        out[(n, name, kind)] = (np.asarray(view).ctypes.data, stack.nbytes)
                    finally:
                        view.release()
        return out

    # -- under the lock -----------------------------------------------------------------------

    def _keep(self, key: ExpertKey, delta: int) -> None:
        self._resident[key[0]] = self._resident.get(key[0], 0) + delta
        self._changed[key[0]] = self._changed.get(key[0], 0) + 1
        self.nbytes += delta * self._pools[key[0]].layout.nbytes

    def _let_go(self, pool: SlotPool, key: ExpertKey) -> None:
        """The policy no longer keeps `key`: its slot is free unless it is in use."""
        if key in pool.recent:
            del pool.recent[key]
            self._keep(key, -1)
        if key not in self._pins and key in self._slot:
            pool.free.append(self._slot.pop(key))

    def _free_one(self, pool: SlotPool) -> None:
        """Every slot is taken: the least recently used expert not in use gives its slot up."""
        for key in pool.recent:
            if key not in self._pins:
                pool.policy.discard(key)
                self.evictions += 1
                self._let_go(pool, key)
                return


def _split(
    layers: list[int],
    layout: SlotLayout,
    budget_bytes: int,
    all_layers: int,
    spare_slots: int,
    max_stack_bytes: int | None,
) -> list[list[int]]:
    """`layers` (of one layout) in as few runs of consecutive layers as keep each pool's largest
    stack within `max_stack_bytes`."""
    if max_stack_bytes is None:
        return [layers]
    largest = max(
        (int(np.prod(shape)) * dtype.size for _, arrays, _ in layout.projections for _, shape, dtype in arrays),
        default=1,
    )
    for parts in range(1, len(layers) + 1):
        size = -(-len(layers) // parts)
        kept = budget_bytes * size // max(1, all_layers) // max(1, layout.nbytes)
        if (kept + spare_slots) * largest <= max_stack_bytes or size == 1:
            return [layers[i : i + size] for i in range(0, len(layers), size)]
    return [layers]
