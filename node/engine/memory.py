"""A full node's memory, from the machine: the core, the context, the RAM tier, MLX's buffer
cache, the fetch buffers, and wiring.

What a node may keep in memory is bounded by the machine, not by a fixed share: on a Mac by
Metal's recommended working set (`mx.device_info()["max_recommended_working_set_size"]`, what
the GPU can use without the system paging it), elsewhere by the machine's memory. The plan
counts everything a node keeps against it:

    core            at its bits (node/engine/core_quantization.py)
    context         the KV cache and linear-attention state at `--max-context` tokens
                    (node/engine/model_sizes.py measures them on mlx-lm's own cache classes)
    fetch buffers   the experts being fetched and decoded: two copies per fetch worker, and as
                    many arrived experts waiting beside the RAM tier for their group's turn
                    (store.layer_groups bounds them so)
    spare slots     the RAM tier's slots beyond its budget for experts in use that it does not
                    keep: one per fetch worker (store/tiers/ram.py)
    disk buffers    the disk tier's: the idle read buffers kept for reuse (store/buffers.py)
                    and the experts queued for its writer
    process         the node process itself before its core: Python, MLX, transformers, the
                    tokenizer (a measured constant, constants.PROCESS_BASELINE_BYTES)
    RAM budget      the RAM tier plus MLX's cache of freed buffers (one expert's worth): MLX keeps
                    freed buffers for reuse up to its cache limit, and every expert the tier let
                    go would otherwise stay resident outside any budget

A core that does not fit beside the context and the fetch buffers is **streamed**, not refused
(node/engine/streamed_core.py): it keeps its embeddings, head, norms and routers, pins as many
of its first layers as its budget holds, and reads the others from the SSD every token, one or
two layers ahead of the computation. Its default budget is all that is left but the smallest RAM
tier: a pinned byte of core saves reading it every token, a byte of RAM tier only when the
expert it holds is routed to again. Only a core whose smallest streamed form (what it keeps plus
two layers) does not fit is refused, with the changes that would make it fit.

The RAM budget's percentage (`--ram-budget 50%`, the default) is of what the core, the context
and the fetch buffers leave; a size is taken as it is (the core comes first: a size beyond what
it leaves makes the plan not fit, and the wiring below says so).

Wiring, as mlx-lm's `generate` does around a generation (`mlx_lm.generate.wired_limit`), keeps
macOS from compressing or paging what is wired between tokens. A node wires the core it keeps
plus the RAM tier (and the buffer cache) for its whole life, not per generation, since peers'
calls use its experts between generations; the size is bounded by the recommended working set,
as `mx.set_wired_limit` requires, and one line says so when it cannot all be wired. Without
Metal there is nothing to wire and one line says that too.

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
from expertmesh.node.store.buffers import POOL_IDLE_BUFFERS

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


CORE_READ_AHEAD_LAYERS = 2  # streamed layers read ahead of the one computing, where the budget allows
WORKING_SET_SHARE = 0.75  # Metal's recommended working set, of a Mac's memory, for a machine described by its size


def mac(memory_bytes: int) -> DeviceMemory:
    """A Mac of `memory_bytes` as the plan sees it: its recommended working set about three
    quarters of its memory (what Metal reports on Apple Silicon Macs of 64 GB and more)."""
    return DeviceMemory(memory_bytes, int(memory_bytes * WORKING_SET_SHARE))


@dataclass(frozen=True)
class CoreLayout:
    """A core as the plan sees it: its bytes at its bits, and what streaming it would keep and read."""

    core_bytes: int
    label: str = "bf16"  # its format: bf16, 8-bit, 4-bit, mixed_4_6
    resident_bytes: int = 0  # kept in memory when streamed: embeddings, head, norms, routers
    layer_bytes: tuple[int, ...] = ()  # each decoder layer's streamed bytes, in layer order (empty: cannot stream)

    @property
    def largest_layer_bytes(self) -> int:
        return max(self.layer_bytes, default=0)

    @property
    def smallest_streamed_bytes(self) -> int:
        """The least a streamed core holds: what it keeps, the layer computing and the one being read."""
        return self.resident_bytes + 2 * self.largest_layer_bytes


@dataclass(frozen=True)
class StreamSplit:
    """How a streamed core spends its budget: `pinned` first layers kept, `ahead` layers read ahead."""

    pinned: int
    ahead: int
    held_bytes: int  # at most: what it keeps, the pinned layers, and `ahead` + 1 layers in flight
    read_bytes_per_token: int  # the layers not pinned, read every forward pass


def stream_split(layout: CoreLayout, budget_bytes: int, ahead_max: int = CORE_READ_AHEAD_LAYERS) -> StreamSplit:
    """The streamed core within `budget_bytes`: one layer computing and `ahead` (1 to `ahead_max`)
    being read, the rest of the budget pinning the first layers. It holds at most
    max(budget, the smallest streamed core): within the budget plus one layer whenever the budget
    holds what the core keeps and one layer."""
    big = layout.largest_layer_bytes
    room = budget_bytes - layout.resident_bytes
    ahead = max(1, min(ahead_max, room // big - 1)) if big else 0
    left = room - (ahead + 1) * big
    pinned, used = 0, 0
    for n in layout.layer_bytes:
        if used + n > left:
            break
        pinned, used = pinned + 1, used + n
    if pinned == len(layout.layer_bytes):  # all pinned: nothing streamed, nothing read ahead
        return StreamSplit(pinned, 0, layout.resident_bytes + used, 0)
    held = layout.resident_bytes + used + (ahead + 1) * big
    return StreamSplit(pinned, ahead, held, sum(layout.layer_bytes[pinned:]))


@dataclass(frozen=True)
class MemoryPlan:
    """Where a full node's memory goes: all of it within `device.limit_bytes`."""

    device: DeviceMemory
    core_bytes: int
    ram_tier_bytes: int  # decoded experts kept by the RAM tier
    buffer_cache_bytes: int  # MLX's cache of freed buffers, inside the RAM budget
    in_flight_bytes: int  # experts being fetched and decoded, beside the budget
    context_bytes: int = 0  # the KV cache / linear-attention state at `max_context`
    max_context: int | None = None
    core_held_bytes: int | None = None  # a streamed core's budget; None: the whole core is held
    core_label: str = "bf16"
    split: StreamSplit | None = None  # how a streamed core spends its budget
    over_bytes: int = 0  # how far a RAM budget given as a size goes beyond what the core leaves
    prefix_cache_bytes: int = 0  # states of earlier prompts kept for reuse (engine/prefix_cache.py)
    spare_slot_bytes: int = 0  # the RAM tier's slots beyond its budget, for experts in use it does not keep
    disk_buffer_bytes: int = 0  # the disk tier's idle read buffers and queued writes
    process_bytes: int = 0  # the node process before its core (constants.PROCESS_BASELINE_BYTES)
    prompt_bytes: int = 0  # a prompt of `max_context` tokens at an expert layer, prefilled layer-major
    household_bytes: int = 0  # a household node's calls to peers in flight and checks of their copies

    @property
    def streamed(self) -> bool:
        return self.core_held_bytes is not None

    @property
    def fits(self) -> bool:
        """The core held whole, beside the context, the fetch buffers and a RAM budget given as a
        size (one given as a share is what is left, at least MIN_RAM_BUDGET_BYTES)."""
        return not self.streamed and not self.over_bytes

    @property
    def core_memory_bytes(self) -> int:
        """What the core takes in memory: all of it, or a streamed core's budget."""
        return self.core_held_bytes if self.core_held_bytes is not None else self.core_bytes

    @property
    def ram_budget_bytes(self) -> int:
        return self.ram_tier_bytes + self.buffer_cache_bytes

    @property
    def wired_bytes(self) -> int:
        """What should stay resident: the core it holds, the RAM tier and the buffer cache."""
        return self.core_memory_bytes + self.ram_budget_bytes

    @property
    def buffer_bytes(self) -> int:
        """What a node keeps beside the core, the context and the RAM budget: fetch buffers, the
        tier's spare slots, the disk tier's buffers, the household's buffers and the process itself."""
        return (
            self.in_flight_bytes
            + self.spare_slot_bytes
            + self.disk_buffer_bytes
            + self.household_bytes
            + self.process_bytes
        )

    @property
    def total_bytes(self) -> int:
        return (
            self.core_memory_bytes
            + self.context_bytes
            + self.prefix_cache_bytes
            + self.prompt_bytes
            + self.buffer_bytes
            + self.ram_budget_bytes
        )

    def parts(self) -> str:
        """The plan in one line's words: "core 4-bit 32.85 GB, context 32k 1.36 GB, RAM tier ..."."""
        core = f"core {self.core_label} {format_size(self.core_bytes)}"
        if self.split is not None:
            core += (
                f" streamed from the SSD within {format_size(self.core_memory_bytes)} "
                f"({self.split.pinned} layers kept, {format_size(self.split.read_bytes_per_token)} read a token)"
            )
        context = f"context {_tokens(self.max_context)} {format_size(self.context_bytes)}, " if self.max_context else ""
        if self.prefix_cache_bytes:
            context += f"prefix cache {format_size(self.prefix_cache_bytes)}, "
        if self.prompt_bytes:
            context += f"prompt's expert outputs {format_size(self.prompt_bytes)}, "
        return (
            f"{core}, {context}RAM tier {format_size(self.ram_tier_bytes)}, MLX cache "
            f"{format_size(self.buffer_cache_bytes)}, fetch buffers {format_size(self.in_flight_bytes)}, "
            f"spare slots {format_size(self.spare_slot_bytes)}, disk buffers {format_size(self.disk_buffer_bytes)}, "
            + (f"household {format_size(self.household_bytes)}, " if self.household_bytes else "")
            + f"process {format_size(self.process_bytes)}: "
            f"{format_size(self.total_bytes)} of {self.device.limit_name()} {format_size(self.device.limit_bytes)}"
        )

    def as_json(self) -> dict:
        return {
            "fits": self.fits,
            "streamed": self.streamed,
            "core_bytes": self.core_bytes,
            "core_format": self.core_label,
            "core_held_bytes": self.core_memory_bytes,
            "core_read_bytes_per_token": self.split.read_bytes_per_token if self.split else 0,
            "context_bytes": self.context_bytes,
            "prefix_cache_bytes": self.prefix_cache_bytes,
            "prompt_bytes": self.prompt_bytes,
            "max_context": self.max_context,
            "ram_tier_bytes": self.ram_tier_bytes,
            "buffer_cache_bytes": self.buffer_cache_bytes,
            "fetch_buffer_bytes": self.in_flight_bytes,
            "spare_slot_bytes": self.spare_slot_bytes,
            "disk_buffer_bytes": self.disk_buffer_bytes,
            "household_bytes": self.household_bytes,
            "process_bytes": self.process_bytes,
            "working_set_bytes": self.device.limit_bytes,
            "memory_bytes": self.device.memory_bytes,
        }


