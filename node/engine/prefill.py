"""A prompt prefilled layer by layer: each MoE layer's experts fetched once for all of its chunks.

mlx-lm feeds a prompt in chunks (`PREFILL_STEP` tokens, then the last token alone), each through
every layer before the next chunk starts. With less expert memory than a layer's union, the next
chunk asks the store again for what the last one evicted: the same experts read again from the
Hub or the disk, once per chunk. Here the chunks go through the model together, layer-major: every
chunk runs up to a MoE layer's expert block and waits there (`park`); when all have arrived, the
layer takes the union of all of their rows' routings, asks the store for each distinct expert
once, computes each group of experts as it is placed with every chunk's rows routed to it, lets
the group go and hands each chunk its output (`run_layer`). Attention still runs chunk by chunk,
in order, so the KV caches and recurrent states see exactly the token-major sequence of updates.

How the chunks wait: each chunk's forward pass is mlx-lm's own model call, run in a greenlet of
its own on the MLX thread (greenlets switch on one OS thread, so MLX's per-thread streams hold).
A model call reads its caches' offsets once at its start to build its masks; a chunk started while
the chunks before it have reached only the first MoE layer would read the offsets of the later
layers' caches too early, so while a chunk starts those caches' offsets are shown as they will be
once every chunk before it has passed (`_offsets_ahead`), then put back.

Exact: each chunk's rows meet each expert group in the same kernels mlx-lm's chunk would (one
`SwitchGLU` call per chunk over the rows of the placed experts, sorted as it sorts), so tokens
equal mlx-lm's.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from greenlet import greenlet

from expertmesh.node.engine.blocks import StreamingExperts
from expertmesh.node.engine.expert_rows import RoutedRows
from expertmesh.node.engine.forward_pass import ForwardPass, building, count_by_row
from expertmesh.node.engine.model_thread import model_thread
from expertmesh.node.engine.prefill_states import ChunkEndStates
from expertmesh.node.errors import ExpertmeshError
from expertmesh.node.store.prefetch import LayerGuess
from expertmesh.node.store.store import Served


@dataclass
class _Parked:
    """One chunk's rows waiting at a layer's expert block."""

    block: StreamingExperts
    x: mx.array
    indices: mx.array
    guess: mx.array | None  # the next layer's routing this chunk guessed, if the layer guessed
    step: ForwardPass | None  # the chunk's forward pass (its ledgers; the blocks read it while inside)


@dataclass
class PrefillProgress:
    """Where a layer-major prompt stands, after each group of experts computed (what `run` and
    `chat` show while a cold prompt fetches its experts)."""

    layer: int  # MoE layers done before this one, 0-based: this is layer `layer + 1` of `layers`
    layers: int
    experts_done: int  # of this layer's union, computed so far
    experts_needed: int  # this layer's union over every chunk
    bytes_read: int  # expert bytes read for the prompt so far, from every tier
    seconds: float  # since the prompt started

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the rate measured so far: the layers still to come take what the
        layers so far took a layer (their unions are known only once they are reached)."""
        done = self.layer + (self.experts_done / self.experts_needed if self.experts_needed else 0.0)
        if done <= 0 or self.seconds <= 0:
            return None
        return self.seconds / done * (self.layers - done)

    def line(self) -> str:
        from expertmesh.node.sizes import format_size

        rate = self.bytes_read / self.seconds if self.seconds > 0 else 0.0
        eta = self.eta_s
        return (
            f"prompt: MoE layer {self.layer + 1}/{self.layers}, experts {self.experts_done}/{self.experts_needed}, "
            f"{format_size(self.bytes_read)} read ({format_size(rate)}/s)"
            + (f", about {eta:.0f} s left" if eta is not None else "")
        )


