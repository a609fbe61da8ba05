"""RAM replacement policies: they keep their budget, tell hits truthfully, lose to Belady's optimum,
and the frequency-aware ones survive the scans that flush LRU."""

from __future__ import annotations

import random

import pytest

from expertmesh.node.store.policies import POLICIES, belady_hit_rate, frequency_oracle_hit_rate, hit_rate, make_policy
from expertmesh.node.store.tiers.ram import RamCache


def _skewed(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [int(rng.paretovariate(1.1)) % 300 for _ in range(n)]


@pytest.mark.parametrize("name", list(POLICIES))
def test_a_policy_keeps_its_slots_and_reports_hits_truthfully(name: str) -> None:
    policy = make_policy(name, 12)
    for key in _skewed(3000, seed=1):
        was_held = key in policy
        hit, evicted = policy.access(key)
        assert hit == was_held
        assert len(policy) <= 12
        assert all(k not in policy for k in evicted)
        assert hit or key in policy or key in evicted  # a miss is admitted, or refused outright


@pytest.mark.parametrize("slots", [4, 16, 64])
def test_no_policy_beats_the_offline_optimum(slots: int) -> None:
    accesses = _skewed(4000, seed=slots)
    best = belady_hit_rate(accesses, slots)
    for name in POLICIES:
        assert hit_rate(name, accesses, slots) <= best + 1e-12
    assert best > 0


def test_frequency_survives_a_scan_that_flushes_lru() -> None:
    hot = list(range(8))
    accesses: list = []
    for round_ in range(50):  # a hot set in use, and now and then a long prompt touching 20 new experts
        accesses += hot * 3
        accesses += [("scan", round_, i) for i in range(20)]
    best = belady_hit_rate(accesses, 10)  # every hot use after the first round hits
    assert hit_rate("lfu", accesses, 10) >= 0.95 * best
    assert hit_rate("arc", accesses, 10) >= 0.95 * best
    assert hit_rate("lru", accesses, 10) < 0.75 * best  # each scan flushed the hot set


def test_the_frequency_oracle_holds_the_most_used_and_stays_below_belady() -> None:
    accesses = [1, 2, 1, 3, 1, 2, 4, 5]  # 1 used 3 times, 2 twice
    assert frequency_oracle_hit_rate(accesses, 2) == 3 / 8  # {1, 2} kept from their first use
    for slots in (4, 16, 64):
        skewed = _skewed(4000, seed=slots)
        assert frequency_oracle_hit_rate(skewed, slots) <= belady_hit_rate(skewed, slots) + 1e-12


def test_zero_slots_hold_nothing() -> None:
    for name in POLICIES:
        policy = make_policy(name, 0)
        assert [policy.access(k)[0] for k in (1, 1, 1)] == [False, False, False] and len(policy) == 0


def test_an_unknown_policy_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="lru"):
        RamCache(1000, {}, {}, policy="fifo")


def test_lfu_memory_stays_bounded_by_its_slots_over_a_long_run_and_decides_as_before() -> None:
    """A long-lived node makes millions of expert uses: LFU's bookkeeping must stay in proportion to
    the experts it holds (its lazy heap kept an entry per use until the next ageing), and dropping
    stale entries must not change a single eviction."""
    from expertmesh.node.store.policies import LFUAged

    class Uncompacted(LFUAged):
        def _compact(self) -> None:
            pass

    rng = random.Random(3)  # a skewed trace: hot experts hit again and again, a long tail of cold ones
    trace = [(rng.randrange(4), min(int(rng.expovariate(0.05)), 639)) for _ in range(60_000)]
    bounded, reference = LFUAged(100, ageing_period=10**9), Uncompacted(100, ageing_period=10**9)
    for key in trace:
        assert bounded.access(key) == reference.access(key)
        assert len(bounded._heap) <= 2 * len(bounded) + 65
    assert len(reference._heap) > 10 * len(bounded._heap)  # what it was before: an entry per use
