"""Token generation on a streamed model: the same steps as mlx-lm's `generate_step`, one token
at a time, so the KV cache and recurrent state hold exactly the tokens fed between calls.

mlx-lm pipelines the next step with `async_eval`: it builds token n + 1's graph while the device
computes token n. We do the same where it can gain anything: when every expert is resident, a
pass syncs once, at its end (engine/blocks.py); where experts must be fetched every MoE layer
synchronises to learn its routing, and the next pass would only wait for this one. A pipelined
step feeds a token that nobody may read (generation stops, Ctrl-C closes the stream), and
multi-turn chat relies on the cache holding exactly the tokens handed out but the last, so that
pass is taken back: trimmed from a KV cache, a recurrent state restored from the snapshot held
before it (speculative.py's CacheRollback; a cache that could be given back only by copying it
is not pipelined).

Whoever iterates `generate`, every step runs on the process's MLX thread
(node/engine/model_thread.py), one token per turn: the caller's thread only waits for tokens.
A token's `logprobs` are evaluated there before it is handed over, since a lazy array cannot be
evaluated on another thread.

With speculation (`Generator(sm, SpeculationConfig(...))`, node/engine/speculative.py) a pass carries
drafts as well; the cache is rolled back to exactly the accepted tokens before the next one, so
between passes and at the end it holds what the plain path's would.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import Sampler

from expertmesh.node.config import SpeculationConfig
from expertmesh.node.engine import prefill as layer_major
from expertmesh.node.engine.forward_pass import ForwardPass
from expertmesh.node.engine.model_thread import model_thread
from expertmesh.node.engine.prefill_states import ChunkEndStates
from expertmesh.node.engine.prefix_cache import PrefixSession
from expertmesh.node.engine.prompt_experts import Approximation, PromptCount, PromptExperts
from expertmesh.node.engine.sampling import Decoder, SamplingSettings, TokenLogprobs, token_logprobs
from expertmesh.node.engine.speculative import (
    Draft,
    DraftController,
    DraftSource,
    SpeculationStats,
    accept_drafts,
    check_rollback_supported,
    make_draft_source,
    rolls_back_cheaply,
)
from expertmesh.node.engine.streamed_model import StreamedModel, TokenObserver
from expertmesh.node.errors import ExpertmeshError, UnsupportedModelError
from expertmesh.node.store.stats import SOURCES, StoreStats

PREFILL_STEP = 2048  # mlx-lm's default prefill chunk: the same chunks give the same numerics


def prefill_chunks(tokens: list[int]) -> list[list[int]]:
    """The forward passes mlx-lm feeds a prompt in: all but the last token in chunks of
    `PREFILL_STEP`, then the last token alone."""
    body = tokens[:-1]
    return [body[i : i + PREFILL_STEP] for i in range(0, len(body), PREFILL_STEP)] + [tokens[-1:]]


def marked_chunks(tokens: list[int], start: int, marks: list[int]) -> tuple[list[list[int]], dict[int, int]]:
    """`prefill_chunks(tokens)` with a chunk also ending at each of `marks` (prompt positions; the
    cache holds `start` tokens before `tokens`), and which chunks end at a mark: chunk index ->
    position. A layer-major prefill takes the state there as each layer passes it
    (engine/prefill_states.py), so a checkpoint no longer splits the prompt's experts in two."""
    body = len(tokens) - 1
    cuts = {m - start for m in marks if 0 < m - start <= body}
    ends = sorted(cuts | set(range(PREFILL_STEP, body, PREFILL_STEP)) | {body})
    chunks: list[list[int]] = []
    at: dict[int, int] = {}
    begin = 0
    for end in ends:
        if end > begin:
            if end in cuts:
                at[len(chunks)] = start + end
            chunks.append(tokens[begin:end])
            begin = end
    return chunks + [tokens[body:]], at


def checkpoint_chunk_ends(
    prefix: PrefixSession, history: list[int], states: ChunkEndStates, at: dict[int, int]
) -> None:
    """Give the prefix cache the states a layer-major prefill took at its checkpoints (`history`:
    the tokens the cache holds now, the prompt's included)."""
    for i, state in sorted(states.states().items()):
        prefix.at(at[i], history[: at[i]], state)