class LayerMajor:
    """Set on every expert block while a prompt is prefilled layer-major (`StreamingExperts._prefill`)."""

    def __init__(self, layers: int, progress: Callable[[PrefillProgress], None] | None = None):
        self.layers, self.progress = layers, progress
        self.done = 0  # MoE layers run
        self.t0 = time.perf_counter()
        self.before: dict[str, int] | None = None  # the store's bytes by tier when the prompt started
        self.approx: Any = None  # an approximate prompt's (engine/prompt_experts.py's Approximation)

    def report(self, store, experts_done: int, experts_needed: int) -> None:
        if self.progress is None:
            return
        if self.before is None:
            self.before = dict(store.stats.bytes)
        read = sum(store.stats.bytes[s] - self.before.get(s, 0) for s in ("hub", "disk", "peer"))
        self.progress(
            PrefillProgress(self.done, self.layers, experts_done, experts_needed, read, time.perf_counter() - self.t0)
        )

    def park(self, block: StreamingExperts, x: mx.array, indices: mx.array) -> mx.array:
        """Called by `block` in place of its own call: wait for the other chunks, return this one's output."""
        step = building()  # this chunk's pass: each greenlet has a context of its own
        nxt = block._next[0].layer if block._next is not None else None
        guess = step.guesses.pop(nxt, None) if step is not None and nxt is not None else None
        parent = greenlet.getcurrent().parent
        if parent is None:
            raise RuntimeError("a layer-major prefill's block was called outside a chunk's greenlet")
        return parent.switch(_Parked(block, x, indices, guess, step))


def usable(blocks: list[StreamingExperts]) -> bool:
    """Whether a prompt may be prefilled layer-major on these blocks: each bound to a store."""
    return bool(blocks) and all(b.store is not None for b in blocks)


def prefill(
    forward: Callable[[mx.array], ForwardPass],
    blocks: list[StreamingExperts],
    chunks: list[list[int]],
    cache: list,
    progress: Callable[[PrefillProgress], None] | None = None,
    approx: Any = None,
    states: ChunkEndStates | None = None,
) -> list[ForwardPass]:
    """Every chunk's forward pass, in order, each fed through `forward` (the streamed model's
    pass over `cache`) layer-major, as the module says; the caller commits them. `chunks` in the
    order mlx-lm feeds them; `progress` is told where the prompt stands after each group of experts."""
    prompt = LayerMajorPrefill(forward, blocks, chunks, cache, progress, approx, states)
    while not prompt.advance():
        pass
    assert prompt.passes is not None
    return prompt.passes


class LayerMajorPrefill:
    """A layer-major prompt that advances one MoE layer a call (`advance`): its chunks run up to
    the next expert block and that layer's experts are computed for all of them. Between two
    calls nothing of the prompt holds the blocks or the store, so a batch's decode steps run
    between its layers (engine/batching.py); `prefill` runs it to its end in one go.

    MLX thread only; every call, `close` included, on the thread that made it (greenlets)."""

    def __init__(
        self,
        forward: Callable[[mx.array], ForwardPass],
        blocks: list[StreamingExperts],
        chunks: list[list[int]],
        cache: list,
        progress: Callable[[PrefillProgress], None] | None = None,
        approx: Any = None,
        states: ChunkEndStates | None = None,
    ):
        self.blocks, self.cache, self.chunks = blocks, cache, chunks
        self.states = states  # the cache's state at the end of chunks a prefix checkpoint ends
        self._lengths = [len(c) for c in chunks]
        self._base = _offsets(cache)
        self.gatherer = LayerMajor(len(blocks), progress)
        self.gatherer.approx = approx  # None: exact, as mlx-lm
        if progress is not None and blocks and blocks[0].store is not None:
            self.gatherer.before = dict(blocks[0]._bound_store().stats.bytes)
        self._lets = [greenlet(lambda c=c: forward(mx.array(c)[None])) for c in chunks]
        self._sent: list[mx.array | None] = [None] * len(chunks)
        self._done: list[ForwardPass | None] = [None] * len(chunks)
        self._live = list(range(len(chunks)))
        self._waiting: list[ForwardPass] = []  # the chunks' passes, parked between two calls
        self._started = False
        self.passes: list[ForwardPass] | None = None  # every chunk's pass, in order, once all are done

    def advance(self) -> bool:
        """Every chunk on to its next MoE layer, and that layer's experts for all of them;
        True once every chunk's pass is done (`passes`). An error closes the prompt."""
        if self.passes is not None:
            return True
        for step in self._waiting:
            step.waiting = False
        for block in self.blocks:
            block._set("_prefill", self.gatherer)
        try:
            done = self._layer()
        except BaseException:
            self.close()
            raise
        finally:
            for block in self.blocks:
                block._set("_prefill", None)
        return done

    def close(self) -> None:
        """Unwind the chunks still waiting (a caller that left, an error): on the MLX thread."""
        for let in self._lets:
            if not let.dead:
                let.throw()
        for step in self._waiting:
            step.waiting = False
        self._waiting = []

    def _layer(self) -> bool:
        parked: list[tuple[int, _Parked]] = []
        for i in self._live:
            first = not self._started
            if self.states is not None:  # outside the offsets moved ahead below, which are put back
                self.states.before_turn(i)
            sent, self._sent[i] = self._sent[i], None  # the chunk holds its output; the next layer's is as large
            with _offsets_ahead(self.cache, self._base, sum(self._lengths[:i])) if first and i else _nothing():
                out = self._lets[i].switch() if first else self._lets[i].switch(sent)
            del sent
            if self.states is not None:
                self.states.after_turn(i)
            if self._lets[i].dead:
                self._done[i] = out
            elif isinstance(out, _Parked):
                parked.append((i, out))
            else:
                raise RuntimeError("a layer-major prefill's chunk switched back with something else")
        self._started = True
        if not parked:
            done = [p for p in self._done if p is not None]
            if len(done) != len(self.chunks):
                raise RuntimeError("a layer-major prefill's chunks did not all finish")
            self.passes, self._waiting = done, []
            return True
        if len(parked) != len(self._live) or len({id(p.block) for _, p in parked}) != 1:
            raise ExpertmeshError("a layer-major prefill's chunks reached different layers: the model's passes differ")
        self._waiting = [p.step for _, p in parked if p.step is not None]
        ys = run_layer(parked[0][1].block, [p for _, p in parked])
        self.gatherer.done += 1
        for (i, _), y in zip(parked, ys):
            self._sent[i] = y
        self._live = [i for i, _ in parked]
        for step in self._waiting:
            step.waiting = True  # counted once done (StreamedModel.count_open leaves it alone)
        return False


