"""The full nodes a coordinator can send generations to, and which one is least busy.

Busy is the coordinator's own count of generations it has in flight on each node: a node runs
one generation at a time, so that count is exactly its queue as far as this coordinator knows.
Nodes come from a fixed list (the embedded node, `--peer`s) and from the PeerTable that zeroconf
keeps, so a Mac that joins the household starts taking requests without a restart. That table
holds only nodes that proved they know the household secret (node/rpc/proof.py): an advertisement
alone never gets users' prompts sent to a node.

A node whose call just failed (refused the connection, stopped answering, cut a stream) goes to the
back of the ranking for FAILED_LAST_S, so the next request goes to a live node instead of finding
the dead one first again; it is still tried when every other node is busy or gone, and its first
token after that clears the mark. (A fixed `--peer` that died cannot leave the list, only its front.)

Each node runs as many generations at once as its own `--max-batch` allows (1 where mlx-lm cannot
batch its model), which it tells in Info (`generation_slots`); the pool keeps what each said
(`learn_slots`), so the API's queue has as many slots as the household has (`slots`), and a node
with a free slot is tried before one that would refuse ("busy") and turn a wait into a 429.
A node that has not said yet counts for `default_slots`.

Among the nodes with a free slot, a request goes first to the one that holds the longest prefix
of its prompt in its prefix cache (node/engine/prefix_cache.py), so a conversation's next turn or
an agent's next step resumes where the last one left off instead of feeding the whole prompt
again on a node that never saw it; with none holding any, to the least busy. What each node holds
is what it last said (`learn_held`: its GenerationDone after each generation, and its Info), as
keys of message prefixes (node/rpc/prefix_keys.py), never tokens or text.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from dataclasses import dataclass, field

FAILED_LAST_S = 30.0  # a node whose call failed is ranked last this long (or until it answers again)
MAX_NODE_SLOTS = 256  # the most generation slots a node's Info is believed for
SLOTS_ASKED_S = 30.0  # a node that did not say its generation slots is asked again after this


@dataclass
class NodePool:
    static: list[str] = field(default_factory=list)  # host:port of full nodes always used
    discovered: Callable[[], list[str]] = lambda: []  # more full nodes, e.g. from a PeerTable
    failed_last_s: float = FAILED_LAST_S
    default_slots: int = 1  # generations a node runs at once until its Info says
    _slots: dict[str, int] = field(default_factory=dict)  # address -> its Info's generation_slots
    _asked: dict[str, float] = field(default_factory=dict)  # address -> when its slots were last asked
    _busy: dict[str, int] = field(default_factory=dict)
    _failed: dict[str, float] = field(default_factory=dict)  # address -> when its last call failed (monotonic)
    _held: dict[str, dict[bytes, int]] = field(default_factory=dict)  # address -> prefix key -> tokens it holds
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def following(cls, static: list[str], table) -> NodePool:
        """`static` plus the live full nodes of a PeerTable."""
        return cls(static, table.full_addresses)

    def addresses(self) -> list[str]:
        seen: dict[str, None] = dict.fromkeys(self.static)
        seen.update(dict.fromkeys(self.discovered()))
        return list(seen)

    def ranked(self, exclude: AbstractSet[str] = frozenset(), keys: Sequence[bytes] = ()) -> list[str]:
        """Full nodes with a free slot before full ones, and those that failed within
        `failed_last_s` last; among the first, the node holding the most tokens of the prompt
        whose message-prefix `keys` are given (none: nobody holds any), then the least busy; ties
        keep the configured order (stable)."""
        with self._lock:
            nodes = [a for a in self.addresses() if a not in exclude]
            now = time.monotonic()

            def rank(a: str) -> tuple[bool, bool, int, int]:
                recently_failed = now - self._failed.get(a, -math.inf) < self.failed_last_s
                busy = self._busy.get(a, 0)
                held = self._held.get(a, {})
                holds = max((held.get(k, 0) for k in keys), default=0) if held else 0
                return recently_failed, busy >= self._slots.get(a, self.default_slots), -holds, busy

            return sorted(nodes, key=rank)

    def learn_held(self, address: str, held: dict[bytes, int]) -> None:
        """What `address` said it holds now (node/rpc/prefix_keys.py's `held_table`): it replaces
        what it said before (states it evicted are gone from it)."""
        with self._lock:
            self._held[address] = held

    def learn_slots(self, address: str, slots: int) -> None:
        """`address` runs `slots` generations at once (its Info); 0 (an older node) is ignored."""
        if slots > 0:
            with self._lock:  # a node's word, bounded: a node admits no more calls than it has threads
                self._slots[address] = min(slots, MAX_NODE_SLOTS)

    def to_ask(self) -> tuple[list[str], list[str]]:
        """Nodes whose generation slots are not known and were not asked within SLOTS_ASKED_S, as
        (never asked, asked before without an answer); they are marked asked now (so concurrent
        requests ask each node once)."""
        addresses, now = self.addresses(), time.monotonic()
        with self._lock:
            due = [
                a for a in addresses if a not in self._slots and now - self._asked.get(a, -math.inf) >= SLOTS_ASKED_S
            ]
            first = [a for a in due if a not in self._asked]
            for a in due:
                self._asked[a] = now
            return first, [a for a in due if a not in first]

    def forget(self, addresses: list[str]) -> None:
        """Drop what is kept of nodes that left the household (none of whose calls runs)."""
        with self._lock:
            for a in addresses:
                if not self._busy.get(a):
                    self._busy.pop(a, None)
                    self._failed.pop(a, None)
                    self._slots.pop(a, None)
                    self._asked.pop(a, None)
                    self._held.pop(a, None)

    def slots(self) -> int:
        """Generations the household's full nodes run at once: the API queue's slots."""
        addresses = self.addresses()
        with self._lock:
            return sum(self._slots.get(a, self.default_slots) for a in addresses)

    def full(self, address: str) -> None:
        """`address` refused a generation as full: it runs no more than the generations this API has
        on it now (at least one), whatever its Info said or was taken to say. Its Info corrects
        this when it is heard; until then the queue waits for the slots that really are there."""
        with self._lock:
            running = self._busy.get(address, 0)
            self._slots[address] = max(1, min(self._slots.get(address, self.default_slots), running))

    def failed(self, address: str) -> None:
        """A call to `address` failed: rank it last for a while."""
        with self._lock:
            self._failed[address] = time.monotonic()

    def answered(self, address: str) -> None:
        """`address` answered (a token came): it is ranked by its load alone again."""
        with self._lock:
            self._failed.pop(address, None)

    @contextmanager
    def using(self, address: str):
        with self._lock:
            self._busy[address] = self._busy.get(address, 0) + 1
        try:
            yield address
        finally:
            with self._lock:
                self._busy[address] -= 1

    def busy(self) -> dict[str, int]:
        with self._lock:
            return dict(self._busy)