def _tokens(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def plan_memory(
    ram_budget: str,
    device: DeviceMemory,
    *,
    core_bytes: int,
    expert_bytes: int,
    fetch_workers: int,
    repo_id: str = "the model",
    core_bits: int = 16,
    layout: CoreLayout | None = None,
    context_bytes: int = 0,
    max_context: int | None = None,
    core_budget: str | None = None,
    prefix_cache_bytes: int = 0,
    prompt_bytes: int = 0,
    household_bytes: int = 0,
) -> MemoryPlan:
    """The core held whole or streamed, and the RAM tier and buffer cache for `ram_budget` (a
    size, or a share of what the core, the context and the fetch buffers leave).

    `prompt_bytes` is what a prompt of `max_context` tokens holds at an expert layer while it is
    prefilled layer-major (ModelSizes.prompt_bytes): like the context, it comes before the core.
    `household_bytes` is what a household node holds for its peers beside that (the composition
    root's `household_buffer_bytes`): a fixed part, as the fetch buffers are.

    The buffer cache gets one expert's worth (what an expert's decoding reuses), or half the
    budget when that is smaller; the tier gets the rest. The default budget is at least
    MIN_RAM_BUDGET_BYTES, so a nearly full machine still keeps a few experts. `layout` says how
    the core would stream (without it a core that does not fit is refused); `core_budget` (a size,
    or a share of the core) streams it within that budget even where it would fit.

    Raises:
        CoreTooLargeError: the core does not fit, not even streamed.
        ValueError: `ram_budget` or `core_budget` is neither a size nor a percentage.
    """
    layout = layout or CoreLayout(core_bytes, "bf16" if core_bits == 16 else f"{core_bits}-bit")
    limit = device.limit_bytes
    in_flight = 2 * fetch_workers * expert_bytes  # each worker's expert as bytes and as arrays
    spare = fetch_workers * expert_bytes  # the RAM tier's spare slots (one per fetch worker)
    disk_buffers = (POOL_IDLE_BUFFERS + constants.DISK_WRITE_BEHIND_EXPERTS) * expert_bytes
    process = constants.PROCESS_BASELINE_BYTES
    explicit_ram = None if ram_budget.strip().endswith("%") else parse_budget(ram_budget, 0)
    context_bytes += prefix_cache_bytes + prompt_bytes  # conversation state, kept and live, comes before the core
    fixed = in_flight + spare + disk_buffers + household_bytes + process  # whatever the model: before the core too
    room = limit - context_bytes - fixed  # what the core may take: it comes before the RAM tier
    held = None
    split = None
    if core_budget is not None:
        wanted = parse_budget(core_budget, layout.core_bytes)
        if wanted < layout.core_bytes:
            held = wanted
    if held is None and layout.core_bytes > room:
        held = room - constants.MIN_RAM_BUDGET_BYTES
    if held is not None:
        if not layout.layer_bytes:
            raise CoreTooLargeError(_too_large(layout, repo_id, device, limit, core_bits))
        held = max(held, layout.smallest_streamed_bytes)
        if held > room:
            raise CoreTooLargeError(_too_large(layout, repo_id, device, room, core_bits, streamed=True))
        split = stream_split(layout, held)
        if split.pinned == len(layout.layer_bytes):  # the budget holds it all after all
            held, split = None, None
    core_memory = layout.core_bytes if held is None else held
    left = max(0, limit - core_memory - context_bytes - fixed)
    budget = explicit_ram if explicit_ram is not None else parse_budget(ram_budget, left)
    if ram_budget == constants.DEFAULT_RAM_BUDGET:
        budget = max(constants.MIN_RAM_BUDGET_BYTES, budget)
    cache = min(expert_bytes, budget // 2)
    over = max(0, core_memory + context_bytes + fixed + budget - limit) if explicit_ram is not None else 0
    return MemoryPlan(
        device,
        layout.core_bytes,
        budget - cache,
        cache,
        in_flight,
        context_bytes - prefix_cache_bytes - prompt_bytes,
        max_context,
        held,
        layout.label,
        split,
        over,
        prefix_cache_bytes,
        spare,
        disk_buffers,
        process,
        prompt_bytes,
        household_bytes,
    )


def _too_large(
    layout: CoreLayout, repo_id: str, device: DeviceMemory, room: int, core_bits: int, streamed: bool = False
) -> str:
    hint = (
        f"pull it with fewer bits (`expertmesh pull {repo_id} --core-bits 4`, about a quarter of the size) "
        "or use a machine with more memory"
        if core_bits == 16
        else "use a machine with more memory"
    )
    what = (
        f"even streamed, the {layout.label} core of {repo_id} needs {format_size(layout.smallest_streamed_bytes)} "
        f"(its embeddings, head and routers and two layers)"
        if streamed
        else f"the {layout.label} core of {repo_id} takes {format_size(layout.core_bytes)}"
    )
    return (
        f"{what} and this machine can keep {format_size(max(room, 0))} of it in memory "
        f"({device.limit_name()} {format_size(device.limit_bytes)}): {hint}"
    )


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