def prefills_layer_major(sm: StreamedModel) -> bool:
    """Whether a prompt on `sm` goes layer-major (engine/prefill.py): only where experts stream
    (a model wholly resident runs mlx-lm's own chunks), and not with a streamed core, whose reads
    follow token order. The Generator and a batch (engine/batching.py) ask the same."""
    return sm.core_stream is None and not sm.all_resident() and layer_major.usable(sm.blocks)


class PromptError(ExpertmeshError):
    """A prompt no generation can start from: said to the user in one line (a 400 over the API)."""


class ContextLengthError(PromptError):
    pass


class EmptyPromptError(PromptError):
    pass


@dataclass
class Token:
    id: int
    text: str  # the text this token completes (may be empty mid-character)
    logprobs: mx.array
    chosen: TokenLogprobs | None = None  # read off `logprobs` when the request asked for them


def backend_error(error: BaseException, model_type: str | None) -> BaseException:
    """What to tell the user about an error a forward pass raised: mlx-lm runs a few
    architectures (muse_spark ...) with kernels of its own that exist only on Metal, and on a
    machine without it MLX raises a bare RuntimeError from deep inside the model; that becomes
    one clear UnsupportedModelError. Any other error is returned as it is."""
    if isinstance(error, RuntimeError) and "Metal" in str(error) and not mx.metal.is_available():
        return UnsupportedModelError(
            f"mlx-lm runs {model_type or 'this model'} with kernels of its own that need a Metal GPU, "
            f"and this machine has none ({error}): run it on a Mac with Apple silicon"
        )
    return error


def observe_prefix(observer: TokenObserver | None, reused: int) -> None:
    """A prefix cache lookup, to an observer that wants it (NodeMetrics' prompt_tokens_reused)."""
    hook = getattr(observer, "prefix", None)
    if hook is not None:
        hook(reused)


def observe_request(observer: TokenObserver | None, seconds: float) -> None:
    """The generation's whole time, to an observer that wants it (NodeMetrics' `request_seconds`)."""
    hook = getattr(observer, "request", None)
    if hook is not None:
        hook(seconds)