def _offsets(cache: list) -> list[int | None]:
    return [c.offset if isinstance(getattr(c, "offset", None), int) else None for c in cache]


@contextmanager
def _nothing() -> Iterator[None]:
    yield


@contextmanager
def _offsets_ahead(cache: list, base: list[int | None], before: int) -> Iterator[None]:
    """While a chunk starts (builds its masks), every cache the chunks before it have not reached
    yet shows the offset it will have once they have: `base` (the offsets before the prompt) plus
    the `before` tokens of those chunks. A cache that has been reached is left as it is."""
    moved = []
    for c, b in zip(cache, base):
        if b is not None and c.offset < b + before:
            moved.append((c, c.offset))
            c.offset = b + before
    try:
        yield
    finally:
        for c, true in moved:
            c.offset = true


def run_layer(block: StreamingExperts, parts: list[_Parked]) -> list[mx.array]:
    """One expert layer over every chunk's rows: the union's experts fetched once, each group
    computed with all of the chunks' rows routed to it as soon as it is placed, then let go."""
    store = block._bound_store()
    gatherer = block._prefill
    block._set("_prefill", None)  # the block's own call, for a layer whose experts are all resident
    try:
        if all(p.step is not None for p in parts) and store.ram.slot_map(block.layer) is not None:
            if gatherer is not None and gatherer.approx is not None:
                gatherer.approx.skip(block, parts)  # every expert held: nothing to approximate
            return [_own_call(block, p) for p in parts]
    finally:
        block._set("_prefill", gatherer)
    guesses = [p.guess for p in parts if p.guess is not None]
    if gatherer is not None and gatherer.approx is not None:
        guesses = []  # an approximate prompt would not use much of what a guess fetches
    # the layer's one sync; the guesses ride on it, and so do the rows a household reads on the
    # host to send to peers (engine/expert_rows.py)
    mx.eval(*[p.indices for p in parts], *guesses, *([p.x for p in parts] if block._remote is not None else []))
    model_thread().between_layers()
    scales: list = [None] * len(parts)
    dropped: list[np.ndarray | None] = [None] * len(parts)
    if gatherer is not None and gatherer.approx is not None:  # an approximate prompt's rows rerouted
        parts, scales, dropped = gatherer.approx.rewrite(block, store, parts)
    flats = [np.array(p.indices).reshape(-1) for p in parts]
    experts = np.unique(np.concatenate(flats)).tolist()
    next_guess: LayerGuess | None = None
    if guesses and block._next is not None:
        next_guess = LayerGuess(
            block._next[0].layer,
            np.unique(np.concatenate([np.array(g).reshape(-1) for g in guesses])).tolist(),
            sum(f.size for f in flats) // parts[0].indices.shape[-1],
        )
    served: dict[int, Served] = {}
    if block._remote is not None:  # the household: every chunk's rows of an expert in one call per peer
        ys, served = _remote_layer(block, parts, flats, experts, next_guess)
        store.stats.record_layer("streamed")
        return _finish(block, parts, flats, ys, served, scales)
    groups = store.layer_groups(block.layer, experts, guess=next_guess)
    first = next(groups)
    if len(first.served) == len(experts):  # one group holds the union: mlx-lm's call per chunk
        with first.placed() as placed:
            ys = [block.compute(placed, p.x, f.reshape(p.indices.shape)) for p, f in zip(parts, flats)]
        served.update(first.served)
        if gatherer is not None:
            gatherer.report(store, len(experts), len(experts))
    else:
        report = (lambda n: gatherer.report(store, n, len(experts))) if gatherer is not None else None
        ys = _by_groups(block, store, parts, flats, itertools.chain([first], groups), served, report, dropped)
    store.stats.record_layer("streamed")
    return _finish(block, parts, flats, ys, served, scales)


