"""A full node's memory from the machine (node/engine/memory.py): the RAM budget's default from
Metal's recommended working set (or the machine's memory), MLX's buffer cache inside the budget,
the context at --max-context counted, the core plus the RAM tier wired, a core that does not fit
streamed within what is left, and one that does not fit even streamed refused before it loads.

Metal is absent here, so the machine is described to MLX's own functions by monkeypatching
(`mx.device_info`), and the calls a Mac would get (`mx.set_wired_limit`, `mx.set_cache_limit`)
are recorded with their sizes and threads."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import mlx.core as mx
import pytest
from repos import tiny_id

from expertmesh.assembly import build_node
from expertmesh.node import constants
from expertmesh.node.config import HouseholdConfig, NodeConfig, StoreConfig
from expertmesh.node.engine import streamed_model
from expertmesh.node.engine.memory import CoreLayout, CoreTooLargeError, DeviceMemory, plan_memory
from expertmesh.node.engine.model_sizes import ModelSizes
from expertmesh.node.engine.model_thread import model_thread
from expertmesh.node.engine.streamed_core import file_layout
from expertmesh.node.household.planned_memory import household_buffer_bytes
from expertmesh.node.hub import local_models
from expertmesh.node.model.expert_index import INDEX_FILENAME, ExpertIndex
from expertmesh.node.sizes import format_size, parse_budget

GiB, MiB = 1024**3, 1024**2
ARCH = "kimi_k3"
REPO_ID = tiny_id(ARCH)
PREVIOUS_WIRED = 7  # what set_wired_limit reports as the limit before (restored at close)


class FakeMetal:
    """A Mac as MLX describes it, and the limits asked of it: (thread name, bytes) per call."""

    def __init__(self, memory: int, working_set: int):
        self.info = {"memory_size": memory, "max_recommended_working_set_size": working_set}
        self.wired: list[tuple[str, int]] = []
        self.cache: list[tuple[str, int]] = []

    def set_wired_limit(self, n: int) -> int:
        self.wired.append((threading.current_thread().name, n))
        return PREVIOUS_WIRED

    def set_cache_limit(self, n: int) -> int:
        self.cache.append((threading.current_thread().name, n))
        return 0


@pytest.fixture
def limits(monkeypatch: pytest.MonkeyPatch):
    """`limits(memory, working_set)`: MLX on a Mac of that size, its limit calls recorded."""

    def make(memory: int, working_set: int | None) -> FakeMetal:
        fake = FakeMetal(memory, working_set or 0)
        if working_set is not None:
            monkeypatch.setattr(mx, "device_info", lambda: dict(fake.info))
        monkeypatch.setattr(mx, "set_wired_limit", fake.set_wired_limit)
        monkeypatch.setattr(mx, "set_cache_limit", fake.set_cache_limit)
        return fake

    return make


def _expected(home: Path, ram_budget: str, device: DeviceMemory):
    """The plan from the model's own sizes: what the node must have asked for."""
    path = local_models.find_pulled(home, REPO_ID, None)
    index = ExpertIndex.load(path / INDEX_FILENAME)
    sizes = ModelSizes(json.loads((path / "config.json").read_text()))
    context = sizes.context_bytes(constants.DEFAULT_MAX_CONTEXT)
    assert context > 0
    return plan_memory(
        ram_budget,
        device,
        core_bytes=local_models.read_marker(path)["core_bytes"],
        expert_bytes=max(loc.nbytes for loc in index.experts.values()),
        fetch_workers=constants.EXPERT_FETCH_CONCURRENCY,
        context_bytes=context,
        max_context=constants.DEFAULT_MAX_CONTEXT,
        layout=file_layout(path, "bf16"),
        prefix_cache_bytes=parse_budget(constants.DEFAULT_PREFIX_CACHE, 0),  # the node's default, planned
        prompt_bytes=sizes.prompt_bytes(constants.DEFAULT_MAX_CONTEXT),
    )


def _node(home: Path, ram_budget: str = constants.DEFAULT_RAM_BUDGET):
    return build_node(NodeConfig(REPO_ID, home=home, store=StoreConfig(ram_budget=ram_budget, fill=False)))


# -- the plan alone ---------------------------------------------------------------------------


