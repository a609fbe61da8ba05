"""Speculative decoding: guess a few tokens ahead cheaply, check them all in one forward pass.

A forward pass of a streamed MoE model has a fixed cost that does not grow with the number of
tokens in it (one round trip per layer to the store, the core's bytes, Python per layer), so
feeding `[last, d1 .. dk]` at once and keeping the drafts the big model agrees with produces up
to k+1 tokens for one pass. It does not save expert bytes: the k+1 tokens route to nearly as
many distinct experts as the same tokens one pass each (the store fetches their union once).

This module owns the parts that do not touch the Generator's loop:
    NgramDraft       prompt look-up: the continuation of the latest earlier occurrence of the
                     last n tokens (prompt and output so far); no extra model
    ModelDraft       a small mlx-lm model with the same tokenizer, run greedily (or sampled)
    accept_drafts    the verification rule: greedy prefix match, or the standard speculative
                     sampling rule (accept with min(1, p/q), else sample the residual)
    DraftController  draft length adapted to acceptance, and the off-switch with later probes
    CacheRollback    exact rollback of an mlx-lm prompt cache after a rejected draft
    SpeculationStats the counters (`drafted`, `accepted`, passes) the metrics read
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    make_prompt_cache,
    trim_prompt_cache,
)
from mlx_lm.sample_utils import apply_top_p
from mlx_lm.tokenizer_utils import TokenizerWrapper

from expertmesh.node.config import SpeculationConfig
from expertmesh.node.errors import ExpertmeshError, SpeculationError
from expertmesh.node.hub.client import download_repo


@dataclass
class SpeculationStats:
    """Counters of one generation (or a sum of them); outcomes named as the Prometheus labels
    of `expertmesh_speculative_tokens_total{outcome=drafted|accepted}`."""

    drafted: int = 0  # draft tokens sent through a verify pass
    accepted: int = 0  # of those, kept
    passes: int = 0  # forward passes of the big model after the prompt's (verify, plain and flush)
    verify_passes: int = 0  # passes that carried at least one draft
    switched_off: int = 0  # times the controller turned speculation off
    generated: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def passes_per_token(self) -> float:
        return self.passes / self.generated if self.generated else 0.0

    def add(self, other: SpeculationStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def line(self) -> str:
        return (
            f"speculation: {self.passes} passes for {self.generated} tokens "
            f"({self.passes_per_token:.2f} passes per generated token); {self.accepted} of {self.drafted} "
            f"drafts accepted ({self.acceptance:.0%}) in {self.verify_passes} verify passes"
            + (f"; switched off {self.switched_off}x while it did not pay" if self.switched_off else "")
        )


# -- draft sources ---------------------------------------------------------------------------


@dataclass
class Draft:
    tokens: list[int]
    probs: list[mx.array] | None = None  # q(x) per draft (1-D over the vocabulary); None: deterministic


class DraftSource(Protocol):
    """What proposes drafts (NgramDraft, ModelDraft, or a benchmark's or test's script)."""

    def propose(self, context: list[int], k: int, temp: float = 0.0, top_p: float = 1.0) -> Draft:
        """Up to `k` tokens likely to follow `context`."""
        ...

    def close(self) -> None: ...


class NgramDraft:
    """Prompt look-up: propose what followed the latest earlier occurrence of the context's tail.

    Deterministic proposals (q is a point mass), so sampling accepts a draft with probability p(x).
    """

    name = "ngram"

    def __init__(self, ngram_max: int = 4, ngram_min: int = 2):
        self.ngram_max, self.ngram_min = ngram_max, ngram_min

    def propose(self, context: list[int], k: int, temp: float = 0.0, top_p: float = 1.0) -> Draft:
        """Up to k tokens. The latest match of a loop is right behind the tail and has a short
        continuation, so the lookup is repeated on context + drafts until k tokens are found:
        a period-p loop then drafts k tokens, not p."""
        drafts: list[int] = []
        while len(drafts) < k:
            follow = self._lookup(context + drafts, k - len(drafts))
            if not follow:
                break
            drafts.extend(follow)
        return Draft(drafts)

    def _lookup(self, context: list[int], k: int) -> list[int]:
        n_ctx = len(context)
        for n in range(min(self.ngram_max, n_ctx - 1), self.ngram_min - 1, -1):
            tail = context[n_ctx - n :]
            for start in range(n_ctx - n - 1, -1, -1):  # latest first: recent text predicts best
                if context[start : start + n] == tail:
                    return context[start + n : start + n + k]
        return []

    def close(self) -> None:
        pass


class ModelDraft:
    """A small mlx-lm model proposing tokens one at a time; its cache follows the context.

    Its cache is kept between calls and trimmed to the common prefix with the new context, so it
    feeds each context token once plus the rejected drafts it regenerates. A cache that cannot
    trim now (a recurrent state, a sliding window that has wrapped) is put back as it was before
    the last drafts (held as CacheRollback holds the model's), then fed what the context added;
    started again from the context, it fed the whole context at every rejection (a draft with a
    128-token window, such as gpt-oss-20b's, re-read a long conversation per proposal).
    """

    name = "draft"

    def __init__(self, model: nn.Module, vocab_size: int):
        self.model = model
        self.vocab_size = vocab_size
        self.cache = make_prompt_cache(model)
        self.fed: list[int] = []
        # (tokens the cache held, what puts it back so) before the last proposal's drafts were fed
        self._mark: tuple[int, list] | None = None

    @property
    def trimmable(self) -> bool:
        """Whether its cache can trim back now: asked each time, not once, since a sliding
        window trims only until it wraps."""
        return all(c.is_trimmable() for c in self.cache)

    @classmethod
    def load(cls, repo_or_path: str, tokenizer: TokenizerWrapper, home: Path | None = None) -> ModelDraft:
        """Load a draft model from a local folder, or a repo pulled with huggingface_hub.

        Raises:
            SpeculationError: not found, not loadable by mlx-lm, or another tokenizer.
        """
        import mlx_lm

        path = Path(repo_or_path).expanduser()
        if not path.is_dir():
            try:
                path = download_repo(repo_or_path)
            except ExpertmeshError as e:
                raise SpeculationError(
                    f"draft model {repo_or_path!r} is neither a folder nor a reachable repository: {e}"
                ) from None
        try:
            model, draft_tok = mlx_lm.load(str(path))[:2]  # (model, tokenizer): no config asked for
        except (ValueError, FileNotFoundError, KeyError) as e:
            raise SpeculationError(f"mlx-lm cannot load the draft model at {path}: {e}") from None
        if draft_tok.get_vocab() != tokenizer.get_vocab():
            raise SpeculationError(
                f"the draft model {repo_or_path!r} has another tokenizer than the model: "
                "its tokens would mean other text"
            )
        return cls(model, len(tokenizer.get_vocab()))

    def _sync(self, context: list[int]) -> mx.array:
        """Make the cache hold context[:-1]... then feed the rest; returns the last row's logits."""
        common = 0
        for a, b in zip(self.fed, context[:-1]):
            if a != b:
                break
            common += 1
        mark, self._mark = self._mark, None
        if common < len(self.fed):
            if self.trimmable:
                trim_prompt_cache(self.cache, len(self.fed) - common)
            elif mark is not None and mark[0] <= common:
                for c, held in zip(self.cache, mark[1]):
                    _undo(c, held, len(self.fed) - mark[0])
                common = mark[0]
            else:
                self.cache, common = make_prompt_cache(self.model), 0
            self.fed = self.fed[:common]
        return self._feed(context[common:])

    def _feed(self, tokens: list[int]) -> mx.array:
        logits = self.model(mx.array(tokens)[None], cache=self.cache)[0, -1, : self.vocab_size]
        self.fed.extend(tokens)
        return logits.astype(mx.float32)

    def propose(self, context: list[int], k: int, temp: float = 0.0, top_p: float = 1.0) -> Draft:
        logits = self._sync(context)
        if k > 1:  # drafts will be fed: remember the cache as it holds the context (see the class)
            self._mark = (len(self.fed), [_save(c) for c in self.cache])
        tokens: list[int] = []
        probs: list[mx.array] = []
        for i in range(k):
            if temp == 0:
                tok = int(mx.argmax(logits))
            else:
                q = target_probs(logits - mx.logsumexp(logits), temp, top_p)
                tok = int(mx.random.categorical(mx.log(q)))
                probs.append(q)
            tokens.append(tok)
            if i + 1 < k:
                logits = self._feed([tok])
        return Draft(tokens, probs if temp != 0 else None)

    def close(self) -> None:
        self.cache, self._mark = [], None


def make_draft_source(cfg: SpeculationConfig, tokenizer: TokenizerWrapper) -> DraftSource:
    """The draft source `cfg.mode` names.

    Raises:
        SpeculationError: the mode drafts nothing (`off`), or the draft model cannot be used.
    """
    if cfg.mode == "ngram":
        return NgramDraft(cfg.ngram_max, cfg.ngram_min)
    if cfg.mode == "draft" and cfg.draft_repo:  # (SpeculationConfig refuses "draft" without one)
        return ModelDraft.load(cfg.draft_repo, tokenizer)
    raise SpeculationError(f"speculation mode {cfg.mode!r} has no draft source")


# -- verification ----------------------------------------------------------------------------


def target_probs(logprobs: mx.array, temp: float, top_p: float) -> mx.array:
    """The distribution mlx-lm's sampler draws from (top-p on log-probs, then temperature)."""
    if 0 < top_p < 1.0:
        logprobs = apply_top_p(logprobs, top_p)
    return mx.softmax(logprobs.astype(mx.float32) / temp, axis=-1)


def accept_drafts(logprobs: mx.array, draft: Draft, temp: float, top_p: float) -> tuple[int, int]:
    """(accepted, next token) for `logprobs` rows 0..k (row i predicts draft i; row k the bonus).

    Greedy: the longest prefix equal to the argmax, then the argmax after it — exactly the tokens
    plain greedy decoding makes. Sampled: the standard rule (Leviathan et al., Chen et al.): keep
    draft x with probability min(1, p(x)/q(x)); at the first rejection draw from the residual
    max(p - q, 0) renormalised; if all are kept draw the bonus from p. The output then follows
    p exactly, whatever q is; for deterministic (n-gram) drafts q is a point mass.
    """
    k = len(draft.tokens)
    if temp == 0:
        # rows 0..k: the argmax of each is one token id, so the list is flat
        best = cast(list[int], mx.argmax(logprobs, axis=-1).tolist())
        j = 0
        while j < k and best[j] == draft.tokens[j]:
            j += 1
        return j, best[j]
    for i, x in enumerate(draft.tokens):
        p = target_probs(logprobs[i], temp, top_p)
        if draft.probs is None:
            q = mx.zeros_like(p).at[x].add(1.0)
        else:
            q = draft.probs[i]
        ratio = float(p[x] / mx.maximum(q[x], 1e-20))
        if float(mx.random.uniform()) < min(1.0, ratio):
            continue
        residual = mx.maximum(p - q, 0.0)
        total = float(residual.sum())
        if total <= 0:  # p == q: nothing left to correct towards; p itself is the residual
            residual = p
        return i, int(mx.random.categorical(mx.log(residual)))
    p = target_probs(logprobs[k], temp, top_p)
    return k, int(mx.random.categorical(mx.log(p)))


# -- draft length and the off-switch -----------------------------------------------------------


@dataclass
class DraftController:
    """Draft length by acceptance, and speculation off while it does not pay.

    Length: one more after a fully accepted round, else the accepted count plus one (at least 1):
    a rejected draft costs a wider pass (more rows, more distinct experts) for nothing. Off-switch:
    when the smoothed acceptance rate falls below `min_acceptance` — fewer than ~1.3 tokens per
    pass at length 1, where the wider pass's extra experts cost more than the token it saves —
    speculation rests for `cooldown` plain tokens, then probes again; each failed probe doubles
    the rest, a paying one resets it.
    """

    cfg: SpeculationConfig
    length: int = 0
    ema: float | None = None
    rounds: int = 0
    off_until: int = -1  # generated-token count until which speculation rests
    cooldown: int = 0
    probing: bool = False

    def __post_init__(self) -> None:
        self.length = self.cfg.initial_draft
        self.cooldown = self.cfg.cooldown_tokens

    def draft_length(self, generated: int) -> int:
        if generated < self.off_until:
            return 0
        return self.length

    def update(self, drafted: int, accepted: int, generated: int, stats: SpeculationStats) -> None:
        if drafted == 0:
            return
        self.rounds += 1
        rate = accepted / drafted
        self.ema = rate if self.ema is None else 0.6 * self.ema + 0.4 * rate
        if accepted == drafted:
            self.length = min(self.cfg.max_draft, self.length + 1)
        else:
            self.length = max(1, min(self.length - 1, accepted + 1))
        if self.probing:
            self.probing = False
            if rate >= self.cfg.min_acceptance:
                self.cooldown = self.cfg.cooldown_tokens  # it pays again
                self.ema = rate
                return
            self._switch_off(generated, stats, double=True)
            return
        if self.rounds >= self.cfg.warmup_rounds and self.ema < self.cfg.min_acceptance:
            self._switch_off(generated, stats, double=False)

    def _switch_off(self, generated: int, stats: SpeculationStats, double: bool) -> None:
        if double:
            self.cooldown = min(self.cfg.max_cooldown_tokens, self.cooldown * 2)
        self.off_until = generated + self.cooldown
        self.length = 1
        self.probing = True  # the first round after the rest decides
        stats.switched_off += 1


# -- exact rollback ----------------------------------------------------------------------------

# Caches whose `trim` undoes the last tokens exactly at any length: their keys and values are
# kept whole (a chunked cache drops its front only before a pass, never what a trim gives back).
_ALWAYS_TRIMMABLE = (KVCache, QuantizedKVCache, ChunkedKVCache, ConcatenateKVCache)


def hold(value):
    """`value` as it is now, for later: an MLX array is held through a fresh graph node, so a
    layer writing into the live array in place (`keys[..., i:j, :] = ...`) cannot change it."""
    if isinstance(value, mx.array):
        return mx.stop_gradient(value)
    if isinstance(value, (list, tuple)):
        return type(value)(hold(v) for v in value)
    return value


def _save(cache):
    """What puts `cache` back as it is now; None where a trim does it exactly."""
    if isinstance(cache, _ALWAYS_TRIMMABLE):
        return None
    if isinstance(cache, CacheList):
        return [_save(c) for c in cache.caches]
    if isinstance(cache, ArraysCache):
        return [hold(a) for a in cache.cache]
    return {k: hold(v) for k, v in vars(cache).items()}


def _undo(cache, saved, fed: int) -> None:
    """Take the last pass's `fed` tokens out of `cache`: trimmed, or restored from `saved`."""
    if isinstance(cache, CacheList):
        for c, s in zip(cache.caches, saved):
            _undo(c, s, fed)
    elif saved is None:
        cache.trim(fed)
    elif isinstance(cache, ArraysCache):
        cache.cache = list(saved)
    else:
        vars(cache).clear()
        vars(cache).update(saved)


def _restorable(cache) -> bool:
    if isinstance(cache, CacheList):
        return all(_restorable(c) for c in cache.caches)
    return isinstance(cache, (_ALWAYS_TRIMMABLE, ArraysCache)) or hasattr(cache, "__dict__")


@dataclass
class CacheRollback:
    """Undo the last pass's tokens in an mlx-lm prompt cache, exactly.

    When every layer's cache can trim now (KVCache always; a sliding window's RotatingKVCache
    only while it has not wrapped), mlx-lm's `trim` drops the rejected positions and nothing is
    recomputed. Otherwise — a recurrent state (ArraysCache: K3's KDA, Mamba, linear attention)
    has folded every token in; a sliding window that has wrapped has overwritten the positions
    the rejected tokens pushed out; deepseek_v41's LayerCache compresses closed groups — every
    such cache is put back as it was before the pass (`snapshot` holds its arrays: MLX arrays
    are immutable once held through a fresh node, so holding costs no copy) and the
    always-trimmable ones are trimmed by the whole pass. The accepted tokens are then *not*
    re-fed in a pass of their own: they lead the next pass (`[accepted..., next, new drafts...]`),
    so a rejection costs no extra forward pass, only wider rows in the next one. Restoring the
    state and recomputing is exact by construction; the alternative, recording the state after
    every position inside each layer, needs changes to mlx-lm's model code.
    """

    cache: list
    saved: list | None = None

    @property
    def exact_trim(self) -> bool:
        return all(c.is_trimmable() for c in self.cache)

    def snapshot(self) -> None:
        """Remember the cache before a pass that carries drafts."""
        self.saved = [_save(c) for c in self.cache]

    def keep(self, fed: int, keep: int) -> int:
        """After a pass of `fed` tokens keep the first `keep`; returns how many stay in the cache
        (`keep` when every layer trims, else 0: the cache is as before the pass)."""
        saved, self.saved = self.saved, None  # what it holds is for this pass only
        if keep == fed:
            return keep
        if self.exact_trim:
            trim_prompt_cache(self.cache, fed - keep)
            return keep
        if saved is None:
            raise SpeculationError("a pass with drafts ran without a snapshot of the cache to roll back to")
        for c, held in zip(self.cache, saved):
            _undo(c, held, fed)
        return 0


def rolls_back_cheaply(cache: list) -> bool:
    """Whether one pass can be undone in `cache` without holding a copy of anything that grows:
    every layer's cache trims exactly (at any length) or is a recurrent state, which a new
    token replaces rather than updates in place (so holding it costs no copy)."""

    def cheap(c) -> bool:
        if isinstance(c, CacheList):
            return all(cheap(x) for x in c.caches)
        return isinstance(c, (_ALWAYS_TRIMMABLE, ArraysCache))

    return all(cheap(c) for c in cache)


def check_rollback_supported(cache: list) -> None:
    """Raises SpeculationError if some layer's cache can be neither trimmed nor restored."""
    for c in cache:
        if not _restorable(c):
            raise SpeculationError(f"speculation cannot roll back a {type(c).__name__} cache; use --speculate off")
