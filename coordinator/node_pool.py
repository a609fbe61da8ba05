"""The full nodes a coordinator can send generations to, and which one is least busy.

Busy is the coordinator's own count of generations it has in flight on each node: a node runs
one generation at a time, so that count is exactly its queue as far as this coordinator knows.
Nodes come from a fixed list (the embedded node, `--peer`s) and from the PeerTable that zeroconf
keeps, so a Mac that joins the household starts taking requests without a restart. That table
holds only nodes that proved they know the household secret (node/rpc/proof.py): an advertisement
alone never gets users' prompts sent to a node.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class NodePool:
    static: list[str] = field(default_factory=list)  # host:port of full nodes always used
    discovered: Callable[[], list[str]] = lambda: []  # more full nodes, e.g. from a PeerTable
    _busy: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def following(cls, static: list[str], table) -> NodePool:
        """`static` plus the live full nodes of a PeerTable."""
        return cls(static, table.full_addresses)

    def addresses(self) -> list[str]:
        seen: dict[str, None] = dict.fromkeys(self.static)
        seen.update(dict.fromkeys(self.discovered()))
        return list(seen)

    def ranked(self, exclude: set[str] = frozenset()) -> list[str]:
        """Full nodes, least busy first; ties keep the configured order (stable)."""
        with self._lock:
            nodes = [a for a in self.addresses() if a not in exclude]
            return sorted(nodes, key=lambda a: self._busy.get(a, 0))

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