def _finish(
    block: StreamingExperts,
    parts: list[_Parked],
    flats: list[np.ndarray],
    ys: list[mx.array],
    served: dict,
    scales: list[mx.array | None],
) -> list[mx.array]:
    """Each chunk's output in the block's shape, its uses counted in a batch's ledgers, an
    approximate prompt's dropped choices scaled to 0 (`scales`)."""
    ledgers = parts[0].step.ledgers if parts[0].step is not None else None  # the chunks' passes share them
    if ledgers is not None:
        for f in flats:
            count_by_row(ledgers, f, served)
    outs = [y.reshape(*p.indices.shape, block.output_dims) for y, p in zip(ys, parts)]
    return [y if s is None else y * s for y, s in zip(outs, scales)]  # dropped choices to 0


def _own_call(block: StreamingExperts, part: _Parked) -> mx.array:
    """The block's own call over one chunk's rows, inside that chunk's pass (where the block
    counts a resident layer's uses)."""
    assert part.step is not None
    with part.step.entered():
        return block(part.x, part.indices)


class _ChunkOutputs:
    """A household prompt's layer outputs, written into each chunk's one output array as each part
    of an expert's rows is made here or answered by a peer (RemoteExperts.run_into).

    A part waits for nothing: put in place (a scatter whose input nothing else holds reuses its
    buffer) and evaluated once `FLUSH_BYTES` of parts are pending, it is let go, so the layer
    holds its outputs once, not every peer's answers besides until the last comes."""

    FLUSH_BYTES = 16 << 20

    def __init__(
        self, parts: list[_Parked], orders: list[np.ndarray], spans: list[dict[int, tuple[int, int]]], width: int
    ):
        self._orders, self._width = orders, width
        self._dtypes = [p.x.dtype for p in parts]
        self.ys: list[mx.array | None] = [None] * len(parts)
        # expert -> (chunk, where its rows of that chunk start among all of its rows, span in the chunk's order)
        self._where: dict[int, list[tuple[int, int, int, int]]] = {}
        for i, s in enumerate(spans):
            for e, (a, b) in s.items():
                at = self._where.setdefault(e, [])
                start = at[-1][1] + (at[-1][3] - at[-1][2]) if at else 0
                at.append((i, start, a, b))
        self._pending = 0

    def put(self, expert: int, first: int, rows: mx.array) -> None:
        end = first + rows.shape[0]
        for i, start, a, b in self._where[expert]:
            lo, hi = max(first, start), min(end, start + b - a)
            if lo >= hi:
                continue
            y = self.ys[i]
            if y is None:
                y = mx.zeros((len(self._orders[i]), self._width), dtype=rows.dtype)
            y[mx.array(self._orders[i][a + lo - start : a + hi - start])] = rows[lo - first : hi - first]
            self.ys[i] = y
        self._pending += rows.nbytes
        if self._pending >= self.FLUSH_BYTES:
            self.flush()

    def drop(self, expert: int) -> None:
        """Nothing to forget: an expert put again, whole, overwrites its rows."""

    def flush(self) -> None:
        mx.eval([y for y in self.ys if y is not None])
        self._pending = 0

    def finished(self) -> list[mx.array]:
        self.flush()
        return [
            y if y is not None else mx.zeros((len(o), self._width), dtype=d)
            for y, o, d in zip(self.ys, self._orders, self._dtypes)
        ]


