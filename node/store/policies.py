"""Replacement policies for the RAM tier, and Belady's offline optimum to judge them by.

All count slots, not bytes: the experts of a model have one size (K3: 17.5 MB each), so a byte
budget is a number of slots. Each policy answers `access(key) -> hit` and, on a miss, admits the
key and returns what it evicted, so the RAM tier and the trace replay run the very same code.
`discard(key)` forgets a resident key the RAM tier had to let go of on its own (its slot was
needed by experts in use: store/tiers/ram.py).

MoE routing is skewed and bursty: a few experts per layer are hot for a whole conversation, and
a long prompt touches many experts once. Recency alone (LRU) lets such a scan flush the hot set;
LFU with dynamic ageing and ARC keep frequency in the picture. Which one is the default is decided
by replaying recorded traces (`expertmesh replay`), not by taste.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import Protocol

Key = Hashable
AGEING_BUDGETS = 64


class Policy(Protocol):
    """What the RAM tier and the replay ask of a replacement policy (see the module's docstring)."""

    def access(self, key: Key) -> tuple[bool, list[Key]]:
        """(whether `key` was kept, what admitting it evicted)."""
        ...

    def discard(self, key: Key) -> None: ...


class LRU:
    name = "lru"

    def __init__(self, slots: int):
        self.slots = slots
        self._items: OrderedDict[Key, None] = OrderedDict()

    def access(self, key: Key) -> tuple[bool, list[Key]]:
        if key in self._items:
            self._items.move_to_end(key)
            return True, []
        if self.slots <= 0:
            return False, [key]
        self._items[key] = None
        evicted = []
        while len(self._items) > self.slots:
            evicted.append(self._items.popitem(last=False)[0])
        return False, evicted

    def discard(self, key: Key) -> None:
        self._items.pop(key, None)

    def __contains__(self, key: Key) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)


class LFUAged:
    """LFU over the whole history with periodic halving (TinyLFU's ageing), and frequency-based
    admission: a newcomer stays only if it has been used more often than the coldest resident.

    A model has a bounded set of experts (K3: 83,328), so exact counts fit in a dict; no sketch.
    Halving every AGEING_BUDGETS budgets' worth of uses lets yesterday's hot experts cool down; the
    period was chosen on the demo model's traces (benchmarks/bench_policies.py, docs/benchmarks.md)
    and keeps the half-life near a conversation (K3: ~900 tokens at a 20k-expert budget).
    """

    name = "lfu"

    def __init__(self, slots: int, ageing_period: int | None = None):
        self.slots = slots
        self.ageing_period = ageing_period or max(1024, AGEING_BUDGETS * slots)
        self._counts: dict[Key, int] = {}
        self._resident: dict[Key, tuple[int, int]] = {}  # key -> (count, tick) as in its heap entry
        self._heap: list[tuple[int, int, int, Key]] = []  # (count, tick, serial, key), lazy
        self._tick = 0
        self._serial = 0

    def _push(self, key: Key) -> None:
        entry = (self._counts[key], self._tick)
        self._resident[key] = entry
        self._serial += 1
        heapq.heappush(self._heap, (*entry, self._serial, key))
        if len(self._heap) > 2 * len(self._resident) + 64:
            self._compact()

    def _compact(self) -> None:
        """Drop the heap's stale entries. Every hit pushes a fresh entry and leaves the old one
        to be skipped when it surfaces; ageing (every `ageing_period` uses) alone would let the heap
        grow by an entry per expert use between ageings, without bound where ageing never comes (a
        small model's budget). Rebuilt when stale entries outnumber live ones, the cost per use
        stays constant on average, and the order of live entries (hence every eviction) is
        unchanged."""
        self._heap = [e for e in self._heap if self._resident.get(e[3]) == (e[0], e[1])]
        heapq.heapify(self._heap)

    def _age(self) -> None:
        self._counts = {k: c // 2 for k, c in self._counts.items() if c // 2 or k in self._resident}
        self._heap = []
        for key, (_, tick) in list(self._resident.items()):
            self._tick, saved = tick, self._tick
            self._push(key)
            self._tick = saved

    def access(self, key: Key) -> tuple[bool, list[Key]]:
        self._tick += 1
        if self._tick % self.ageing_period == 0:
            self._age()
        self._counts[key] = self._counts.get(key, 0) + 1
        if key in self._resident:
            self._push(key)
            return True, []
        if self.slots <= 0:
            return False, [key]
        self._push(key)
        evicted = []
        while len(self._resident) > self.slots:
            count, tick, _, victim = heapq.heappop(self._heap)
            if self._resident.get(victim) != (count, tick):
                continue  # stale
            del self._resident[victim]
            evicted.append(victim)  # possibly the newcomer itself: it was colder than everything kept
        return False, evicted

    def discard(self, key: Key) -> None:
        self._resident.pop(key, None)  # its heap entries are stale now, skipped when they surface

    def __contains__(self, key: Key) -> bool:
        return key in self._resident

    def __len__(self) -> int:
        return len(self._resident)


class ARC:
    """Adaptive Replacement Cache (Megiddo and Modha, 2003): balances a recency list and a
    frequency list by learning from ghosts of what each recently evicted."""

    name = "arc"

    def __init__(self, slots: int):
        self.slots = slots
        self.p = 0.0  # target size of the recency list
        self.t1: OrderedDict[Key, None] = OrderedDict()
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()

    def _replace(self, key: Key) -> Key:
        if self.t1 and (len(self.t1) > self.p or (key in self.b2 and len(self.t1) == self.p)):
            victim, _ = self.t1.popitem(last=False)
            self.b1[victim] = None
        else:
            victim, _ = self.t2.popitem(last=False)
            self.b2[victim] = None
        return victim

    def access(self, key: Key) -> tuple[bool, list[Key]]:
        c = self.slots
        if c <= 0:
            return False, [key]
        if key in self.t1 or key in self.t2:
            self.t1.pop(key, None)
            self.t2.pop(key, None)
            self.t2[key] = None
            return True, []
        evicted: list[Key] = []
        if key in self.b1:
            self.p = min(c, self.p + max(len(self.b2) / len(self.b1), 1))
            evicted.append(self._replace(key))
            del self.b1[key]
            self.t2[key] = None
            return False, evicted
        if key in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1))
            evicted.append(self._replace(key))
            del self.b2[key]
            self.t2[key] = None
            return False, evicted
        if len(self.t1) + len(self.b1) == c:
            if len(self.t1) < c:
                self.b1.popitem(last=False)
                evicted.append(self._replace(key))
            else:
                evicted.append(self.t1.popitem(last=False)[0])
        elif len(self.t1) + len(self.b1) < c:
            total = len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2)
            if total >= c:
                if total == 2 * c:
                    self.b2.popitem(last=False)
                evicted.append(self._replace(key))
        self.t1[key] = None
        return False, evicted

    def discard(self, key: Key) -> None:
        self.t1.pop(key, None)
        self.t2.pop(key, None)

    def __contains__(self, key: Key) -> bool:
        return key in self.t1 or key in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)


