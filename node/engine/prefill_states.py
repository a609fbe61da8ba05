"""The state of a prompt's cache at a position inside a layer-major prefill (engine/prefill.py),
so that a prefix checkpoint (engine/prefix_cache.py) no longer splits the prompt in two.

Layer-major, no moment holds the whole cache at a chunk's end: when the chunk after it starts
a layer, the chunk has passed that layer but not yet the ones after it. Each layer's cache is
right for the chunk's end in the interval between the chunk changing it and the next chunk
doing so, so its state is taken then, layer by layer: before each of the chunk's turns every
cache's attributes are noted (references, which also keeps an old array from being freed and
its id reused), and a cache whose attributes the turn replaced or moved is cloned right after
it. What works out which layer a cache belongs to is therefore the model's own pass, not a
mapping of blocks to layers that an architecture could break. A cache no chunk changes is
taken at the end, as it was throughout."""

from __future__ import annotations

import logging
from typing import Any

from mlx_lm.models.cache import CacheList

from expertmesh.node.engine.prefix_cache import clone_cache

logger = logging.getLogger(__name__)

_PLAIN = (int, float, bool, str, bytes, type(None))


def _refs(c: Any) -> list[Any]:
    """What a cache holds, flat: the objects its attributes name (a list's, tuple's or dict's
    items one by one, as `ArraysCache` rebinds its slots), a `CacheList`'s caches in turn. An
    update is seen when it replaces one of them or moves a number, as every mlx-lm cache's does
    (an array written in place moves the cache's offset)."""
    if isinstance(c, CacheList):
        return [r for x in c.caches for r in _refs(x)]
    out: list[Any] = []
    for value in vars(c).values():
        if isinstance(value, dict):
            value = list(value.values())
        out.extend(value if isinstance(value, (list, tuple)) else [value])
    return out


def _moved(before: list[Any], after: list[Any]) -> bool:
    if len(before) != len(after):
        return True
    for x, y in zip(before, after):
        if x is y:
            continue
        if isinstance(x, _PLAIN) and type(x) is type(y) and x == y:
            continue
        return True
    return False


class ChunkEndStates:
    """The cache's state at the end of each watched chunk of one layer-major prefill."""

    def __init__(self, cache: list, chunks: set[int]):
        self.cache = cache
        self._taken: dict[int, list[Any | None]] = {i: [None] * len(cache) for i in chunks}
        self._before: list[list[Any]] | None = None
        self._start = [_refs(c) for c in cache]  # what a cache no chunk changes still holds at the end

    def watches(self, chunk: int) -> bool:
        return chunk in self._taken

    def before_turn(self, chunk: int) -> None:
        if chunk in self._taken:
            self._before = [_refs(c) for c in self.cache]

    def after_turn(self, chunk: int) -> None:
        """Clone the caches this turn of `chunk` changed: each is at the chunk's end now."""
        if chunk not in self._taken or self._before is None:
            return
        taken = self._taken[chunk]
        for j, (c, before) in enumerate(zip(self.cache, self._before)):
            if _moved(before, _refs(c)):
                taken[j] = clone_cache([c])[0]
        self._before = None

    def states(self) -> dict[int, list]:
        """Each watched chunk's whole state, once every chunk is done (the caches no chunk
        changed are as they were). A chunk with a cache that the prompt changed but none of its
        turns was seen to change (an update this bookkeeping cannot see) gets no state: no
        checkpoint rather than a wrong one."""
        moved = [_moved(start, _refs(c)) for start, c in zip(self._start, self.cache)]
        out = {}
        for i, taken in self._taken.items():
            if any(t is None and m for t, m in zip(taken, moved)):
                logger.warning("a prefix checkpoint inside the prompt was left out: a cache changed unseen")
                continue
            out[i] = [t if t is not None else clone_cache([c])[0] for t, c in zip(taken, self.cache)]
        return out