@dataclass
class GenerationSummary:
    prompt_tokens: int = 0  # prompt tokens fed to the model
    # prompt tokens the cache held, not fed: a stored prefix's (engine/prefix_cache.py), or a
    # going conversation's earlier turns (`chat`)
    cached_tokens: int = 0
    generated_tokens: int = 0
    time_to_first_token_s: float = 0.0  # the prompt's prefill and the first token
    seconds: float = 0.0  # the whole generation
    stop_reason: str = "length"  # length | eos | interrupted | context
    trailing_text: str = ""  # text the detokenizer held back until the end (a split character)
    experts: StoreStats = field(default_factory=StoreStats)
    speculation: SpeculationStats | None = None  # None: generated without speculation
    # a batched request's own expert uses, counted as its passes run (engine/batching.py), so
    # Generate can tell each token's uses apart from its batch's; None: the node's counters are its
    routed: StoreStats | None = None
    core_read_bytes: int = 0  # core bytes read from the SSD by this generation (a streamed core)
    passes_built_ahead: int = 0  # decode passes built while the one before computed (`_plain`)
    # an approximate prompt's (`--prompt-experts` other than exact): its expert uses and how many
    # were substituted; None: the prompt was exact
    prompt_approx: PromptCount | None = None

    @property
    def prompt_substituted(self) -> int:
        return self.prompt_approx.substituted if self.prompt_approx is not None else 0

    @property
    def core_read_bytes_per_token(self) -> float:
        """Core bytes read per forward pass that made a token: what a streamed core costs a token."""
        return self.core_read_bytes / max(1, self.generated_tokens)

    @property
    def decode_seconds(self) -> float:
        """Time after the first token: what the tokens after it took."""
        return max(0.0, self.seconds - self.time_to_first_token_s)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, per second of decoding (the prefill is not in it)."""
        if self.generated_tokens > 1 and self.decode_seconds > 0:
            return (self.generated_tokens - 1) / self.decode_seconds
        return 0.0

    def lines(self) -> list[str]:
        from expertmesh.node.sizes import format_size

        decode = ""
        if self.generated_tokens > 1:
            decode = (
                f"; decode {self.decode_tokens_per_s:.2f} tokens/s "
                f"({self.generated_tokens - 1} after the first in {self.decode_seconds:.2f} s)"
            )
        reused = f" fed, {self.cached_tokens} reused from the cache" if self.cached_tokens else ""
        out = [
            f"{self.generated_tokens} tokens in {self.seconds:.2f} s: time to first token "
            f"{self.time_to_first_token_s:.2f} s ({self.prompt_tokens} prompt tokens{reused}){decode}; "
            f"stopped by {self.stop_reason}"
        ]
        parts = [
            # remote moves no expert: its LAN bytes (activations) are on the remote execution line
            f"{s} {self.experts.uses[s]} ({'on peers' if s == 'remote' else format_size(self.experts.bytes[s])})"
            for s in SOURCES
            if self.experts.uses[s] or s in ("ram", "hub")
        ]
        out.append(f"expert uses by source: {', '.join(parts)}; {self.experts.total_uses} in all")
        resident, streamed = self.experts.layers["resident"], self.experts.layers["streamed"]
        if resident and not streamed:
            out.append(
                "all experts resident: every MoE layer ran from RAM slots without a sync, one sync per token"
                + (", each token's pass built while the one before computed" if self.passes_built_ahead else "")
            )
        elif resident:
            out.append(
                f"{resident} of {resident + streamed} MoE layer passes ran on resident experts without a sync; "
                "the rest synced once each to read their routing"
            )
        pf = self.experts.prefetch
        if pf["issued"]:
            out.append(
                f"prefetched {pf['issued']} guesses of the next layer's experts: {pf['used']} used, "
                f"{pf['wasted']} wasted"
            )
        rc = self.experts.remote
        if rc["calls"] or any(rc[k] for k in rc if k.startswith("fallback_")):
            fell = ", ".join(f"{k[9:].replace('_', ' ')} {rc[k]}" for k in rc if k.startswith("fallback_") and rc[k])
            out.append(
                f"remote execution: {self.experts.uses['remote']} experts computed on peers in {rc['calls']} calls, "
                f"LAN bytes of activations {format_size(rc['sent_bytes'])} sent, "
                f"{format_size(rc['received_bytes'])} received; "
                f"fetched here instead: {fell or 'none'}"
            )
        if self.core_read_bytes:
            out.append(
                f"core streamed from the SSD: {format_size(self.core_read_bytes)} read, "
                f"{format_size(self.core_read_bytes_per_token)} a token"
            )
        if self.speculation is not None:
            out.append(self.speculation.line())
        if self.prompt_approx is not None:
            out.append(self.prompt_approx.line())
        return out


def _context_source(sm: StreamedModel) -> str:
    """Where the context limit comes from, when it is `--max-context` rather than the model's own."""
    if sm.context_limit is not None and (sm.model_context is None or sm.context_limit < sm.model_context):
        return " (--max-context; its memory is what the plan counted)"
    return ""


class _TokenBook:
    """What every generated token goes through, on the plain and the speculative path alike: the
    time to first token, the observer, the detokenizer, and the stops after it (max_tokens, the
    caller's stop). An end-of-sequence token is timed but neither counted nor yielded."""

    def __init__(
        self,
        summary: GenerationSummary,
        settings: SamplingSettings,
        observer: TokenObserver | None,
        eos: set[int],
        detok,
        should_stop: Callable[[], bool],
        t0: float,
    ):
        self.summary, self.settings, self.observer = summary, settings, observer
        self.eos, self.detok, self.should_stop = eos, detok, should_stop
        self.t0 = self.t_prev = t0

    def emit(self, tok: int, logprobs: mx.array) -> Token | None:
        """The Token to yield for `tok`, or None for an end-of-sequence token."""
        mx.eval(logprobs)  # the caller reads it on its own thread: nothing lazy may leave this one
        if self.settings.constraint is not None:
            self.settings.constraint.advance(tok)
        t_now = time.perf_counter()
        summary = self.summary
        if summary.generated_tokens == 0:
            summary.time_to_first_token_s = t_now - self.t0
            if self.observer is not None:
                self.observer.first_token(t_now - self.t0)
        if tok in self.eos:
            return None
        summary.generated_tokens += 1
        if self.observer is not None:
            self.observer.token(t_now - self.t_prev)
        self.t_prev = t_now
        self.detok.add_token(tok)
        chosen = token_logprobs(logprobs, tok, self.settings.top_logprobs) if self.settings.logprobs else None
        return Token(tok, self.detok.last_segment, logprobs, chosen)

    def stop_after(self) -> str | None:
        """Why generation stops after the token just yielded, if it does."""
        if self.summary.generated_tokens >= self.settings.max_tokens:  # >=: a max_tokens of 0 stops too
            return "length"
        if self.should_stop():
            return "interrupted"
        return None


