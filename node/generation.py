"""Token generation on a streamed model: the same steps as mlx-lm's `generate_step`, one token
at a time, so the KV cache and recurrent state always hold exactly the tokens we fed.

mlx-lm pipelines the next step with `async_eval`; we cannot gain from that (every MoE layer
synchronises to learn its routing), and stepping plainly lets Ctrl-C stop between tokens with
the cache consistent, which multi-turn chat relies on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from node.errors import ExpertmeshError
from node.expert_store import SOURCES, StoreStats
from node.streamed_model import StreamedModel

PREFILL_STEP = 2048  # mlx-lm's default prefill chunk: the same chunks give the same numerics


class ContextLengthError(ExpertmeshError):
    pass


@dataclass
class SamplingSettings:
    max_tokens: int = 256
    temp: float = 0.0  # 0 is greedy
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class Token:
    id: int
    text: str  # the text this token completes (may be empty mid-character)
    logprobs: mx.array


@dataclass
class GenerationSummary:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    time_to_first_token_s: float = 0.0
    seconds: float = 0.0
    stop_reason: str = "length"  # length | eos | interrupted | context
    trailing_text: str = ""  # text the detokenizer held back until the end (a split character)
    experts: StoreStats = field(default_factory=StoreStats)

    @property
    def tokens_per_s(self) -> float:
        decode_s = self.seconds - self.time_to_first_token_s
        if self.generated_tokens > 1 and decode_s > 0:
            return (self.generated_tokens - 1) / decode_s
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def lines(self) -> list[str]:
        from node.sizes import format_size

        out = [f"{self.generated_tokens} tokens in {self.seconds:.2f} s: {self.tokens_per_s:.2f} tokens/s, "
               f"time to first token {self.time_to_first_token_s:.2f} s ({self.prompt_tokens} prompt tokens), "
               f"stopped by {self.stop_reason}"]  # fmt: skip
        parts = [f"{s} {self.experts.uses[s]} ({format_size(self.experts.bytes[s])})" for s in SOURCES
                 if self.experts.uses[s] or s in ("ram", "hub")]  # fmt: skip
        out.append(f"expert uses by source: {', '.join(parts)}; {self.experts.total_uses} in all")
        pf = self.experts.prefetch
        if pf["issued"]:
            out.append(f"prefetched {pf['issued']} guesses of the next layer's experts: {pf['used']} used, "
                       f"{pf['wasted']} wasted")  # fmt: skip
        return out


class Generator:
    """Generates on one streamed model, keeping its cache between calls (a conversation)."""

    def __init__(self, sm: StreamedModel):
        self.sm = sm
        self.reset()

    def reset(self) -> None:
        self.cache = make_prompt_cache(self.sm.model)
        self.history: list[int] = []  # exactly the tokens the cache has seen

    def _forward(self, tokens: list[int]) -> mx.array:
        logits = self.sm.model(mx.array(tokens)[None], cache=self.cache)
        self.history.extend(tokens)
        return logits

    def _prefill(self, tokens: list[int]) -> mx.array:
        """Feed `tokens` as mlx-lm does: all but the last in chunks, then the last alone."""
        while len(tokens) > 1:
            chunk, tokens = tokens[: min(PREFILL_STEP, len(tokens) - 1)], tokens[min(PREFILL_STEP, len(tokens) - 1):]
            self._forward(chunk)
            mx.eval([c.state for c in self.cache])
        return self._logprobs(self._forward(tokens))

    @staticmethod
    def _logprobs(logits: mx.array) -> mx.array:
        logits = logits[:, -1, :]
        return logits - mx.logsumexp(logits, keepdims=True)

    def generate(self, tokens: list[int], settings: SamplingSettings,
                 should_stop: Callable[[], bool] = lambda: False,
                 summary: GenerationSummary | None = None) -> Iterator[Token]:  # fmt: skip
        """Feed `tokens` after what the cache holds and yield new tokens as they are made.

        The last token yielded is not fed back (there is nothing to predict after it); the next
        call's tokens follow it. `summary`, if given, is filled in as generation goes.

        Raises:
            ContextLengthError: the conversation would not fit the model's context.
        """
        if not tokens:
            raise ValueError("nothing to generate from: the prompt has no tokens")
        limit = self.sm.max_context
        if limit is not None and len(self.history) + len(tokens) >= limit:
            raise ContextLengthError(f"the prompt is {len(self.history) + len(tokens)} tokens and this model's "
                                     f"context is {limit}: it leaves no room for an answer; shorten it")  # fmt: skip
        summary = summary if summary is not None else GenerationSummary()
        summary.prompt_tokens = len(tokens)
        sampler = make_sampler(settings.temp, settings.top_p)
        if settings.seed is not None:
            mx.random.seed(settings.seed)
        eos = set(self.sm.tokenizer.eos_token_ids)
        detok = self.sm.tokenizer.detokenizer
        detok.reset()
        before = self.sm.store.stats.snapshot()
        t0 = time.perf_counter()
        try:
            logprobs = self._prefill(list(tokens))
            for n in range(settings.max_tokens):
                y = sampler(logprobs)
                mx.eval(y, logprobs)
                token = int(y.item())
                if n == 0:
                    summary.time_to_first_token_s = time.perf_counter() - t0
                if token in eos:
                    summary.stop_reason = "eos"
                    break
                summary.generated_tokens += 1
                detok.add_token(token)
                yield Token(token, detok.last_segment, logprobs.squeeze(0))
                if n + 1 == settings.max_tokens:
                    break
                if should_stop():
                    summary.stop_reason = "interrupted"
                    break
                if limit is not None and len(self.history) + 1 >= limit:
                    summary.stop_reason = "context"
                    break
                logprobs = self._logprobs(self._forward([token]))
            detok.finalize()
            summary.trailing_text = detok.last_segment
        finally:
            summary.seconds = time.perf_counter() - t0
            summary.experts = self.sm.store.stats.since(before)
