"""A streamed layer's input rows for each routed expert: on the device for a compute here, on the
host for a peer's call.

Remote expert execution (node/household/remote_experts.py) sends a peer the rows routed to each
expert it computes there. Gathered on the device and then read, each expert's rows cost a gather
kernel and a host sync of their own before they can be encoded: a sync per remote expert per
layer, up to K3's 16 a layer over 93 layers a token. The layer's inputs are already on the
host's side of that line when its routing is read (the layer's one sync evaluates them, and
Apple Silicon's memory is shared), so a peer's rows are gathered by numpy from one view of them:
no kernel and no wait for the device per expert. Rows computed here are gathered on the device as
before, and only when asked for, so a prompt's rows (top-k a token, as wide as the model) are
never all alive at once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import mlx.core as mx
import numpy as np

from expertmesh.node.engine.host_view import host_view


class RoutedRows(Mapping[int, mx.array]):
    """Expert e's rows: `picks[e]` names, for each input that routes rows to it, those rows (in
    the order e's outputs come back in). `rows[e]` gathers them on the device each time it is
    asked and keeps nothing; `host(e)` gathers them on the host."""

    def __init__(self, inputs: list[mx.array], picks: dict[int, list[tuple[int, np.ndarray]]]):
        self._given = inputs
        self._inputs = [x.reshape(-1, x.shape[-1]) for x in inputs]
        self._picks = picks
        self._hosts: dict[int, np.ndarray] = {}

    @property
    def dtype(self) -> mx.Dtype:
        return self._inputs[0].dtype

    @property
    def width(self) -> int:
        return self._inputs[0].shape[-1]

    def count(self, e: int) -> int:
        """How many rows are routed to expert e (nothing gathered)."""
        return sum(len(rows) for _, rows in self._picks[e])

    def __getitem__(self, e: int) -> mx.array:
        pieces = [self._inputs[i][mx.array(rows)] for i, rows in self._picks[e]]
        return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=0)

    def host(self, e: int) -> np.ndarray:
        """Expert e's rows as a C-ordered numpy array, bfloat16 (which numpy lacks) as its 16-bit
        patterns. The first ask of an input evaluates it if its layer's sync did not."""
        pieces = [self._host_input(i)[rows] for i, rows in self._picks[e]]
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=0)

    def row_ids(self, e: int) -> np.ndarray:
        """Expert e's rows as ids over all inputs (row r of input i is input i's first id + r), in
        the order `host(e)` gives them: a token routed to several experts has one id."""
        starts = self._starts()
        pieces = [starts[i] + np.asarray(rows, dtype=np.int64) for i, rows in self._picks[e]]
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def host_rows(self, ids: np.ndarray) -> np.ndarray:
        """The rows with these ids (`row_ids`), in order, gathered on the host as `host` does."""
        starts = self._starts()
        which = np.searchsorted(starts, ids, side="right") - 1
        first = self._host_input(int(which[0]))
        out = np.empty((len(ids), first.shape[-1]), dtype=first.dtype)
        for i in np.unique(which).tolist():
            at = which == i
            out[at] = self._host_input(i)[ids[at] - starts[i]]
        return out

    def _starts(self) -> np.ndarray:
        return np.cumsum([0] + [x.shape[0] for x in self._inputs[:-1]], dtype=np.int64)

    def _host_input(self, i: int) -> np.ndarray:
        if i not in self._hosts:
            host = host_view(self._given[i])
            self._hosts[i] = host.reshape(-1, host.shape[-1])
        return self._hosts[i]

    def __iter__(self) -> Iterator[int]:
        return iter(self._picks)

    def __len__(self) -> int:
        return len(self._picks)


class GroupedRows(RoutedRows):
    """A decode step's rows: few, so every routed row is gathered on the device at once, grouped
    by expert (one gather kernel a layer, not one an expert), and `rows[e]` is a slice of that."""

    def __init__(self, x: mx.array, flat: np.ndarray, k: int):
        """`flat`: the routing of `x`'s rows, `k` choices a row, as one flat array of expert ids."""
        self.order = np.argsort(flat, kind="stable")  # the (row, choice) pairs, grouped by expert
        self._sources = self.order // k  # each pair's row of x
        experts, starts, counts = np.unique(flat[self.order], return_index=True, return_counts=True)
        self._spans = {e: (a, a + n) for e, a, n in zip(experts.tolist(), starts.tolist(), counts.tolist())}
        super().__init__([x], {e: [(0, self._sources[a:b])] for e, (a, b) in self._spans.items()})
        self._grouped: mx.array | None = None

    def __getitem__(self, e: int) -> mx.array:
        if self._grouped is None:
            self._grouped = self._inputs[0][mx.array(self._sources)]
        a, b = self._spans[e]
        return self._grouped[a:b]