class Generator:
    """Generates on one streamed model, keeping its cache between calls (a conversation).

    `layer_major_prefill` (on by default) may be turned off to feed a streamed prompt chunk by
    chunk as mlx-lm does: the prompt bench compares the two (devtools/bench_prompt.py).

    With `speculation` (node/engine/speculative.py) decoding drafts tokens and verifies them in one
    pass; the draft source and its adaptive controller live as long as the Generator, so a chat
    keeps what it learnt about acceptance. `speculation_stats` sums every call's counters.
    """

    layer_major_prefill = True

    def __init__(
        self, sm: StreamedModel, speculation: SpeculationConfig | None = None, draft_source: DraftSource | None = None
    ):
        """`draft_source` replaces the one `speculation.mode` names: benchmarks and tests script
        drafts with it.

        Raises:
            SpeculationError: the draft model cannot be used, or this model's cache cannot roll back.
        """
        self.sm = sm
        self.speculation = speculation if speculation is not None and speculation.mode != "off" else None
        self.speculation_stats = SpeculationStats()
        self._source: DraftSource | None = None  # both set while speculation is on
        self._controller: DraftController | None = None
        mlx = model_thread()
        if self.speculation is not None:
            check_rollback_supported(mlx.call(make_prompt_cache, sm.model))
            # a draft model is loaded (evaluated) on the MLX thread, where it will run
            self._source = draft_source or mlx.call(make_draft_source, self.speculation, sm.tokenizer)
            self._controller = DraftController(self.speculation)
        self.observer: TokenObserver | None = sm.token_observer
        # told where a streamed prompt stands after each group of its experts (`run` and `chat` show it)
        self.prefill_progress: Callable[[layer_major.PrefillProgress], None] | None = None
        self._prompt_experts: tuple[PromptExperts, GenerationSummary | None] = (PromptExperts(), None)
        # False: a prompt goes chunk by chunk through every layer, as mlx-lm's (and a batch's) prefill
        self.layer_major_prefill = True
        self.reset()

    def reset(self) -> None:
        self.cache = model_thread().call(make_prompt_cache, self.sm.model)
        self.history: list[int] = []  # exactly the tokens the cache has seen
        self._prefix: PrefixSession | None = None  # the prefix cache's part in the generation under way

    def _forward(self, tokens: list[int], rollback: bool = False) -> ForwardPass:
        step = self.sm.forward(mx.array(tokens)[None], self.cache, rollback=rollback)
        self.history.extend(tokens)
        return step

    def _prefill(self, tokens: list[int]) -> ForwardPass:
        """Feed `tokens` as mlx-lm does: all but the last in chunks, then the last alone; returns
        the last pass (its logits give the first token). Where experts stream, the chunks go
        layer by layer together, so that each MoE layer fetches each of the prompt's experts once
        (engine/prefill.py)."""
        if len(tokens) > 1 and self._layer_major():
            return self._prefill_layer_major(tokens)
        while len(tokens) > 1:
            n = min(PREFILL_STEP, len(tokens) - 1)
            mark = self._prefix.next_mark(len(self.history)) if self._prefix is not None else None
            if mark is not None:  # a chunk ends at each checkpoint of the prompt
                n = min(n, mark - len(self.history))
            chunk, tokens = tokens[:n], tokens[n:]
            step = self._forward(chunk)
            mx.eval([c.state for c in self.cache])
            step.commit()
            step.count_uses()
            if self._prefix is not None:
                self._prefix.at(len(self.history), self.history, self.cache)
        step = self._forward(tokens)
        step.commit()  # the tokens are the prompt's: they stay
        return step

    def _prefill_layer_major(self, tokens: list[int]) -> ForwardPass:
        """`_prefill` layer-major. A prefix cache's checkpoint inside the prompt ends a chunk,
        and the state there is taken as each layer passes it: the prompt's experts are still
        fetched once for the whole prompt."""
        start = len(self.history)
        marks = self._prefix.marks_within(start, start + len(tokens) - 1) if self._prefix is not None else []
        chunks, at = marked_chunks(tokens, start, marks)
        states = ChunkEndStates(self.cache, set(at)) if at else None
        passes = self._layer_major_passes(chunks, states)
        for step in passes:
            step.commit()  # the tokens are the prompt's: they stay
        for step in passes[:-1]:
            step.count_uses()  # the last pass's uses are counted with the first token
        if states is not None and self._prefix is not None:
            checkpoint_chunk_ends(self._prefix, self.history, states, at)
        return passes[-1]

    def _layer_major_passes(self, chunks: list[list[int]], states: ChunkEndStates | None = None) -> list[ForwardPass]:
        approx = self._approximation()
        with approx.routers(self.sm.model, self.sm.blocks) if approx is not None else contextlib.nullcontext():
            passes = layer_major.prefill(
                lambda x: self.sm.forward(x, self.cache),
                self.sm.blocks,
                chunks,
                self.cache,
                self.prefill_progress,
                approx,
                states,
            )
        self.history.extend(t for chunk in chunks for t in chunk)
        return passes

    def _approximation(self) -> Approximation | None:
        """This prompt's approximation (engine/prompt_experts.py), None when it is exact; the
        summary gets its counts."""
        spec, summary = self._prompt_experts
        if spec.exact:
            return None
        holds = self.sm.household_holds
        approx = Approximation(spec, len(self.sm.blocks), household=holds() if holds is not None else frozenset())
        approx.start(self.sm.store)
        if summary is not None:
            summary.prompt_approx = approx.count
        return approx

    def _layer_major(self) -> bool:
        """Whether a prompt goes layer-major (`prefills_layer_major`), unless turned off."""
        return self.layer_major_prefill and prefills_layer_major(self.sm)

    def _plain(self, tokens: list[int], book: _TokenBook, decoder: Decoder) -> Iterator[Token]:
        """One token per forward pass, exactly mlx-lm's `generate_step`.

        As there, the next token's pass is built and started (`mx.async_eval`) before this
        token is read, so the host builds one graph while the device computes the other —
        whenever the pass does not sync inside (`_builds_ahead`). A pass built ahead for a token
        that is then not fed (generation stops) is taken back out of the cache and uncounted,
        so the cache ends as it would without it: the last token handed out is not fed. Logits
        processors (penalties) need the token before its successor's pass: nothing is built ahead."""
        summary, limit = book.summary, self.sm.max_context
        sampler = decoder.sample
        max_tokens = book.settings.max_tokens
        gives_back = rolls_back_cheaply(self.cache) and not decoder.processors  # fixed for the generation
        step = self._prefill(list(tokens))
        logprobs = decoder.logprobs(step.logits[:, -1, :])
        y = sampler(logprobs)
        ahead: ForwardPass | None = None  # the pass feeding `y`, built before `y` was read
        in_history = False  # whether `y`, fed ahead, is in `self.history` yet
        try:
            for n in range(max_tokens):
                if (
                    n + 1 < max_tokens
                    and (limit is None or len(self.history) + 1 < limit)
                    and gives_back
                    and book.settings.constraint is None  # its mask needs this token first
                    and self._builds_ahead()
                ):
                    ahead = self.sm.forward(y[None], self.cache, rollback=True)
                    next_logprobs = decoder.logprobs(ahead.logits[:, -1, :])
                    next_y = sampler(next_logprobs)
                    mx.async_eval(next_y, next_logprobs)
                    summary.passes_built_ahead += 1
                mx.eval(y, logprobs)
                step.count_uses()  # the pass's uses are counted before its token is handed out
                tok = int(y)
                decoder.fed(tok)
                if ahead is not None:
                    self.history.append(tok)
                    in_history = True
                token = book.emit(tok, logprobs.squeeze(0))
                if token is None:
                    summary.stop_reason = "eos"
                    return
                yield token
                stop = book.stop_after()
                if stop is not None:
                    summary.stop_reason = stop
                    return
                if limit is not None and len(self.history) + (0 if ahead is not None else 1) >= limit:
                    summary.stop_reason = "context"
                    return
                if ahead is not None:  # its token is fed for good: it is the pass to read next
                    ahead.commit()
                    step, ahead, in_history = ahead, None, False
                    y, logprobs = next_y, next_logprobs
                else:
                    step = self._forward([token.id])
                    step.commit()
                    logprobs = decoder.logprobs(step.logits[:, -1, :])
                    y = sampler(logprobs)
        finally:
            if ahead is not None:  # stopped (or closed) with the next pass built: it never was
                ahead.discard()
                if in_history:
                    self.history.pop()

    def _builds_ahead(self) -> bool:
        """Whether the next pass can be built while this one computes (asked every token: what is
        resident may change between tokens): it must not sync inside (every expert
        resident, the core held whole), or it would only wait for this pass. The cache must
        also give the pass back cheaply if its token is never fed (`_plain` checks that once)."""
        return self.sm.core_stream is None and self.sm.all_resident()

    def _speculative(
        self, tokens: list[int], book: _TokenBook, sampler: Sampler, source: DraftSource, ctl: DraftController
    ) -> Iterator[Token]:
        """Decoding with drafts: each pass feeds `todo` (what must enter the cache, ending with the
        current token) plus k drafts, and yields the accepted drafts and one token more.

        Invariant between passes: the cache holds exactly `self.history` and `todo` follows it.
        With every cache trimmable `todo` is just the current token; after a rejection while
        some cache cannot trim (a recurrent state, a sliding window that has wrapped) it also
        carries the accepted tokens (see CacheRollback). When generation ends the cache holds
        what the plain path's would: all but the last token yielded, or after an EOS all of them.
        """
        summary, settings = book.summary, book.settings
        stats = summary.speculation = SpeculationStats()
        limit = self.sm.max_context
        todo: list[int] = []  # the pass in flight fed `todo` and `draft.tokens`
        draft = Draft([])
        out: list[int] = []  # tokens of the pass in flight yielded so far
        step: ForwardPass | None = None  # the pass in flight (None: the prompt's, committed)
        reading = False  # whether its tokens are being handed out (it is not committed yet)
        eos_stop = False

        def commit_accepted() -> list[int]:
            """Commit of the pass in flight what the cache must keep; returns the new `todo`."""
            fed = len(todo) + len(draft.tokens)
            keep = len(todo) + len(out) - (0 if eos_stop else 1)
            start = len(self.history) - fed
            pass_tokens = self.history[start:]
            kept = step.commit(keep) if step is not None else 0
            del self.history[start + kept :]
            return pass_tokens[kept:keep] + ([] if eos_stop or not out else [out[-1]])

        try:
            first = self._prefill(list(tokens))  # committed; its uses are counted with the first token
            logits = first.logits[0, -1:]
            rows = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            while True:
                k = len(draft.tokens)
                if k:
                    j, nxt = accept_drafts(rows, draft, settings.temp, settings.top_p)
                    stats.drafted += k
                    stats.accepted += j
                    stats.verify_passes += 1
                    ctl.update(k, j, stats.generated, stats)
                    if self.observer is not None:
                        self.observer.speculative(k, j)
                else:
                    y = sampler(rows[:1])  # exactly the plain path's step
                    mx.eval(y)
                    j, nxt = 0, int(y)
                (step or first).count_uses()  # the pass's uses are counted before its tokens are handed out
                out, stop, reading = [], None, True
                for i, tok in enumerate([*draft.tokens[:j], nxt]):
                    token = book.emit(tok, rows[i])
                    if token is None:
                        stop = "eos"
                        break
                    out.append(tok)
                    stats.generated += 1
                    yield token
                    stop = book.stop_after()
                    if stop is not None:
                        break
                eos_stop = stop == "eos"
                todo, step, draft, reading = commit_accepted(), None, Draft([]), False
                if stop is not None:
                    summary.stop_reason = stop
                    break
                if limit is not None and len(self.history) + len(todo) >= limit:
                    summary.stop_reason = "context"
                    break
                room = settings.max_tokens - summary.generated_tokens - 1
                if limit is not None:
                    room = min(room, limit - 1 - len(self.history) - len(todo))
                k = min(ctl.draft_length(stats.generated), max(0, room))
                if k:
                    draft = source.propose(self.history + todo, k, settings.temp, settings.top_p)
                step = self._forward(todo + draft.tokens, rollback=bool(draft.tokens))
                logits = step.logits[0, len(todo) - 1 :]
                stats.passes += 1
                rows = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        finally:
            if reading and out:  # the caller stopped consuming in the middle of a pass
                todo = commit_accepted()
            flush = todo if eos_stop else todo[:-1]
            if flush:
                self._forward(flush).commit()
                mx.eval([c.state for c in self.cache])
                stats.passes += 1
            self.speculation_stats.add(stats)

    def generate(
        self,
        tokens: list[int],
        settings: SamplingSettings,
        should_stop: Callable[[], bool] = lambda: False,
        summary: GenerationSummary | None = None,
        prefix: PrefixSession | None = None,
    ) -> Iterator[Token]:
        """Feed `tokens` after what the cache holds and yield new tokens as they are made.

        `prefix` (a fresh conversation's only: engine/prefix_cache.py) starts from the stored
        state holding the longest prefix of `tokens`, checkpoints the prompt where it says, and
        keeps the state at the end; `summary.cached_tokens` says how many tokens were not fed.

        The last token yielded is not fed back (there is nothing to predict after it); the next
        call's tokens follow it. `summary`, if given, is filled in as generation goes. Each step
        runs on the MLX thread; closing the iterator early stops there too, cache consistent.

        Raises:
            ContextLengthError: the conversation would not fit the model's context.
        """
        yield from model_thread().iterate(self._generate(tokens, settings, should_stop, summary, prefix))

    def _generate(
        self,
        tokens: list[int],
        settings: SamplingSettings,
        should_stop: Callable[[], bool],
        summary: GenerationSummary | None,
        prefix: PrefixSession | None = None,
    ) -> Iterator[Token]:
        """`generate`'s steps, on the MLX thread."""
        if not tokens:
            raise EmptyPromptError("nothing to generate from: the prompt has no tokens")
        summary = summary if summary is not None else GenerationSummary()
        if prefix is not None:
            if self.history:
                raise ValueError("a prefix cache serves a fresh conversation only")
            cache, reused = prefix.start()
            if cache is not None:
                self.cache, self.history = cache, list(tokens[:reused])
            tokens = tokens[reused:]
            summary.cached_tokens = reused
            prefix.plan(self.cache)
        else:  # a conversation that goes on (`chat`) reuses what its cache holds
            summary.cached_tokens = len(self.history)
        self._prefix = prefix
        limit = self.sm.max_context
        if limit is not None and len(self.history) + len(tokens) >= limit:
            raise ContextLengthError(
                f"the prompt is {len(self.history) + len(tokens)} tokens and this model's "
                f"context is {limit}{_context_source(self.sm)}: it leaves no room for an answer; shorten it"
            )
        summary.prompt_tokens = len(tokens)
        self._prompt_experts = (settings.prompt_experts, summary)
        decoder = Decoder(settings, tokens)
        if settings.seed is not None:
            mx.random.seed(settings.seed % 2**64)  # MLX's seeds are unsigned; a user's may be negative
        detok = self.sm.tokenizer.detokenizer
        detok.reset()
        self.sm.count_open()  # what an earlier pass used is not this generation's
        before = self.sm.store.stats.snapshot()
        core_before = self.sm.core_read_bytes()
        t0 = time.perf_counter()
        if self.observer is not None:
            self.observer.prompt(len(tokens))
        if prefix is not None:
            observe_prefix(self.observer, summary.cached_tokens)
        book = _TokenBook(
            summary, settings, self.observer, set(self.sm.tokenizer.eos_token_ids), detok, should_stop, t0
        )
        failed = False
        try:
            try:
                # Verification reproduces temperature and top-p over the model's own distribution
                # (speculative.py, target_probs); other sampling, and a constrained request
                # (node/engine/constraint.py), runs on the plain path.
                if (
                    self._source is not None
                    and self._controller is not None
                    and settings.plain
                    and settings.constraint is None
                ):
                    yield from self._speculative(tokens, book, decoder.sample, self._source, self._controller)
                else:
                    yield from self._plain(tokens, book, decoder)
            except RuntimeError as e:
                clear = backend_error(e, self.sm.config.get("model_type"))
                if clear is e:
                    raise
                raise clear from None
            detok.finalize()
            summary.trailing_text = detok.last_segment
        except BaseException as e:
            failed = not isinstance(e, GeneratorExit)  # a reader that stopped leaves the cache whole
            raise
        finally:
            self._prefix = None
            if prefix is not None and not failed:
                prefix.finish(self.history, self.cache)
            self.sm.count_open()  # the last pass's resident layers: evaluated by now, counted now
            summary.seconds = time.perf_counter() - t0
            summary.experts = self.sm.store.stats.since(before)
            summary.core_read_bytes = self.sm.core_read_bytes() - core_before
            if summary.prompt_approx is not None:
                hook = getattr(self.observer, "prompt_approximated", None)  # NodeMetrics' counter
                if hook is not None:
                    hook(summary.prompt_approx.substituted)
            observe_request(self.observer, summary.seconds)
