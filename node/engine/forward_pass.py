"""One forward pass of a streamed model, as one object (`StreamedModel.forward` returns it).

A pass owns everything that belongs to it alone: the lazy logits, the expert uses its resident
layers left to count (`count_uses`, once its output is evaluated, so counting waits for nothing),
the batch's per-row ledgers, the next-layer guesses its MoE layers make for each other, and,
when asked for, what puts the cache back as it was before it (`discard`, or `commit(keep)` for
the first `keep` of its tokens). The expert blocks (engine/blocks.py) find the pass being built
with `building()`, and read and write only it: no block sets a flag on another.

Every pass ends in `commit` or `discard`; its uses are counted once, by `count_uses`, whichever
comes first of that and the model's `count_open` (which a generation calls at its start and end,
so nothing an earlier generation used is counted in a later one). MLX thread only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import mlx.core as mx
import numpy as np

from expertmesh.node.errors import SpeculationError
from expertmesh.node.model.expert_index import ExpertIndex
from expertmesh.node.store.stats import StoreStats
from expertmesh.node.store.store import Served

if TYPE_CHECKING:
    from expertmesh.node.engine.speculative import CacheRollback


class UsesCounter(Protocol):
    """What counts a resident layer's uses: the expert store (blocks.py's `BlockStore`)."""

    @property
    def index(self) -> ExpertIndex: ...

    def resident_uses(self, layer: int, experts: list[int]) -> None: ...


_BUILDING: ContextVar[ForwardPass | None] = ContextVar("expertmesh_forward_pass", default=None)


def building() -> ForwardPass | None:
    """The pass whose graph is being built now (inside `ForwardPass.build`), if any."""
    return _BUILDING.get()


@dataclass(eq=False)
class ForwardPass:
    """One forward pass, from the blocks' view and its caller's.

    `ledgers[r]` (a batch's, engine/batching.py) counts the experts batch row r's tokens routed
    to, each under the tier that served it; rows are the leading dimension of the model's input.
    """

    ledgers: list[StoreStats] | None = None
    rollback: CacheRollback | None = None  # how the pass's tokens come back out of its cache
    fed: int = 0  # tokens per row this pass feeds
    routing_only: bool = False  # every block records its routing and computes nothing (a probe)
    output: mx.array | None = None  # the model's lazy logits, once built
    # resident layers' routings, counted by `count_uses` once the output is evaluated
    unread: list[tuple[UsesCounter, int, mx.array]] = field(default_factory=list)
    guesses: dict[int, mx.array] = field(default_factory=dict)  # a layer -> its routing guessed by the layer before
    predicting: int | None = None  # the layer whose routing is being guessed right now
    state: str = "open"  # open | committed | discarded
    waiting: bool = False  # a layer-major prompt's chunk parked between two of its layers (engine/prefill.py)
    counted: bool = False
    _open: list[ForwardPass] | None = field(default=None, repr=False)  # its model's passes not counted yet

    @property
    def logits(self) -> mx.array:
        """The pass's logits (lazy until evaluated)."""
        if self.output is None:
            raise RuntimeError("the forward pass has not been built")
        return self.output

    def predicts(self, layer: int) -> bool:
        """Whether `layer`'s block only records its routing in this call (a guess or a probe)."""
        return self.routing_only or self.predicting == layer

    @contextmanager
    def build(self) -> Iterator[ForwardPass]:
        """The blocks see this pass while inside (the model's graph is built there)."""
        token = _BUILDING.set(self)
        try:
            yield self
        finally:
            _BUILDING.reset(token)
            self.guesses.clear()
            self.predicting = None

    @contextmanager
    def entered(self) -> Iterator[ForwardPass]:
        """The blocks see this pass while inside, as in `build`, its guesses left as they are: a
        layer-major prompt (engine/prefill.py) computes a layer for every chunk's pass from
        outside the chunks' own calls."""
        token = _BUILDING.set(self)
        try:
            yield self
        finally:
            _BUILDING.reset(token)

    def count_uses(self) -> None:
        """Count the uses of the layers that ran resident, once. After the pass's output is
        evaluated their routings are too, and reading them waits for nothing; before, it syncs."""
        if self.counted:
            return
        self.counted = True
        self._leave()
        unread, self.unread = self.unread, []
        for store, layer, indices in unread:
            flat = np.array(indices).reshape(-1)
            experts = np.unique(flat).tolist()
            store.resident_uses(layer, experts)
            if self.ledgers is not None:
                served = {e: Served("ram", store.index.expert(layer, e).nbytes, 0.0) for e in experts}
                count_by_row(self.ledgers, flat, served)

    def commit(self, keep: int | None = None) -> int:
        """The cache keeps this pass's tokens, or only the first `keep` of them: trimmed where
        every layer's cache trims, else put back as before the pass (the kept tokens must then
        be fed again). Returns how many of its tokens the cache holds. Uses are not counted here
        (the output may still be computing): `count_uses` does that."""
        self._close("committed")
        rollback, self.rollback = self.rollback, None
        if keep is None or keep == self.fed:
            return self.fed
        if rollback is None:
            raise SpeculationError("a pass without a cache cannot be cut short")
        return rollback.keep(self.fed, keep)

    def discard(self) -> None:
        """Take the pass back out of the cache and forget its uses: it was built for a token
        that is never handed out (generation stopped with a pass built ahead)."""
        self._close("discarded")
        rollback, self.rollback = self.rollback, None
        if rollback is not None:
            rollback.keep(self.fed, 0)
        self.counted = True
        self.unread = []
        self._leave()

    def _close(self, state: str) -> None:
        if self.state != "open":
            raise RuntimeError(f"a forward pass already {self.state} cannot be {state}")
        self.state = state

    def _leave(self) -> None:
        if self._open is not None and self in self._open:
            self._open.remove(self)


def count_by_row(ledgers: list[StoreStats], flat: np.ndarray, served: dict[int, Served]) -> None:
    """Count in each row's ledger the distinct experts its tokens routed to (`flat`: the layer's
    routing, row after row), each under the tier that served it. A routing that does not split
    into the rows (no architecture does so) counts the whole layer's experts for every row
    rather than guessing."""
    per_row, extra = divmod(len(flat), len(ledgers))
    for r, ledger in enumerate(ledgers):
        mine = flat if extra else flat[r * per_row : (r + 1) * per_row]
        for e in np.unique(mine).tolist():
            s = served[e]
            ledger.record(s.source, s.nbytes, s.seconds)