def test_the_default_budget_is_a_share_of_what_the_core_leaves_of_the_working_set() -> None:
    mac = DeviceMemory(memory_bytes=64 * GiB, working_set_bytes=48 * GiB)
    plan = plan_memory("50%", mac, core_bytes=20 * GiB, expert_bytes=16 * MiB, fetch_workers=8)
    in_flight = 2 * 8 * 16 * MiB  # each fetch worker's expert as bytes and as arrays
    assert plan.in_flight_bytes == in_flight
    assert plan.spare_slot_bytes == 8 * 16 * MiB  # the RAM tier's slots beyond its budget, one per worker
    # the disk tier's idle read buffers (one per fetch worker by default) and its queued writes
    assert plan.disk_buffer_bytes == (constants.EXPERT_FETCH_CONCURRENCY + 2) * 16 * MiB
    assert plan.process_bytes == constants.PROCESS_BASELINE_BYTES
    buffers = in_flight + plan.spare_slot_bytes + plan.disk_buffer_bytes + plan.process_bytes
    assert plan.buffer_bytes == buffers
    assert plan.ram_budget_bytes == (48 * GiB - 20 * GiB - buffers) // 2
    assert plan.buffer_cache_bytes == 16 * MiB  # one expert's buffers, counted inside the budget
    assert plan.ram_tier_bytes == plan.ram_budget_bytes - 16 * MiB
    assert plan.wired_bytes == 20 * GiB + plan.ram_budget_bytes <= mac.working_set_bytes
    cpu = DeviceMemory(memory_bytes=64 * GiB)  # no Metal: the machine's memory bounds it
    assert (
        plan_memory("50%", cpu, core_bytes=20 * GiB, expert_bytes=16 * MiB, fetch_workers=8).ram_budget_bytes
        == (64 * GiB - 20 * GiB - buffers) // 2
    )


def test_a_household_nodes_buffers_for_its_peers_come_before_the_ram_tier() -> None:
    """Calls to peers in flight and checks of their copies are held beside everything else, so they
    come out of what a share of a budget is taken from, and the plan says so."""
    mac = DeviceMemory(memory_bytes=64 * GiB, working_set_bytes=48 * GiB)
    lone = plan_memory("50%", mac, core_bytes=20 * GiB, expert_bytes=16 * MiB, fetch_workers=8)
    expert = 17_547_264
    household = household_buffer_bytes(HouseholdConfig(secret="s"), expert)
    # three peers planned: four calls of 3 MiB each way, and two experts checked, each; the audit's two
    assert household == 3 * (4 * 2 * 3 * MiB + 2 * expert) + 2 * expert
    assert household_buffer_bytes(HouseholdConfig(secret="s", peers=[f"p{i}:1" for i in range(5)]), expert) > household
    member = plan_memory(
        "50%", mac, core_bytes=20 * GiB, expert_bytes=16 * MiB, fetch_workers=8, household_bytes=household
    )
    assert member.household_bytes == household and member.buffer_bytes == lone.buffer_bytes + household
    assert member.ram_budget_bytes == (48 * GiB - 20 * GiB - member.buffer_bytes) // 2
    assert f"household {format_size(household)}" in member.parts() and "household" not in lone.parts()
    assert member.as_json()["household_bytes"] == household


@pytest.mark.parametrize(
    ("budget", "cache", "tier"),
    [("1GiB", 16 * MiB, GiB - 16 * MiB), ("16MiB", 8 * MiB, 8 * MiB), ("1", 0, 1), ("0", 0, 0)],
)
def test_a_budget_holds_the_buffer_cache_and_the_tier(budget: str, cache: int, tier: int) -> None:
    mac = DeviceMemory(64 * GiB, 48 * GiB)
    plan = plan_memory(budget, mac, core_bytes=GiB, expert_bytes=16 * MiB, fetch_workers=8)
    assert (plan.buffer_cache_bytes, plan.ram_tier_bytes) == (cache, tier)


def test_a_core_that_cannot_stream_and_does_not_fit_is_refused_with_fewer_bits_suggested() -> None:
    mac = DeviceMemory(128 * GiB, 96 * GiB)
    with pytest.raises(CoreTooLargeError) as e:
        plan_memory("50%", mac, core_bytes=114 * GiB, expert_bytes=MiB, fetch_workers=8, repo_id="moonshotai/K3")
    message = str(e.value)
    assert "Metal's recommended working set" in message and "122.41 GB" in message and "103.08 GB" in message
    assert "expertmesh pull moonshotai/K3 --core-bits 4" in message and "\n" not in message
    with pytest.raises(CoreTooLargeError) as e:
        plan_memory("50%", mac, core_bytes=100 * GiB, expert_bytes=MiB, fetch_workers=8, core_bits=8)
    assert "--core-bits" not in str(e.value) and "more memory" in str(e.value)


