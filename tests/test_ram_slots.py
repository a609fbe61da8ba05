"""The RAM tier's slots (node/store/tiers/ram.py): an expert arrives into a slot of its layer's
stacks in place, the budget and one spare slot per fetch worker bound them, an expert in use keeps
its slot whatever the policy decides, and a layer whose experts are all kept maps ids to slots
on the device."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from expertmesh.node.model.codec import ExpertWeights, ProjectionWeights, QuantSpec
from expertmesh.node.store.tiers.ram import RamCache

LAYERS, EXPERTS = (1, 2), 6


def _expert(layer: int, e: int) -> ExpertWeights:
    """A tiny 4-bit expert whose every value says which expert it is."""
    quant = QuantSpec("affine", 4, 32)
    fill = layer * 100 + e

    def proj() -> ProjectionWeights:
        return ProjectionWeights(
            mx.full((8, 4), fill, dtype=mx.uint32),
            mx.full((8, 1), float(fill), dtype=mx.float32),
            mx.full((8, 1), -float(fill), dtype=mx.float32),
            quant=quant,
        )

    return ExpertWeights(layer, e, {"gate_proj": proj(), "up_proj": proj(), "down_proj": proj()})


EXPERT_BYTES = _expert(1, 0).nbytes


def _tier(kept: int, spare: int = 2, policy: str = "lru") -> RamCache:
    layout = _expert(1, 0).layout()
    return RamCache(kept * EXPERT_BYTES, {la: layout for la in LAYERS}, dict.fromkeys(LAYERS, EXPERTS), policy, spare)


def _held(ram: RamCache, key: tuple[int, int]) -> int:
    """Which expert the slot of `key` holds now (read from the stacks)."""
    slot = ram.acquire([key])[key]
    try:
        return int(np.array(ram.pool(key[0]).arrays["down_proj"]["weight"][slot, 0, 0]))
    finally:
        ram.release([key])


def test_an_arrived_expert_is_written_into_its_slot_in_place() -> None:
    ram = _tier(kept=5)
    for e in range(4):
        ram.place((1, e), _expert(1, e))
        ram.release([(1, e)])
    before = ram.stack_buffers()
    for e in range(4):
        assert _held(ram, (1, e)) == 100 + e
    ram.place((2, 0), _expert(2, 0))
    ram.release([(2, 0)])
    assert _held(ram, (2, 0)) == 200 and _held(ram, (1, 3)) == 103
    assert ram.stack_buffers() == before, "a slot write copied a whole stack instead of writing in place"
    assert ram.slot_writes == 5 and ram.nbytes == 5 * EXPERT_BYTES


def test_the_budget_and_the_spare_slots_bound_the_stacks() -> None:
    ram = _tier(kept=3, spare=2)
    assert ram.capacity == 5
    for e in range(EXPERTS):
        ram.place((1, e), _expert(1, e))
        ram.release([(1, e)])
    assert len(ram) == 3 and ram.evictions == EXPERTS - 3  # the policy keeps three
    assert ram.allocated_bytes == 5 * _expert(1, 0).layout().nbytes


def test_an_expert_in_use_keeps_its_slot_when_the_policy_lets_it_go() -> None:
    ram = _tier(kept=1, spare=2)
    in_use = [(1, 0), (1, 1), (1, 2)]  # the policy keeps one; the spare slots hold the others
    for key in in_use:
        assert ram.place(key, _expert(*key)) is not None
    assert all(key in ram for key in in_use)
    assert [_held(ram, key) for key in in_use] == [100, 101, 102]  # none overwritten while pinned
    assert ram.place((1, 3), _expert(1, 3)) is None  # every slot is in use: no slot, nothing overwritten
    ram.release(in_use)
    assert len(ram) == 1  # what the policy did not keep gave its slot back
    assert ram.place((1, 3), _expert(1, 3)) is not None


def _used(ram: RamCache, key: tuple[int, int], times: int) -> None:
    """`key` placed and used `times` times in all, released after each use."""
    ram.place(key, _expert(*key))
    ram.release([key])
    for _ in range(times - 1):
        ram.release(list(ram.acquire([key])))


def test_an_arrival_the_policy_does_not_keep_is_never_written_into_a_slot() -> None:
    """Its kernels read the arrays it was decoded into (engine/blocks.py): a slot write would copy
    an expert used once, on the MLX thread, only to let it go."""
    ram = _tier(kept=2, spare=2, policy="lfu")
    for e in (0, 1):
        _used(ram, (1, e), 3)  # used often: the policy keeps these over a newcomer
    before, writes = ram.stack_buffers(), ram.slot_writes
    assert ram.place((1, 2), _expert(1, 2)) is None
    assert ram.slot_writes == writes == 2 and (1, 2) not in ram and ram.evictions == 1
    assert ram.stack_buffers() == before and [_held(ram, (1, e)) for e in (0, 1)] == [100, 101]
    ram.release([(1, 2)])  # a caller's release of what it never got a slot for changes nothing
    assert len(ram) == 2 and ram.nbytes == 2 * EXPERT_BYTES


def test_every_slot_taken_the_least_recently_used_expert_not_in_use_gives_its_slot_up() -> None:
    ram = _tier(kept=2, spare=1, policy="lfu")
    _used(ram, (1, 0), 3)  # used often: kept over newcomers
    in_use = [(1, 1), (1, 2), (1, 3)]
    for key in in_use:  # each newcomer kept over the last, which stays in its slot while in use
        assert ram.place(key, _expert(*key)) is not None
    assert (1, 0) not in ram  # no slot was free: the one expert not in use gave its slot up
    assert [_held(ram, key) for key in in_use] == [101, 102, 103]
    ram.release(in_use)


def test_a_layer_with_every_expert_kept_maps_ids_to_slots_on_the_device() -> None:
    ram = _tier(kept=EXPERTS + 1)
    for e in range(EXPERTS - 1):
        ram.place((2, e), _expert(2, e))
        ram.release([(2, e)])
    assert not ram.resident(2) and ram.slot_map(2) is None  # one expert short: the layer syncs
    ram.place((2, EXPERTS - 1), _expert(2, EXPERTS - 1))
    ram.release([(2, EXPERTS - 1)])
    assert ram.resident(2) and not ram.resident(1)
    slot_map = ram.slot_map(2)
    stack = ram.pool(2).arrays["gate_proj"]["scales"]
    held = mx.take(stack, slot_map, axis=0)[:, 0, 0]  # expert e through the map, on the device
    assert np.array(held).tolist() == [200 + e for e in range(EXPERTS)]
    assert ram.slot_map(2) is slot_map  # made once while nothing changes


def test_stacks_larger_than_the_devices_largest_buffer_are_split_by_layers() -> None:
    layout = _expert(1, 0).layout()
    largest = max(
        n
        for _, arrays, _ in layout.projections
        for _, shape, dtype in arrays
        for n in [int(np.prod(shape)) * dtype.size]
    )
    budget = 2 * EXPERTS * EXPERT_BYTES  # every expert of both layers
    whole = RamCache(budget, {la: layout for la in LAYERS}, dict.fromkeys(LAYERS, EXPERTS), "lru", 0)
    split = RamCache(
        budget,
        {la: layout for la in LAYERS},
        dict.fromkeys(LAYERS, EXPERTS),
        "lru",
        0,
        max_stack_bytes=EXPERTS * largest,
    )
    assert whole.pool(1) is whole.pool(2) and whole.capacity == 2 * EXPERTS
    assert split.pool(1) is not split.pool(2) and split.capacity == EXPERTS  # each layer's share of the budget
    for layer in LAYERS:
        for e in range(EXPERTS):
            split.place((layer, e), _expert(layer, e))
            split.release([(layer, e)])
    assert split.resident(1) and split.resident(2) and _held(split, (2, 5)) == 205
    assert all(nbytes <= EXPERTS * largest for _, nbytes in split.stack_buffers().values())
