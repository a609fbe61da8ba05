"""Continuous batching: several generations share every forward pass, so each step asks the store
once per MoE layer for the union of the batch's experts and computes each expert on all of its
rows together (engine/blocks.py already does so for any number of rows). The batch hands each
pass its rows' ledgers (`StreamedModel.forward(..., ledgers=...)`).

Sequences join and leave between steps. The machinery is mlx-lm's own: every cache of the model
is merged into its batched form (`KVCache.merge` -> `BatchKVCache` with left padding,
`ArraysCache.merge` for Kimi's KDA state), rows are added with `extend` and dropped with `filter`,
exactly as `mlx_lm.generate.BatchGenerator` does. What differs from BatchGenerator, and why:

- a joining request is prefilled alone, in its own cache, then merged into the batch. Its prompt
  and its first token therefore go through the very steps `Generator._plain` takes (chunks, then
  the last token alone), so they are what the request would get alone; BatchGenerator prefills
  several prompts together with right padding instead. Each turn also runs one decode step of the
  batch, so a long prompt delays the running conversations by a part of it per step, never by
  its whole length. Where experts stream, a joiner's prompt goes layer-major, as the Generator's
  does (engine/prefill.py: its chunks together, each of a MoE layer's distinct experts fetched
  once for the whole prompt) and one MoE layer of it a turn: the running rows decode one token
  between two of its layers. The other way round — the prompt fed in `prefill_step`-token turns,
  each through every layer — asks the store again, per turn, for what the turn before evicted:
  with less RAM than a layer's union, a prompt of n turns read its experts about n times, and
  each turn of a cold prompt waited for nearly a whole union's bytes; a layer of the whole
  prompt waits for that layer's union once. Where every expert is resident (nothing to fetch)
  or the core streams, the prompt is fed in `prefill_step`-token turns, as mlx-lm's chunks;
- no `async_eval` pipelining: a MoE layer whose experts must be fetched synchronises to learn its
  routing anyway, and computing step n+1 before handing out step n's tokens would cost each
  finished sequence a forward pass (and its experts) that nobody reads, and each new one a step of
  time to first token;
- each row samples with its own sampler, and a seeded one carries its own random key, split as
  MLX's global key is after `mx.random.seed`: a seeded request samples what it would alone.

Each turn (one decode step plus the joiners' prefill) is one task on the process's MLX thread
(engine/model_thread.py), so peers' calls keep their turns between steps. Callers' threads only
wait on their own queue of tokens. Speculative decoding does not run inside a batch: a verify pass
of k drafts per row would make rows of different lengths in one step, and rolling each row of a
batched KDA state back to its own accepted prefix is not built. So a node speculates a request
only while it runs alone (NodeService routes it past the batch: the usual case at home, one person
asking); requests that come meanwhile form the batch, and the two take turns on the MLX thread.

Expert uses in a batch: a request's `GenerationSummary.experts` counts, by source, the experts its
own tokens routed to — per MoE layer of every forward pass it took part in, each under the source
that served the step — so its total is what it counts alone (where its prompt is fed in the same
chunks: a prompt longer than `prefill_step` routes per chunk). The store fetches a step's
union once: an expert two rows share is one fetch and one use in each of their summaries, so
summaries of a batch add up to more than the node's counters. The other counters of the summary
(prefetched guesses, remote calls, waits) are the node's over the request's lifetime.

Equality: greedy tokens in a batch equal the tokens alone in float32 (tests/test_batching.py):
masked positions add exact zeros, but a row's matmuls run among other rows, so its logits may
differ from its alone logits in the last bits. In BF16 those last bits are ~1e-2 relative, and a
near tie between the two best tokens can flip, as it can between any two kernel shapes.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import CacheList, make_prompt_cache

from expertmesh.node.config import DEFAULT_MAX_BATCH
from expertmesh.node.engine.forward_pass import ForwardPass
from expertmesh.node.engine.generation import (
    ContextLengthError,
    EmptyPromptError,
    GenerationSummary,
    Token,
    _TokenBook,
    backend_error,
    checkpoint_chunk_ends,
    marked_chunks,
    observe_prefix,
    observe_request,
    prefills_layer_major,
)
from expertmesh.node.engine.model_thread import model_thread
from expertmesh.node.engine.prefill import LayerMajorPrefill
from expertmesh.node.engine.prefill_states import ChunkEndStates
from expertmesh.node.engine.prefix_cache import PrefixSession
from expertmesh.node.engine.sampling import Decoder, SamplingSettings
from expertmesh.node.engine.streamed_model import StreamedModel
from expertmesh.node.errors import ExpertmeshError
from expertmesh.node.store.stats import StoreStats

logger = logging.getLogger(__name__)

BATCH_PREFILL_STEP = 256  # prompt tokens per turn while others decode: a turn stays a few steps long


class BatchingUnsupported(ExpertmeshError):
    """The model has a cache mlx-lm cannot batch (no `merge`)."""


def _unmergeable(cache) -> set[str]:
    """The kinds of cache in `cache` mlx-lm cannot merge into a batch (inside a CacheList too:
    its `merge` merges each of its caches, and fails on the first that cannot)."""
    if isinstance(cache, CacheList):
        return set().union(*(_unmergeable(c) for c in cache.caches))
    return set() if hasattr(cache, "merge") else {type(cache).__name__}


def check_batchable(model: nn.Module) -> None:
    """Raises BatchingUnsupported unless every cache of `model` can be merged into a batch."""
    caches = make_prompt_cache(model)
    missing = sorted(set().union(*(_unmergeable(c) for c in caches)))
    if missing:
        raise BatchingUnsupported(f"mlx-lm cannot batch this model's {', '.join(missing)}: one request at a time")


@dataclass
class _Done:
    error: BaseException | None = None


@dataclass
class _Sequence:
    """One request inside the engine, as its caller made it."""

    prompt: list[int]
    settings: SamplingSettings
    should_stop: Callable[[], bool]
    summary: GenerationSummary
    t0: float
    out: queue.Queue[Token | _Done] = field(default_factory=queue.Queue)
    left: bool = False  # the caller stopped reading: drop it at the next turn
    uses: StoreStats = field(default_factory=StoreStats)  # the experts its own tokens routed to
    prefix: PrefixSession | None = None


@dataclass
class _Run:
    """A sequence admitted to the batch: what the MLX thread keeps of it (touched there only)."""

    seq: _Sequence
    book: _TokenBook
    decoder: Decoder  # its processors and sampler: a seeded one with a key of its own
    before: StoreStats  # the store's counters when it was admitted
    todo: list[int]  # prompt tokens not yet fed
    cache: list | None  # its own cache while it prefills
    fed: int = 0  # tokens its cache has seen
    next_token: int = 0  # fed at the next decode step
    history: list[int] = field(default_factory=list)  # the tokens its cache has seen (with a prefix cache)
    layer_major: LayerMajorPrefill | None = None  # its prompt part-way, layer-major
    chunk_ends: dict[int, int] = field(default_factory=dict)  # its prompt's chunks that end at a checkpoint


class BatchEngine:
    """Runs every generation of one streamed model in one continuous batch of at most `max_batch`
    sequences; more wait in arrival order (GenerationSlots in node/service.py admits no more
    than that, so the wait here is short).

    `layer_major_prefill` (on by default) may be turned off to feed a streamed prompt in
    `prefill_step`-token turns even where experts stream (tests compare the two)."""

    layer_major_prefill = True

    def __init__(self, sm: StreamedModel, max_batch: int = DEFAULT_MAX_BATCH, prefill_step: int = BATCH_PREFILL_STEP):
        """Raises BatchingUnsupported when the model's caches cannot be batched."""
        if max_batch < 1 or prefill_step < 1:
            raise ValueError("max_batch and prefill_step must be at least 1")
        model_thread().call(check_batchable, sm.model)
        self.sm, self.max_batch, self.prefill_step = sm, max_batch, prefill_step
        self._cond = threading.Condition()
        self._pending: deque[_Sequence] = deque()
        self._closing = False
        # the MLX thread's own state (the driver only reads the sizes between turns)
        self._prefilling: list[_Run] = []
        self._rows: list[_Run] = []
        self._cache: list | None = None
        self.steps = 0  # decode steps so far
        self._thread = threading.Thread(target=self._drive, name="expertmesh-batch", daemon=True)
        self._thread.start()

    # -- the callers' side --------------------------------------------------------------------

    def generate(
        self,
        tokens: list[int],
        settings: SamplingSettings,
        should_stop: Callable[[], bool] = lambda: False,
        summary: GenerationSummary | None = None,
        prefix: PrefixSession | None = None,
    ) -> Iterator[Token]:
        """`Generator.generate` for one request of a fresh conversation, run in the batch
        (`prefix`: its row starts from a stored prefix, as `Generator.generate`'s does).

        Raises:
            ValueError: no prompt tokens.
            ContextLengthError: the prompt leaves no room for an answer.
            ExpertmeshError: what the forward pass raised (a download that failed ...).
        """
        if not tokens:
            raise EmptyPromptError("nothing to generate from: the prompt has no tokens")
        limit = self.sm.max_context
        if limit is not None and len(tokens) >= limit:
            raise ContextLengthError(
                f"the prompt is {len(tokens)} tokens and this model's context is {limit}: "
                "it leaves no room for an answer; shorten it"
            )
        summary = summary if summary is not None else GenerationSummary()
        if summary.routed is None:
            summary.routed = StoreStats()
        seq = _Sequence(
            list(tokens), settings, should_stop, summary, time.perf_counter(), uses=summary.routed, prefix=prefix
        )
        with self._cond:
            if self._closing:
                raise ExpertmeshError("the node is stopping: no new generation")
            self._pending.append(seq)
            self._cond.notify_all()
        try:
            while True:
                item = seq.out.get()
                if isinstance(item, _Done):
                    if item.error is not None:
                        raise item.error
                    return
                yield item
        finally:
            with self._cond:
                seq.left = True
                self._cond.notify_all()

    def waiting(self) -> int:
        """Sequences queued for a row, not admitted yet."""
        with self._cond:
            return len(self._pending)

    def active(self) -> int:
        """Sequences decoding or prefilling now (read between turns: approximate)."""
        return len(self._rows) + len(self._prefilling)

    def close(self) -> None:
        """Stop after the turn running now; generations still in the engine end with an error."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(30.0)

    # -- the driver ---------------------------------------------------------------------------

    def _drive(self) -> None:
        while True:
            with self._cond:
                while not self._closing and not self._pending and not (self._rows or self._prefilling):
                    self._cond.wait()
                if self._closing:
                    break
            try:
                model_thread().call(self._turn)
            except RuntimeError:  # the MLX thread stopped: the process is exiting
                break
            except Exception as e:  # a bug outside a step: no caller may wait forever on it
                logger.exception("a batch turn failed; its generations end with the error")
                self._fail_all(e)
        with self._cond:
            self._closing = True  # no new generation may wait on a driver that is gone
        self._fail_all(ExpertmeshError("the node stopped before this generation ended"))

    def _fail_all(self, error: BaseException) -> None:
        """End every generation in the engine with `error` (between turns only)."""
        with self._cond:
            waiting = list(self._pending) + [run.seq for run in self._prefilling + self._rows]
            self._pending.clear()
        self._prefilling, self._rows, self._cache = [], [], None
        for seq in waiting:
            seq.out.put(_Done(error))

    # -- one turn, on the MLX thread ----------------------------------------------------------

    def _turn(self) -> None:
        """Joiners' prefill first (a short prompt's first token then waits for no decode step),
        then one decode step of every row, the rows that just joined included."""
        self._admit()
        self._drop_leavers()
        budget = self.prefill_step
        while self._prefilling and budget > 0:
            run = self._prefilling[0]
            try:
                budget -= self._prefill(run, budget)
            except Exception as e:  # noqa: BLE001 - only this request fails
                if run in self._prefilling:
                    self._prefilling.remove(run)
                _close_prompt(run)
                self._fail(run, e)
        if self._rows:
            try:
                self._decode()
            except Exception as e:  # noqa: BLE001 - every row of the failed step gets it
                rows, self._rows, self._cache = self._rows, [], None
                for run in rows:
                    self._fail(run, e)

    def _admit(self) -> None:
        started: list[_Sequence] = []
        with self._cond:
            while self._pending and len(self._rows) + len(self._prefilling) + len(started) < self.max_batch:
                seq = self._pending.popleft()
                if not seq.left:
                    started.append(seq)
        for seq in started:
            sm = self.sm
            sm.count_open()  # what an earlier pass used is not this request's
            before = sm.store.stats.snapshot()
            detok = sm.tokenizer.detokenizer  # a copy per caller
            detok.reset()
            book = _TokenBook(
                seq.summary,
                seq.settings,
                sm.token_observer,
                set(sm.tokenizer.eos_token_ids),
                detok,
                functools.partial(_stopped, seq),
                seq.t0,
            )
            cache, reused = seq.prefix.start() if seq.prefix is not None else (None, 0)
            cache = cache if cache is not None else make_prompt_cache(sm.model)
            decoder = Decoder(seq.settings, seq.prompt, keyed=True)
            run = _Run(seq, book, decoder, before, seq.prompt[reused:], cache, fed=reused)
            seq.summary.prompt_tokens, seq.summary.cached_tokens = len(run.todo), reused
            if seq.prefix is not None:
                seq.prefix.plan(cache)
                run.history = seq.prompt[:reused]
            if sm.token_observer is not None:
                sm.token_observer.prompt(len(run.todo))
            if seq.prefix is not None:
                observe_prefix(sm.token_observer, reused)
            self._prefilling.append(run)

    def _drop_leavers(self) -> None:
        """Rows whose caller left or asked to stop go before the step (their tokens would be for nobody)."""
        for run in [r for r in self._prefilling if _stopped(r.seq)]:
            self._prefilling.remove(run)
            _close_prompt(run)
            self._finish(run, "interrupted")
        keep = [i for i, r in enumerate(self._rows) if not _stopped(r.seq)]
        if len(keep) < len(self._rows):
            for i, run in enumerate(self._rows):
                if i not in keep:
                    self._finish(run, "interrupted")
            self._filter(keep)

    def _decode(self) -> None:
        """One token for every row: one forward pass over the batch."""
        rows = self._rows
        tokens = mx.array([[r.next_token] for r in rows])
        step = self.sm.forward(tokens, self._cache, ledgers=[r.seq.uses for r in rows])
        step.commit()
        logits = step.logits[:, -1, :]
        mx.eval(logits)
        step.count_uses()  # the pass's uses are in its rows' ledgers before a token is handed out
        self.steps += 1
        observe = getattr(self.sm.token_observer, "batch", None)
        if observe is not None:
            observe(len(rows))
        keep = []
        for i, run in enumerate(rows):
            run.fed += 1
            if run.seq.prefix is not None:
                run.history.append(run.next_token)
            try:
                goes_on = self._emit(run, logits[i : i + 1])
            except Exception as e:  # noqa: BLE001 - a row's own sampling (its grammar failed): only it fails
                self._fail(run, e)
                goes_on = False
            if goes_on:
                keep.append(i)
        if len(keep) < len(rows):
            self._filter(keep)

    def _prefill(self, run: _Run, budget: int) -> int:
        """Feed up to `budget` of the run's prompt as `Generator._prefill` does (all but the last
        token in chunks, then the last alone, which gives the first token); returns tokens fed."""
        sm = self.sm
        prefix = run.seq.prefix
        if run.layer_major is not None or (len(run.todo) > 1 and self.layer_major_prefill and prefills_layer_major(sm)):
            self._prefill_layer(run)
            return budget  # a layer of a whole prompt is the turn's share
        if len(run.todo) > 1:
            n = min(budget, len(run.todo) - 1)
            mark = prefix.next_mark(run.fed) if prefix is not None else None
            if mark is not None:  # a chunk ends at each checkpoint of the prompt
                n = min(n, mark - run.fed)
            chunk, run.todo = run.todo[:n], run.todo[n:]
            step = sm.forward(mx.array(chunk)[None], run.cache, ledgers=[run.seq.uses])
            step.commit()
            mx.eval([c.state for c in run.cache or []])
            step.count_uses()
            run.fed += n
            if prefix is not None and run.cache is not None:
                run.history += chunk
                prefix.at(run.fed, run.history, run.cache)
            return n
        if prefix is not None:
            run.history += run.todo
        step = sm.forward(mx.array(run.todo)[None], run.cache, ledgers=[run.seq.uses])
        step.commit()
        logits = step.logits[:, -1, :]
        run.fed, run.todo = run.fed + 1, []
        self._prefilling.remove(run)
        if self._emit(run, logits, step):
            self._join(run)
        return 1

    def _prefill_layer(self, run: _Run) -> None:
        """One MoE layer of the run's prompt, layer-major, in the Generator's chunks (so its tokens
        are the Generator's): the whole rest of the prompt, or up to the prefix cache's next
        checkpoint inside it, which then gets the state there. Once the last layer is done the
        prompt's last pass gives the first token, as `_prefill`'s does."""
        sm, prefix = self.sm, run.seq.prefix
        if run.layer_major is None:
            marks = prefix.marks_within(run.fed, run.fed + len(run.todo) - 1) if prefix is not None else []
            chunks, run.chunk_ends = marked_chunks(run.todo, run.fed, marks)
            states = ChunkEndStates(run.cache, set(run.chunk_ends)) if run.chunk_ends and run.cache else None
            ledgers = [run.seq.uses]
            run.layer_major = LayerMajorPrefill(
                lambda x: sm.forward(x, run.cache, ledgers=ledgers), sm.blocks, chunks, run.cache or [], states=states
            )
        prompt = run.layer_major
        if not prompt.advance():
            return
        run.layer_major = None
        passes = prompt.passes or []
        fed = [t for c in prompt.chunks for t in c]
        for step in passes:
            step.commit()  # the tokens are the prompt's: they stay
        for step in passes[:-1]:
            step.count_uses()  # the last pass's uses are counted with the first token
        if prefix is not None:
            run.history += fed
            if prompt.states is not None:
                checkpoint_chunk_ends(prefix, run.history, prompt.states, run.chunk_ends)
        run.fed, run.todo = run.fed + len(fed), []
        self._prefilling.remove(run)
        if self._emit(run, passes[-1].logits[:, -1, :], passes[-1]):
            self._join(run)

    def _emit(self, run: _Run, logits: mx.array, step: ForwardPass | None = None) -> bool:
        """Sample the run's next token from its (1, vocab) logits and hand it over; whether it
        goes on (the same stops as `Generator._plain`, in the same order). `step`: the pass that
        made them, if its uses are not counted yet."""
        logprobs = run.decoder.logprobs(logits)
        y = run.decoder.sample(logprobs)
        mx.eval(y, logprobs)
        run.decoder.fed(int(y))
        if step is not None:
            step.count_uses()  # the pass's uses are in its rows' ledgers before a token is handed out
        token = run.book.emit(int(y), logprobs.squeeze(0))
        if token is None:
            self._finish(run, "eos")
            return False
        run.seq.out.put(token)
        stop = run.book.stop_after()
        if stop is not None:
            self._finish(run, stop)
            return False
        limit = self.sm.max_context
        if limit is not None and run.fed + 1 >= limit:
            self._finish(run, "context")
            return False
        run.next_token = token.id
        return True

    def _join(self, run: _Run) -> None:
        """Merge the run's own cache into the batch's (mlx-lm's merge/extend, left padding)."""
        merged = [c.merge([c]) for c in run.cache or []]
        run.cache = None
        if self._cache is None:
            self._cache = merged
        else:
            for batch, one in zip(self._cache, merged):
                batch.extend(one)
        self._rows.append(run)

    def _filter(self, keep: list[int]) -> None:
        self._rows = [self._rows[i] for i in keep]
        if not keep or self._cache is None:
            self._cache = None
            return
        for c in self._cache:
            c.filter(keep)

    def _close_summary(self, run: _Run) -> None:
        summary = run.seq.summary
        summary.seconds = time.perf_counter() - run.seq.t0
        self.sm.count_open()  # the last pass's resident layers, into every ledger of that pass
        experts = self.sm.store.stats.since(run.before)
        own = run.seq.uses.snapshot()  # the request's own expert uses, not its batch's (module docstring)
        experts.uses, experts.bytes, experts.fetch_seconds = own.uses, own.bytes, own.fetch_seconds
        summary.experts = experts
        observe_request(self.sm.token_observer, summary.seconds)

    def _finish(self, run: _Run, reason: str) -> None:
        run.seq.summary.stop_reason = reason
        if run.seq.prefix is not None and reason != "interrupted":
            self._keep_prefix(run)
        detok = run.book.detok
        detok.finalize()
        run.seq.summary.trailing_text = detok.last_segment
        self._close_summary(run)
        run.seq.out.put(_Done())

    def _keep_prefix(self, run: _Run) -> None:
        """Hand the run's state at the end of its reply to the prefix cache: its own cache if it
        never joined the batch, else its row taken out of the batch's (mlx-lm's `extract`)."""
        prefix = run.seq.prefix
        if prefix is None or len(run.history) != run.fed:
            return
        if run.cache is not None:
            prefix.finish(run.history, run.cache)
        elif self._cache is not None:
            i = next((i for i, r in enumerate(self._rows) if r is run), None)  # by identity: runs hold arrays
            if i is not None:
                prefix.finish(run.history, [c.extract(i) for c in self._cache])

    def _fail(self, run: _Run, error: BaseException) -> None:
        logger.debug("a batched generation failed: %s", error)
        self._close_summary(run)
        run.seq.out.put(_Done(backend_error(error, self.sm.config.get("model_type"))))


def _close_prompt(run: _Run) -> None:
    """Unwind a prompt left part-way (its caller left, or it failed): on the MLX thread."""
    prompt, run.layer_major = run.layer_major, None
    if prompt is not None:
        prompt.close()


def _stopped(seq: _Sequence) -> bool:
    """Whether the caller left or asked to stop."""
    return seq.left or seq.should_stop()
