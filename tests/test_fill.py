"""Idle-link fill: while a generation runs and no demand wants the link, experts not yet held are
fetched onto free disk budget — each from the Hub once, never by evicting, never changing the output."""

from __future__ import annotations

from pathlib import Path

from waiting import wait_until

from expertmesh.assembly import open_model
from expertmesh.devtools.local_hub import HubServer
from expertmesh.node.config import StoreConfig
from expertmesh.node.engine.generation import Generator, SamplingSettings
from expertmesh.node.hub.pull import pull
from expertmesh.node.model.expert_index import run_ranges

REPO_ID = "expertmesh/tiny-kimi_k3"
PROMPT = "Fill the disk while the link is idle"
TOKENS = 24
SPARE = 5  # free disk slots left for the fill in the budget test


def _generate(sm) -> list[int]:
    return [t.id for t in Generator(sm).generate(sm.tokenizer.encode(PROMPT), SamplingSettings(max_tokens=TOKENS))]


def _fill_over(sm):
    """Whether the fill has nothing left to do (it found the disk full, or filled everything) and
    no fill is in flight: from then on no fill can start."""
    return lambda: sm.store.fill.done and sm.store.flights.fill_bytes() == 0


def test_fill_fetches_unused_experts_once_and_keeps_the_output(hub: HubServer, oracle, tmp_path: Path) -> None:
    expected = oracle.tokens("kimi_k3", PROMPT, TOKENS)
    pull(REPO_ID, home=tmp_path, progress=False)
    sm = open_model(REPO_ID, home=tmp_path, store=StoreConfig(prefetch=False, fill=True))
    try:
        before, requests = hub.stats()["bytes_served"], hub.stats()["requests"]
        assert _generate(sm) == expected
        n = len(sm.index.experts)
        assert wait_until(lambda: len(sm.disk) == n), f"the fill left {n - len(sm.disk)} of {n} experts unfetched"
        stats = sm.store.stats.snapshot()
        assert stats.uses["hub"] < n and stats.prefetch["filled"] >= n - stats.uses["hub"]  # fills did the rest
        all_bytes = sum(loc.nbytes for loc in sm.index.experts.values())
        assert hub.stats()["bytes_served"] - before == all_bytes  # every expert crossed the Hub exactly once
        ranges = len(next(iter(sm.index.experts.values())).ranges)
        assert hub.stats()["requests"] - requests < n * ranges  # fills of adjacent experts went as runs
    finally:
        sm.close()


def test_a_run_of_adjacent_experts_is_one_request_per_range(hub: HubServer, tmp_path: Path) -> None:
    pull(REPO_ID, home=tmp_path, progress=False)
    sm = open_model(REPO_ID, home=tmp_path, store=StoreConfig(prefetch=False, fill=False))
    try:
        source = sm.store.chain.runs  # the Hub tier: the only remote tier of a node alone
        layer = min(k[0] for k in sm.index.experts)
        run = [sm.index.expert(layer, e) for e in range(4)]
        assert run_ranges([run[0], run[2]]) is None  # not back to back: no run
        merged = run_ranges(run)
        assert merged is not None and len(merged) == len(run[0].ranges)
        one_by_one = [source.fetch(loc) for loc in run]
        requests = hub.stats()["requests"]
        assert source.fetch_run(run) == one_by_one
        assert hub.stats()["requests"] - requests == len(merged)
    finally:
        sm.close()


def test_fill_takes_free_budget_only(hub: HubServer, tmp_path: Path) -> None:
    pull(REPO_ID, home=tmp_path, progress=False)
    sm = open_model(REPO_ID, home=tmp_path, store=StoreConfig(prefetch=False, fill=False))
    _generate(sm)
    used, expert_bytes = len(sm.disk), max(loc.nbytes for loc in sm.index.experts.values())
    sm.close()
    budget = (used + SPARE) * expert_bytes
    sm = open_model(REPO_ID, home=tmp_path, store=StoreConfig(prefetch=False, fill=True, disk_budget=str(budget)))
    try:
        before = hub.stats()["bytes_served"]
        _generate(sm)  # every demand is a disk hit now; the link is idle for the fill
        assert wait_until(lambda: sm.store.stats.prefetch["filled"] >= SPARE)
        sm.store.fill.touch()  # a generation still going on: the fill goes on while it may
        assert wait_until(_fill_over(sm)), "the fill never found its budget full"
        assert sm.store.stats.prefetch["filled"] == SPARE and len(sm.disk) == used + SPARE
        assert sm.disk.nbytes <= budget and sm.disk.evictions == 0  # filled into free room, evicted nothing
        assert hub.stats()["bytes_served"] - before <= SPARE * expert_bytes
    finally:
        sm.close()


def test_fill_stops_when_the_file_system_is_full(hub: HubServer, oracle, tmp_path: Path, monkeypatch) -> None:
    """Writes failing with ENOSPC: the generation still gives mlx-lm's tokens, and the fill stops
    at once instead of downloading the model for nothing."""
    import errno

    from expertmesh.node.store.tiers import disk as disk_cache

    expected = oracle.tokens("kimi_k3", PROMPT, TOKENS)
    pull(REPO_ID, home=tmp_path, progress=False)

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_cache.os, "replace", full)
    sm = open_model(REPO_ID, home=tmp_path, store=StoreConfig(prefetch=False, fill=True))
    try:
        before = hub.stats()["bytes_served"]
        assert _generate(sm) == expected
        sm.store.fill.touch()
        assert wait_until(_fill_over(sm)), "the fill never stopped"
        stats = sm.store.stats.snapshot()
        assert len(sm.disk) == 0 and stats.prefetch["filled"] == 0
        expert_bytes = max(loc.nbytes for loc in sm.index.experts.values())
        wasted = hub.stats()["bytes_served"] - before - stats.bytes["hub"]
        assert wasted <= sm.store.fetch_workers * expert_bytes  # at most the fills that were in flight
    finally:
        sm.close()
