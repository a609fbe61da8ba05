"""How one generation picks its tokens: mlx-lm's logits processors, then mlx-lm's sampler.

A request's settings become a `Decoder`: `make_logits_processors` (logit bias, repetition,
presence and frequency penalties) runs on each step's logits with the tokens seen so far (this
call's prompt and what it generated, as mlx-lm's `generate_step` passes them), then the log
probabilities go to `make_sampler` (temperature, top-p, min-p, top-k). The log probabilities a
client asks for are those after the processors, before temperature and truncation: what mlx-lm's
server returns too.

A seeded request samples with a key of its own (`KeyedSampler`), so one seeded request inside a
batch draws exactly what it would alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import mlx.core as mx
from mlx_lm.sample_utils import (
    LogitsProcessor,
    Sampler,
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
    make_sampler,
)

from expertmesh.node.config import PromptExperts
from expertmesh.node.engine.constraint import TokenConstraint

# The penalties look this far back, mlx-lm's default context for each.
PENALTY_CONTEXT_TOKENS = 20
MAX_TOP_LOGPROBS = 20  # as OpenAI's


@dataclass
class SamplingSettings:
    max_tokens: int = 256
    temp: float = 0.0  # 0 is greedy
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 0.0  # 0 or 1: off
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: bool = False  # hand out each token's log probability
    top_logprobs: int = 0  # ...and this many most likely tokens'
    # which tokens may come next (a grammar: node/engine/constraint.py); served without speculation
    constraint: TokenConstraint | None = None
    # which experts the prompt's rows use (engine/prompt_experts.py); decoding is always exact
    prompt_experts: PromptExperts = field(default_factory=PromptExperts)

    @property
    def processed(self) -> bool:
        """Whether logits processors change the model's distribution before sampling."""
        return bool(
            self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty not in (0.0, 1.0)
        )

    @property
    def plain(self) -> bool:
        """Whether sampling is temperature and top-p alone over the model's own distribution: the
        distribution speculative verification (speculative.py, `target_probs`) reproduces."""
        return not self.processed and (self.temp == 0 or (self.top_k == 0 and self.min_p == 0))


class KeyedSampler:
    """mlx-lm's sampling chain with a key of its own: `mx.random.seed(s)` then mlx-lm's sampler
    draws from the global key, split once per draw; this splits its own key the same way."""

    def __init__(self, settings: SamplingSettings, seed: int):
        self.settings = settings
        self.key = mx.random.key(seed)

    def __call__(self, logprobs: mx.array) -> mx.array:
        s = self.settings
        logprobs = _truncated(logprobs, s.top_p, s.min_p, s.top_k)
        self.key, sub = mx.random.split(self.key)
        return mx.random.categorical(logprobs * (1.0 / s.temp), key=sub)


def _truncated(logprobs: mx.array, top_p: float, min_p: float, top_k: int) -> mx.array:
    """make_sampler's filters, in its order."""
    if 0 < top_p < 1.0:
        logprobs = apply_top_p(logprobs, top_p)
    if min_p != 0.0:
        logprobs = apply_min_p(logprobs, min_p)
    if 0 < top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, top_k)
    return logprobs


def make_row_sampler(settings: SamplingSettings, vocab_size: int, keyed: bool) -> Sampler:
    """The sampler of one request: greedy, seeded with its own key (`keyed`: inside a batch), or
    mlx-lm's own from the global key. A top_k of the whole vocabulary or more keeps everything."""
    top_k = settings.top_k if settings.top_k < vocab_size else 0
    if keyed and settings.temp > 0 and settings.seed is not None:
        return KeyedSampler(
            SamplingSettings(temp=settings.temp, top_p=settings.top_p, min_p=settings.min_p, top_k=top_k), settings.seed
        )
    return make_sampler(settings.temp, settings.top_p, min_p=settings.min_p, top_k=top_k)


class Decoder:
    """One generation's step from logits to a token: processors, log probabilities, sampler.

    `fed` must be told every token generated, so the penalties see them. `keyed`: a seeded
    request samples with a key of its own (inside a batch, where the global key is shared)."""

    def __init__(self, settings: SamplingSettings, prompt: list[int], keyed: bool = False):
        self.settings, self.keyed = settings, keyed
        self._sampler: Sampler | None = None  # made at the first step, once the vocabulary's size is known
        self.processors: list[LogitsProcessor] = make_logits_processors(
            settings.logit_bias or None,
            settings.repetition_penalty if settings.repetition_penalty not in (0.0, 1.0) else None,
            PENALTY_CONTEXT_TOKENS,
            settings.presence_penalty or None,
            PENALTY_CONTEXT_TOKENS,
            settings.frequency_penalty or None,
            PENALTY_CONTEXT_TOKENS,
        )
        # only the tail the penalties read is kept: a long prompt costs nothing per step
        self.tokens = list(prompt[-PENALTY_CONTEXT_TOKENS:]) if self.processors else []

    def sample(self, logprobs: mx.array) -> mx.array:
        """A token from `logprobs`, within the request's constraint (a grammar) if it has one: only
        the sampler sees the mask, the log probabilities handed out stay the model's."""
        if self._sampler is None:
            self._sampler = make_row_sampler(self.settings, logprobs.shape[-1], self.keyed)
        if self.settings.constraint is not None:
            logprobs = self.settings.constraint.mask(logprobs)
        return self._sampler(logprobs)

    def logprobs(self, logits: mx.array) -> mx.array:
        """Log probabilities (rows of `logits`, shape [1, vocab]) after the processors."""
        if self.processors:
            context = mx.array(self.tokens)
            for processor in self.processors:
                logits = processor(context, logits)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def fed(self, token: int) -> None:
        if self.processors:
            self.tokens = [*self.tokens[-(PENALTY_CONTEXT_TOKENS - 1) :], token]


@dataclass
class TopLogprob:
    id: int
    logprob: float


@dataclass
class TokenLogprobs:
    """A token's log probability and, if asked, the most likely tokens' at its step."""

    logprob: float
    top: list[TopLogprob]


def token_logprobs(logprobs: mx.array, token: int, top: int) -> TokenLogprobs:
    """Read `token`'s log probability and the `top` most likely ones from one row (evaluated)."""
    chosen = cast(float, logprobs[token].item())
    if top <= 0:
        return TokenLogprobs(chosen, [])
    best = mx.argpartition(-logprobs, kth=top - 1)[:top]
    values = logprobs[best]
    order = mx.argsort(-values)
    ids = cast(list[int], best[order].tolist())
    logs = cast(list[float], values[order].tolist())
    return TokenLogprobs(chosen, [TopLogprob(i, v) for i, v in zip(ids, logs, strict=True)])