def _remote_layer(
    block: StreamingExperts, parts: list[_Parked], flats: list[np.ndarray], experts: list[int], guess: LayerGuess | None
) -> tuple[list[mx.array], dict[int, Served]]:
    """The layer through the household's remote execution (RemoteExperts.run_into) once for the
    whole prompt: each expert's rows from every chunk together, so a peer that holds experts gets
    one ComputeExperts call a layer with all of the prompt's rows for them (in calls within
    `max_call_bytes`), placed by the cost model with the prompt's row counts.

    Each expert's rows are gathered from the chunks' inputs as they are sent or computed
    (`RoutedRows`), and each part of its outputs written in place into its chunks' output
    arrays as it comes (`_ChunkOutputs`), as `_by_groups` does: no sorted copy of every chunk's
    (row, choice) pairs first, and no concatenation and reordering after."""
    remote = block._remote
    assert remote is not None
    k = parts[0].indices.shape[-1]
    orders = [np.argsort(f, kind="stable") for f in flats]  # per chunk: its pairs, grouped by expert
    spans: list[dict[int, tuple[int, int]]] = []  # per chunk: expert -> its pairs' span in that order
    picks: dict[int, list[tuple[int, np.ndarray]]] = {}  # expert -> (chunk, its rows there) for each chunk
    for i, (f, order) in enumerate(zip(flats, orders)):
        ids, starts, counts = np.unique(f[order], return_index=True, return_counts=True)
        spans.append({int(e): (int(a), int(a + n)) for e, a, n in zip(ids, starts, counts)})
        for e, (a, b) in spans[-1].items():
            picks.setdefault(e, []).append((i, order[a:b] // k))
    outputs = _ChunkOutputs(parts, orders, spans, block.output_dims)
    rows = RoutedRows([p.x for p in parts], dict(sorted(picks.items())))
    served = remote.run_into(block, experts, rows, guess, outputs)
    return outputs.finished(), served


def _by_groups(
    block,
    store,
    parts: list[_Parked],
    flats: list[np.ndarray],
    groups,
    served: dict,
    report: Callable[[int], None] | None = None,
    dropped: list[np.ndarray | None] | None = None,
) -> list[mx.array]:
    """More experts than memory holds: each group, as it is placed, over every chunk's rows routed
    to it (grouped by expert), computed, then let go for the next group.

    A prompt's (row, choice) pairs are many (2,048 rows x K3's 16 choices a chunk, every chunk at
    once), each as wide as an expert's input and output. So a group gathers only its own pairs'
    rows, and writes its output into the chunk's one output array in place (a scatter whose input
    nothing else holds reuses its buffer): no gathered copy of every pair's input, and no
    concatenation and reordering of every pair's output at the end.

    `dropped[i]` (an approximate prompt's): chunk i's (row, choice) entries that are not computed
    at all; they sort after every expert, so no group takes them, and their output stays 0."""
    beyond = block.num_experts  # an id past every expert's
    keys = [f if d is None else np.where(d, beyond, f) for f, d in zip(flats, dropped or [None] * len(flats))]
    orders = [np.argsort(k, kind="stable") for k in keys]
    by_expert = [k[o] for k, o in zip(keys, orders)]
    inputs = [p.x.reshape(-1, p.x.shape[-1]) for p in parts]
    outs: list[mx.array | None] = [None] * len(parts)
    for group in groups:
        lo, hi = min(group.served), max(group.served)
        with group.placed() as placed:
            made = []
            for i, (e, order, p) in enumerate(zip(by_expert, orders, parts)):
                a, b = int(np.searchsorted(e, lo)), int(np.searchsorted(e, hi, side="right"))
                if b > a:
                    pairs = order[a:b]
                    x_rows = inputs[i][mx.array(pairs // p.indices.shape[-1])]
                    y = block.compute(placed, x_rows, e[a:b, None]).reshape(b - a, -1)
                    if outs[i] is None:
                        outs[i] = mx.zeros((len(order), y.shape[-1]), dtype=y.dtype)
                    outs[i][mx.array(pairs)] = y  # type: ignore[index]
                    made.append(outs[i])
            mx.eval(made)  # computed now, so this group's slots can go to the next one
        served.update(group.served)
        if report is not None:
            report(len(served))
    return [
        o if o is not None else mx.zeros((len(order), block.output_dims), dtype=p.x.dtype)
        for o, order, p in zip(outs, orders, parts)
    ]