def test_a_core_that_does_not_fit_is_streamed_within_what_the_context_and_buffers_leave() -> None:
    mac = DeviceMemory(64 * GiB, 48 * GiB)
    layers = (2 * GiB,) * 40
    layout = CoreLayout(3 * GiB + sum(layers), "bf16", 3 * GiB, layers)  # 83 GiB: larger than the machine
    plan = plan_memory(
        "50%", mac, core_bytes=layout.core_bytes, expert_bytes=16 * MiB, fetch_workers=8, layout=layout,
        context_bytes=GiB, max_context=32768,
    )  # fmt: skip
    assert plan.streamed and not plan.fits
    assert (
        plan.core_held_bytes == 48 * GiB - GiB - plan.buffer_bytes - constants.MIN_RAM_BUDGET_BYTES
    )  # all but the least RAM tier
    split = plan.split
    assert split.ahead == 2  # the layer computing and two being read, the rest of the budget pins layers
    assert split.held_bytes <= plan.core_held_bytes
    assert split.pinned == (plan.core_held_bytes - 3 * GiB - 3 * 2 * GiB) // (2 * GiB)
    assert split.read_bytes_per_token == (40 - split.pinned) * 2 * GiB
    assert plan.total_bytes <= mac.working_set_bytes
    # a budget below the smallest streamed core is raised to it: what it keeps and two layers
    small = plan_memory("50%", mac, core_bytes=layout.core_bytes, expert_bytes=MiB, fetch_workers=1, layout=layout,
                        core_budget="1GiB")  # fmt: skip
    assert small.core_held_bytes == 3 * GiB + 2 * 2 * GiB and small.split.pinned == 0 and small.split.ahead == 1
    # one that does not fit even streamed is refused, saying what streaming it needs
    with pytest.raises(CoreTooLargeError, match="even streamed"):
        plan_memory("50%", DeviceMemory(8 * GiB, 6 * GiB), core_bytes=layout.core_bytes, expert_bytes=MiB,
                    fetch_workers=1, layout=layout)  # fmt: skip


# -- a node asks MLX for it, on the MLX thread --------------------------------------------------


def test_a_node_limits_the_cache_and_wires_the_core_and_the_ram_tier(limits, pulled_home, hub, tmp_path: Path) -> None:
    home = pulled_home(ARCH, tmp_path)
    mac = limits(memory=16 * GiB, working_set=12 * GiB)
    expected = _expected(home, constants.DEFAULT_RAM_BUDGET, DeviceMemory(16 * GiB, 12 * GiB))
    node = _node(home).start()
    try:
        assert node.memory == expected
        assert node.store.ram.budget_bytes == expected.ram_tier_bytes
        mlx = model_thread().name
        assert mac.cache == [(mlx, expected.buffer_cache_bytes)]
        assert mac.wired == [(mlx, expected.core_bytes + expected.ram_tier_bytes + expected.buffer_cache_bytes)]
    finally:
        node.close()
    assert mac.wired[-1] == (mlx, PREVIOUS_WIRED)  # given back at close


def test_wiring_beyond_the_working_set_is_bounded_and_said_in_one_line(
    limits, pulled_home, hub, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    home = pulled_home(ARCH, tmp_path)
    mac = limits(memory=16 * GiB, working_set=2 * GiB)
    node = _node(home, ram_budget="4GiB")
    with caplog.at_level(logging.WARNING, logger="expertmesh.node.engine.memory"):
        node.start()
    node.close()
    assert mac.wired[0][1] == 2 * GiB  # what Metal allows, not core + 4 GiB
    (line,) = [r.getMessage() for r in caplog.records if "wiring" in r.getMessage()]
    assert "recommended working set is 2.15 GB" in line and "\n" not in line


def test_without_metal_nothing_is_wired_and_one_line_says_why(
    limits, pulled_home, hub, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    home = pulled_home(ARCH, tmp_path)
    mac = limits(memory=16 * GiB, working_set=None)  # MLX's own device info: this CPU
    with caplog.at_level(logging.INFO, logger="expertmesh.node.engine.memory"):
        node = _node(home).start()
    try:
        assert mac.wired == [] and len(mac.cache) == 1
    finally:
        node.close()
    (line,) = [r.getMessage() for r in caplog.records if "not wired" in r.getMessage()]
    assert "CPU only" in line


def test_a_core_that_cannot_fit_even_streamed_is_refused_before_it_loads(
    limits, pulled_home, hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = pulled_home(ARCH, tmp_path)
    limits(memory=GiB, working_set=1024)  # a "Mac" with a kilobyte to spare

    def never(*args, **kwargs):
        raise AssertionError("the core was loaded although it cannot fit")

    monkeypatch.setattr(streamed_model, "load_streamed_model", never)
    with pytest.raises(CoreTooLargeError, match=f"even streamed.*pull {REPO_ID} --core-bits 4"):
        _node(home)
