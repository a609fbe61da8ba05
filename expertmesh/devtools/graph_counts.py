"""Counting what a GPU pays for a forward pass: the kernels it launches and the host syncs it waits
for, read from MLX's own graph on any machine (`expertmesh bench --compute`, tests).

MLX builds a lazy graph and runs it when something forces it: `mx.eval`, `mx.async_eval`, a
read of an array's values (`.item()`, `.tolist()`, `bool()`, a numpy conversion). While a
`GraphCounter` is installed, each forcing call first exports the graph it is about to run
(`mx.export_to_dot`) and counts:

- kernels: the graph's primitives that launch work on a GPU. Views and shape changes launch none
  (`NO_KERNEL`). An `mx.fast` op runs as one kernel on Metal, but on a CPU MLX builds it from
  several primitives; each one called while installed is measured once per shape (its
  decomposition, on fresh inputs) and counted as one;
- syncs: forcing calls that waited for work: a graph with kernels in it, or the values of an
  array handed to `async_eval` and not read since (mlx-lm's pipelined decode reads each token so).
"""

from __future__ import annotations

import re
import tempfile
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from expertmesh.node.model.mlx_lm_models import tree_arrays

# primitives that are views or metadata on Metal: no kernel is launched for them
NO_KERNEL = frozenset(
    {
        "AsStrided",
        "Broadcast",
        "BroadcastAxes",
        "Depends",
        "ExpandDims",
        "Flatten",
        "Reshape",
        "Slice",
        "Split",
        "Squeeze",
        "StopGradient",
        "Transpose",
        "Unflatten",
    }
)
FAST_OPS = ("rms_norm", "layer_norm", "rope", "scaled_dot_product_attention")
FORCING_METHODS = ("item", "tolist", "__bool__")
NUMPY_CONVERSIONS = ("array", "asarray", "ascontiguousarray")
_NODE = re.compile(r'\[label ="([^"]+)", shape=rectangle\]')


def _arrays(args: tuple) -> list[mx.array]:
    return tree_arrays(list(args))


class GraphCounter:
    """Kernels and syncs of everything MLX runs on the installing thread's watch (all threads),
    while installed (`with GraphCounter() as counts: ...`; read `kernels`, `syncs`, `by_kind`)."""

    def __init__(self) -> None:
        self.kernels = 0
        self.syncs = 0
        self.by_kind: Counter[str] = Counter()  # kernels by primitive
        self._fast_sizes: dict[tuple, int] = {}  # a fast op's CPU decomposition, in kernels
        self._fast_extra = 0  # kernels counted for fast ops beyond one each
        self._pending: set[int] = set()  # ids of arrays handed to async_eval, not read since
        self._lock = threading.RLock()  # one forcing call counted at a time, by whichever thread
        self._inside = False  # counting now: forcing calls the counting makes itself are not counted
        self._undo: list[Callable[[], None]] = []
        self._dot = Path(tempfile.mkdtemp(prefix="expertmesh-graph-")) / "graph.dot"

    # -- what MLX is about to run -------------------------------------------------------------

    def _graph(self, arrays: list[mx.array]) -> Counter[str]:
        if not arrays:
            return Counter()
        mx.export_to_dot(str(self._dot), *arrays)
        return Counter(m.group(1) for m in _NODE.finditer(self._dot.read_text()))

    def _forced(self, arrays: list[mx.array], waits: bool) -> None:
        with self._lock:
            if self._inside:
                return
            self._inside = True
            try:
                nodes = self._graph(arrays)
                kernels = {k: n for k, n in nodes.items() if k not in NO_KERNEL}
                self.by_kind.update(kernels)
                self.kernels += sum(kernels.values())
                waited = any(id(a) in self._pending for a in arrays)
                if waits:
                    for a in arrays:
                        self._pending.discard(id(a))
                    if kernels or waited:
                        self.syncs += 1
                else:
                    self._pending.update(id(a) for a in arrays)
            finally:
                self._inside = False

    def _fast(self, name: str, fn: Callable, args: tuple, kwargs: dict) -> mx.array:
        out = fn(*args, **kwargs)
        key = (
            name,
            tuple((tuple(a.shape), a.dtype) if isinstance(a, mx.array) else repr(a) for a in args),
            tuple(
                sorted(
                    (k, (tuple(v.shape), v.dtype) if isinstance(v, mx.array) else repr(v)) for k, v in kwargs.items()
                )
            ),
        )
        with self._lock:
            if self._inside:
                return out
            self._inside = True
            try:
                size = self._fast_sizes.get(key)
                if size is None:
                    fresh = [mx.zeros(a.shape, a.dtype) if isinstance(a, mx.array) else a for a in args]
                    fresh_kw = {
                        k: mx.zeros(v.shape, v.dtype) if isinstance(v, mx.array) else v for k, v in kwargs.items()
                    }
                    mx.eval(*_arrays((fresh, fresh_kw)))
                    nodes = self._graph([fn(*fresh, **fresh_kw)])
                    size = self._fast_sizes[key] = max(1, sum(n for k, n in nodes.items() if k not in NO_KERNEL))
                self._fast_extra += size - 1
            finally:
                self._inside = False
        return out

    @property
    def fast_adjusted_kernels(self) -> int:
        """Kernels with each `mx.fast` op counted once, as on Metal."""
        return self.kernels - self._fast_extra

    # -- installing ---------------------------------------------------------------------------

    def _patch(self, owner, name: str, value) -> None:
        original = getattr(owner, name)
        setattr(owner, name, value)
        self._undo.append(lambda: setattr(owner, name, original))

    def __enter__(self) -> GraphCounter:
        counter = self
        for name, waits in (("eval", True), ("async_eval", False)):
            original = getattr(mx, name)

            def forcing(*args, _original=original, _waits=waits, **kwargs):
                counter._forced(_arrays(args), _waits)
                return _original(*args, **kwargs)

            self._patch(mx, name, forcing)
        for name in FORCING_METHODS:
            original = getattr(mx.array, name)

            def method(a, *args, _original=original, **kwargs):
                counter._forced([a], True)
                return _original(a, *args, **kwargs)

            self._patch(mx.array, name, method)
        for name in NUMPY_CONVERSIONS:
            original = getattr(np, name)

            def conversion(obj, *args, _original=original, **kwargs):
                if isinstance(obj, mx.array):
                    counter._forced([obj], True)
                return _original(obj, *args, **kwargs)

            self._patch(np, name, conversion)
        for name in FAST_OPS:
            original = getattr(mx.fast, name)

            def fast(*args, _original=original, _name=name, **kwargs):
                return counter._fast(_name, _original, args, kwargs)

            self._patch(mx.fast, name, fast)
        return self

    def __exit__(self, *exc) -> None:
        while self._undo:
            self._undo.pop()()
