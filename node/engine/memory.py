"""A full node's memory, from the machine: the RAM tier's budget, MLX's buffer cache, wiring.

What a node may keep in memory is bounded by the machine, not by a fixed share: on a Mac by
Metal's recommended working set (`mx.device_info()["max_recommended_working_set_size"]`, what
the GPU can use without the system paging it), elsewhere by the machine's memory. The core
comes first; a core larger than that bound is refused before it is loaded, with the 8-bit core
suggested. The rest, less the experts being decoded by the fetch workers, is what the RAM
budget's percentage is of (`--ram-budget 50%`, the default), and the budget — whether a share or
a size — holds both the RAM tier and MLX's cache of freed buffers: MLX keeps freed buffers for
reuse up to its cache limit, and every expert the tier let go would otherwise stay resident
outside any budget.

Wiring, as mlx-lm's `generate` does around a generation (`mlx_lm.generate.wired_limit`), keeps
macOS from compressing or paging what is wired between tokens. A node wires the core plus the
RAM tier (and the buffer cache) for its whole life, not per generation, since peers' calls use
its experts between generations; the size is bounded by the recommended working set, as
`mx.set_wired_limit` requires, and one line says so when it cannot all be wired. Without Metal
there is nothing to wire and one line says that too.

Every MLX call here runs on the MLX thread (node/engine/model_thread.py), like all MLX work.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from expertmesh.node import constants
from expertmesh.node.errors import ExpertmeshError
from expertmesh.node.sizes import format_size, parse_budget

logger = logging.getLogger(__name__)

FALLBACK_MEMORY_BYTES = 16 * 1024**3  # when the system will not say


class CoreTooLargeError(ExpertmeshError):
    """The model's core alone does not fit in what this machine can keep in memory."""


@dataclass(frozen=True)
class DeviceMemory:
    """What the machine offers: its memory, and Metal's recommended working set (None without Metal)."""

    memory_bytes: int
    working_set_bytes: int | None = None
    max_buffer_bytes: int | None = None  # the largest single array (Metal's max_buffer_length); None: no limit

    @property
    def limit_bytes(self) -> int:
        """The most a node may keep in memory: the working set on Metal, else the memory."""
        return self.working_set_bytes if self.working_set_bytes is not None else self.memory_bytes

    def limit_name(self) -> str:
        return "Metal's recommended working set" if self.working_set_bytes is not None else "the machine's memory"


def device_memory() -> DeviceMemory:
    """This machine's memory as MLX reports it (its device info), the system's otherwise."""
    info = _device_info()
    working_set = info.get("max_recommended_working_set_size")
    memory = info.get("memory_size") or _physical_memory()
    largest = info.get("max_buffer_length")
    return DeviceMemory(int(memory), int(working_set) if working_set else None, int(largest) if largest else None)


def _device_info() -> dict:
    import mlx.core as mx

    device_info = getattr(mx, "device_info", None) or mx.metal.device_info
    try:
        return dict(device_info())
    except RuntimeError:  # no such device
        return {}


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return FALLBACK_MEMORY_BYTES


@dataclass(frozen=True)
class MemoryPlan:
    """Where a full node's memory goes: all of it within `device.limit_bytes`."""

    device: DeviceMemory
    core_bytes: int
    ram_tier_bytes: int  # decoded experts kept by the RAM tier
    buffer_cache_bytes: int  # MLX's cache of freed buffers, inside the RAM budget
    in_flight_bytes: int  # experts being fetched and decoded, beside the budget

    @property
    def ram_budget_bytes(self) -> int:
        return self.ram_tier_bytes + self.buffer_cache_bytes

    @property
    def wired_bytes(self) -> int:
        """What should stay resident: the core, the RAM tier and the buffer cache."""
        return self.core_bytes + self.ram_budget_bytes


def plan_memory(
    ram_budget: str,
    device: DeviceMemory,
    *,
    core_bytes: int,
    expert_bytes: int,
    fetch_workers: int,
    repo_id: str = "the model",
    core_bits: int = 16,
) -> MemoryPlan:
    """The RAM tier and buffer cache for `ram_budget` (a size, or a share of what the core leaves).

    The buffer cache gets one expert's worth (what an expert's decoding reuses), or half the
    budget when that is smaller; the tier gets the rest. The default budget is at least
    MIN_RAM_BUDGET_BYTES, so a nearly full machine still keeps a few experts.

    Raises:
        CoreTooLargeError: the core alone is larger than `device.limit_bytes`.
        ValueError: `ram_budget` is neither a size nor a percentage.
    """
    limit = device.limit_bytes
    if core_bytes > limit:
        hint = (
            f"pull it with an 8-bit core (`expertmesh pull {repo_id} --core-bits 8`, about half the size) "
            "or use a machine with more memory"
            if core_bits == 16
            else "use a machine with more memory"
        )
        raise CoreTooLargeError(
            f"the {core_bits}-bit core of {repo_id} takes {format_size(core_bytes)} and this machine can keep "
            f"{format_size(limit)} in memory ({device.limit_name()}): {hint}"
        )
    in_flight = 2 * fetch_workers * expert_bytes  # each worker's expert as bytes and as arrays
    left = max(0, limit - core_bytes - in_flight)
    budget = parse_budget(ram_budget, left)
    if ram_budget == constants.DEFAULT_RAM_BUDGET:
        budget = max(constants.MIN_RAM_BUDGET_BYTES, budget)
    cache = min(expert_bytes, budget // 2)
    return MemoryPlan(device, core_bytes, budget - cache, cache, in_flight)


def limit_buffer_cache(plan: MemoryPlan) -> int:
    """Cap MLX's cache of freed buffers at the plan's share (returned, in bytes)."""
    import mlx.core as mx

    mx.set_cache_limit(plan.buffer_cache_bytes)
    return plan.buffer_cache_bytes


def wire(plan: MemoryPlan) -> Callable[[], None] | None:
    """Wire what the plan keeps resident, bounded by Metal's recommended working set; returns
    what restores the previous limit, or None when nothing was wired (no Metal: said in one line)."""
    import mlx.core as mx

    working_set = plan.device.working_set_bytes
    if working_set is None:
        logger.info("memory is not wired: no Metal device (CPU only), so nothing can be pinned")
        return None
    size = min(plan.wired_bytes, working_set)
    if size < plan.wired_bytes:
        logger.warning(
            "wiring %s of the %s that the core and the RAM tier take: Metal's recommended working set is %s, "
            "so the rest may be paged out (a smaller --ram-budget keeps it all wired)",
            format_size(size),
            format_size(plan.wired_bytes),
            format_size(working_set),
        )
    mx.synchronize()  # as mlx-lm's wired_limit: never change the limit under an evaluation
    previous = mx.set_wired_limit(size)

    def restore() -> None:
        mx.synchronize()
        mx.set_wired_limit(previous)

    return restore