POLICIES = {p.name: p for p in (LFUAged, ARC, LRU)}
DEFAULT_POLICY = "lfu"


def make_policy(name: str, slots: int) -> Policy:
    try:
        return POLICIES[name](slots)
    except KeyError:
        raise ValueError(f"unknown RAM policy {name!r}; choose from {', '.join(POLICIES)}") from None


def hit_rate(policy_name: str, accesses: Iterable[Key], slots: int) -> float:
    policy = make_policy(policy_name, slots)
    hits = total = 0
    for key in accesses:
        hits += policy.access(key)[0]
        total += 1
    return hits / total if total else 0.0


def frequency_oracle_hit_rate(accesses: Sequence[Key], slots: int) -> float:
    """The best a frequency-only policy could do: keep, from its first use on, each of the `slots`
    experts the whole trace uses most (known in advance), and nothing else. An online frequency
    policy near it has no more to gain from counting; the rest of the gap to Belady needs knowing
    what comes next (prefetch). First uses miss, as in any cache, so it stays below Belady."""
    top = {k for k, _ in Counter(accesses).most_common(max(0, slots))}
    seen: set[Key] = set()
    hits = 0
    for k in accesses:
        hits += k in top and k in seen
        seen.add(k)
    return hits / len(accesses) if accesses else 0.0


def belady_hit_rate(accesses: Sequence[Key], slots: int) -> float:
    """The best any policy could do: evict what is needed again furthest in the future."""
    never = len(accesses)
    next_use = [never] * len(accesses)
    seen: dict[Key, int] = {}
    for i in range(len(accesses) - 1, -1, -1):
        next_use[i] = seen.get(accesses[i], never)
        seen[accesses[i]] = i
    held: dict[Key, int] = {}  # key -> its next use
    heap: list[tuple[int, int, Key]] = []  # (-next use, when pushed, key), lazy
    hits = 0
    for i, key in enumerate(accesses):
        if key in held:
            hits += 1
        elif slots <= 0:
            continue
        elif len(held) >= slots:
            while True:
                entry = heapq.heappop(heap)
                neg, _, victim = entry
                if held.get(victim) == -neg:
                    break
            if -neg <= next_use[i]:  # the newcomer is needed later than anything held: bypass it
                heapq.heappush(heap, entry)
                continue
            del held[victim]
        held[key] = next_use[i]
        heapq.heappush(heap, (-next_use[i], i, key))
    return hits / len(accesses) if accesses else 0.0
