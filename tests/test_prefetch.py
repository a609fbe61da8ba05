"""Next-layer guesses: counted as used or wasted by the pass they were for, judged even when not
fetched, fetched only while they are right often enough, and never a change to the output (the
oracle tests run with guesses on)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from waiting import wait_until

from expertmesh.assembly import open_model
from expertmesh.devtools.local_hub import HubServer
from expertmesh.node.config import StoreConfig
from expertmesh.node.engine.generation import Generator, SamplingSettings
from expertmesh.node.errors import Abandoned
from expertmesh.node.fetching import DEMAND, FetchContext
from expertmesh.node.hub import client as hub_client
from expertmesh.node.store.fetch_queue import FetchQueue
from expertmesh.node.store.flights import Flights
from expertmesh.node.store.prefetch import MIN_JUDGED, PREFETCH_WINDOW, Prefetcher
from expertmesh.node.store.stats import StoreStats
from expertmesh.node.store.tier_chain import Fetched
from tests.store_calls import take_layer

REPO_ID = "expertmesh/tiny-kimi_k3"


@pytest.fixture(scope="module")
def home(pulled_home, hub_root: Path, tmp_path_factory: pytest.TempPathFactory):
    with HubServer(hub_root) as server, hub_client.using_endpoint(server.url):
        home = tmp_path_factory.mktemp("home")
        pulled_home("kimi_k3", home)
        yield home


def test_every_guess_is_used_or_wasted_and_the_output_is_unchanged(home: Path) -> None:
    outputs = {}
    for prefetch in (False, True):
        sm = open_model(REPO_ID, home=home, store=StoreConfig(ram_budget="1", prefetch=prefetch))
        try:
            ids = sm.tokenizer.encode("Guess the next layer")
            outputs[prefetch] = [t.id for t in Generator(sm).generate(ids, SamplingSettings(max_tokens=16))]
            take_layer(sm.store, sm.index.moe_layers[0], [])  # a last pass judges the last guesses
            take_layer(sm.store, sm.index.moe_layers[-1], [])
            pf = sm.store.stats.prefetch
        finally:
            sm.close()
        if prefetch:
            assert pf["issued"] > 0 and pf["used"] > 0
            assert pf["issued"] == pf["used"] + pf["wasted"]
            assert 0 < pf["ready"] <= pf["used"]  # some guesses arrived before their demand
        else:
            assert pf["issued"] == 0
    assert outputs[True] == outputs[False]


def _judge_good_guesses(store, layer: int, experts: list[int]) -> None:
    """Enough right guesses that the prefetcher fetches the next ones."""
    for _ in range(-(-MIN_JUDGED // len(experts))):
        store.prefetch(layer, experts)
        take_layer(store, layer, experts)


def test_poor_guesses_are_judged_without_being_fetched_until_they_get_better(home: Path) -> None:
    sm = open_model(REPO_ID, home=home, store=StoreConfig(ram_budget="1", fill=False))
    try:
        store, layer = sm.store, sm.index.moe_layers[1]
        assert store.wants_guesses()
        for _ in range(PREFETCH_WINDOW // 4):  # always guess experts 0-3, always demand 4-5
            store.prefetch(layer, [0, 1, 2, 3])
            take_layer(store, layer, [4, 5])
        assert store.stats.prefetch["issued"] == 0  # never right: not one byte spent finding that out
        assert store.wants_guesses()  # still guessing (a router's few multiplies), still judging
        passes = 0
        while not store.stats.prefetch["issued"] and passes < PREFETCH_WINDOW:  # the guesses turn right
            store.prefetch(layer, [4, 5])
            take_layer(store, layer, [4, 5])
            passes += 1
        assert store.stats.prefetch["issued"] > 0  # fetched again
        assert passes < PREFETCH_WINDOW // 2  # as soon as a quarter of the window is right
    finally:
        sm.close()


def test_a_prompts_right_guesses_do_not_get_decodes_poor_ones_fetched(home: Path) -> None:
    """A prompt's guess is the union of its rows' guesses, judged against the union they route to:
    mostly right. A one-row guess is judged among one-row guesses, so after a prompt decode's
    poor guesses are still judged without being fetched, and the prompt's next guess still is."""
    sm = open_model(REPO_ID, home=home, store=StoreConfig(ram_budget="1", fill=False))
    try:
        store, layer = sm.store, sm.index.moe_layers[1]
        for _ in range(PREFETCH_WINDOW // 8):  # a prompt's passes: their 8 guesses all routed to
            store.prefetch(layer, range(8), rows=64)
            take_layer(store, layer, range(8))
        issued = store.stats.prefetch["issued"]
        for _ in range(PREFETCH_WINDOW // 4):  # decode's passes: always 0-3 guessed, 4-5 demanded
            store.prefetch(layer, [0, 1, 2, 3])
            take_layer(store, layer, [4, 5])
        assert store.stats.prefetch["issued"] == issued  # not one byte on a one-row guess
        store.prefetch(layer, range(8), rows=64)  # the next prompt's guess, right as before: fetched
        assert store.stats.prefetch["issued"] > issued
        take_layer(store, layer, range(8))
    finally:
        sm.close()


def test_guesses_go_out_behind_demands_that_outnumber_the_workers(home: Path) -> None:
    """K3's regime: almost every use of a token is a miss, so a layer's demands outnumber the
    fetch workers. The next layer's guesses are still fetched — queued behind the demands, never
    before them — and are ready when their pass comes."""
    # RAM room for the staged guesses (they count against it), 2 fetch workers
    sm = open_model(
        REPO_ID, home=home, store=StoreConfig(ram_budget="1MB", disk_budget="0", fetch_concurrency=2, fill=False)
    )
    try:
        store = sm.store
        first, second = sm.index.moe_layers[:2]
        _judge_good_guesses(store, second, [20, 21, 22, 23])
        before = store.stats.snapshot()
        take_layer(store, first, range(8), guess=(second, [10, 11, 12, 13]))  # 8 misses, 2 workers
        assert wait_until(lambda: store.prefetcher.in_flight == 0), "the guesses were never fetched"
        take_layer(store, second, [10, 11, 12, 13])
        d = store.stats.since(before)
        assert d.prefetch["issued"] == 4
        assert d.prefetch["used"] == 4 and d.prefetch["ready"] == 4
        # an earlier test may have left some on this home's disk
        assert d.uses["hub"] + d.uses["disk"] == 12 and d.uses["ram"] == 0  # each fetched once, guesses included
    finally:
        sm.close()


def test_a_layer_wanting_more_experts_than_memory_holds_comes_in_groups(home: Path) -> None:
    """A long prompt can route one layer to more experts than the RAM budget holds: they are
    handed over in groups of half the hold limit (one group computed while the next is fetched),
    so memory stays within the budget."""
    sm = open_model(REPO_ID, home=home, store=StoreConfig(ram_budget="1", fetch_concurrency=4, fill=False))
    try:
        store, layer = sm.store, sm.index.moe_layers[0]
        assert store.hold_limit() == 4
        groups = [sorted(g.experts) for g in store.layer_groups(layer, range(7))]
        assert groups == [[0, 1], [2, 3], [4, 5], [6]]
        assert [sorted(g.experts) for g in store.layer_groups(layer, range(4))] == [
            [0, 1, 2, 3]
        ]  # few enough: one group
    finally:
        sm.close()


def _queued_and_computed(store, layer: int, n: int) -> list[tuple[str, list[int]]]:
    """The order in which `layer_groups` queues the experts 0..n-1 of `layer` and hands their
    groups over to be computed."""
    events: list[tuple[str, list[int]]] = []
    demand = store.flights.demand

    def queued(keys, plan=None):
        keys = list(keys)
        events.append(("queued", sorted(e for _, e in keys)))
        return demand(keys, plan)

    store.flights.demand = queued
    try:
        for group in store.layer_groups(layer, range(n)):
            events.append(("computing", sorted(group.experts)))
    finally:
        del store.flights.demand
    return events


def test_the_next_group_is_fetched_while_the_caller_computes_this_one(home: Path) -> None:
    """Pipelined groups: the disk or the link works on group n + 1 while group n is computed,
    instead of idling through every group's compute."""
    sm = open_model(REPO_ID, home=home, store=StoreConfig(ram_budget="1", fetch_concurrency=2, fill=False))
    try:
        store, layer = sm.store, sm.index.moe_layers[-1]
        events = _queued_and_computed(store, layer, 3)
        assert events == [
            ("queued", [0]),
            ("queued", [1]),  # before group [0] is handed over
            ("computing", [0]),
            ("queued", [2]),
            ("computing", [1]),
            ("computing", [2]),
        ]
    finally:
        sm.close()


def test_a_layer_wider_than_the_hold_limit_waits_beside_the_slots_two_experts_per_fetch_worker(home: Path) -> None:
    """An expert is decoded as it arrives and goes into a RAM-tier slot only when its group is
    handed over, so what is queued ahead of the group being computed is memory beside the tier.
    With a RAM budget that holds all of a layer but two experts the hold limit is that, yet the
    layer comes in groups of one expert per fetch worker, never more than two of them queued and
    not yet handed over: the link is as busy, the memory plan holds."""
    index = open_model(REPO_ID, home=home, store=StoreConfig(fill=False))
    layer = index.index.moe_layers[0]
    n = sum(1 for lay, _ in index.index.experts if lay == layer)
    nbytes = index.index.expert(layer, 0).nbytes
    index.close()
    ram = str((n - 2) * nbytes + nbytes // 2)
    sm = open_model(REPO_ID, home=home, store=StoreConfig(ram_budget=ram, fetch_concurrency=2, fill=False))
    try:
        store = sm.store
        assert n > store.hold_limit() > 4 + 1
        events = _queued_and_computed(store, layer, n)
        queued = handed = 0
        for what, experts in events:
            if what == "queued":
                queued += len(experts)
            else:
                assert queued - handed <= 4, events  # beside the slots, the group handed over included
                handed += len(experts)
        assert handed == n
    finally:
        sm.close()


def test_a_layers_guess_goes_out_behind_the_demands_of_all_its_groups(home: Path) -> None:
    """The next layer's guess is queued with this layer's last group, behind every demand of the
    layer: queued with the first, it would start while a group is computed and the next group's
    demands are not queued yet (no demand in flight then), and hold the link they then need."""
    sm = open_model(REPO_ID, home=home, store=StoreConfig(ram_budget="1", fetch_concurrency=2, fill=False))
    try:
        store = sm.store
        first, second = sm.index.moe_layers[:2]
        events: list[tuple[str, list[int]]] = []
        demand, prefetch = store.flights.demand, store.prefetch

        def queued(keys, plan=None):
            keys = list(keys)
            events.append(("queued", sorted(e for _, e in keys)))
            return demand(keys, plan)

        def guessed(layer, experts):
            events.append(("guessed", [layer]))
            return prefetch(layer, experts)

        store.flights.demand, store.prefetch = queued, guessed
        for group in store.layer_groups(first, range(3), guess=(second, [5, 6])):
            events.append(("computing", sorted(group.experts)))
        del store.flights.demand, store.prefetch
        assert events == [
            ("queued", [0]),
            ("queued", [1]),
            ("computing", [0]),
            ("queued", [2]),
            ("guessed", [second]),  # behind the last group's demands
            ("computing", [1]),
            ("computing", [2]),
        ]
    finally:
        sm.close()


def test_a_peers_call_for_a_layer_leaves_this_nodes_guesses_for_it_alone(home: Path) -> None:
    """A peer's ComputeExperts asks this node's store for a layer while this node may be
    generating too: that is not this node's pass, so its staged guesses for the layer stay, and
    are used when its own pass comes."""
    sm = open_model(
        REPO_ID, home=home, store=StoreConfig(ram_budget="1MB", disk_budget="0", fetch_concurrency=2, fill=False)
    )
    try:
        store = sm.store
        layer = sm.index.moe_layers[1]
        _judge_good_guesses(store, layer, [20, 21, 22, 23])
        before = store.stats.snapshot()
        store.prefetch(layer, [10, 11])
        assert wait_until(lambda: store.prefetcher.in_flight == 0), "the guesses were never fetched"
        take_layer(store, layer, [12], routed=[])  # what ComputeExperts does
        take_layer(store, layer, [10, 11])  # this node's own pass
        d = store.stats.since(before)
        assert d.prefetch["issued"] == 2
        assert d.prefetch["used"] == 2 and d.prefetch["ready"] == 2 and d.prefetch["wasted"] == 0
    finally:
        sm.close()


class _EmptyRam:
    """The RAM tier as the prefetcher sees it: room for a few experts, none held yet."""

    def slots(self, expert_bytes: int) -> int:
        return 8

    def __contains__(self, key) -> bool:
        return False


def test_a_right_guess_keeps_its_link_between_its_pass_and_its_demand() -> None:
    """A pass judges its guesses first and asks for its experts right after. A guess still in
    flight that the pass wants must not give its link up in between (a demand has not joined it
    yet), or the expert it was right about is fetched twice; if it arrives in between, it is
    kept for the asking."""
    started, told, gate = [], [], threading.Event()

    def fetch(key, keep_now: bool = False, ctx: FetchContext = DEMAND) -> Fetched:
        started.append(key)
        if key == (1, 7):
            gate.wait(10)  # in flight when its pass comes
            told.append(ctx.should_abandon())
            if told[-1]:
                raise Abandoned(f"{key} gave up")
        return Fetched(weights=None, source="hub", seconds=0.0)

    flights = Flights()
    prefetcher = Prefetcher(flights, _EmptyRam(), StoreStats(), workers=2)
    q = FetchQueue(flights, fetch, lambda keys, ctx=DEMAND: [fetch(k) for k in keys], 2, may_share=prefetcher.proven)
    q.start()
    try:
        for _ in range(MIN_JUDGED):  # right every time, judged without being fetched
            prefetcher.guess(0, [1])
            prefetcher.judge_guesses(0, {1})
        prefetcher.guess(1, [7])
        assert prefetcher.in_flight == 1
        prefetcher.judge_guesses(1, {7})  # its pass: judged right, and its demand comes next
        gate.set()
        assert wait_until(lambda: prefetcher.in_flight == 0)
        assert told == [False]  # it was not told to give up
        assert prefetcher.take((1, 7)) is not None  # and is there for the demand
        assert started == [(1, 7)]
    finally:
        gate.set()
        q.close()


def test_a_layers_last_group_comes_in_halves_queued_while_the_group_before_is_computed(home: Path) -> None:
    """What is computed after a layer's last expert has come waits with the link idle (the next
    layer's experts are not known yet): the last group is split in halves, and all of them are
    fetched while the group before them is computed, so that wait is two experts'."""
    sm = open_model(REPO_ID, home=home, store=StoreConfig(ram_budget="1", fetch_concurrency=8, fill=False))
    try:
        store, layer = sm.store, sm.index.moe_layers[0]
        assert store.hold_limit() == 8
        events = _queued_and_computed(store, layer, 12)
        assert events == [
            ("queued", [0, 1, 2, 3]),
            ("queued", [4, 5, 6, 7]),
            ("computing", [0, 1, 2, 3]),
            ("queued", [8, 9]),  # the last group of four, in halves: both beside [4..7] within the limit of 8
            ("queued", [10, 11]),
            ("computing", [4, 5, 6, 7]),
            ("computing", [8, 9]),
            ("computing", [10, 11]),
        ]
    finally:
        sm.close()
