"""Conversations at the price of their new tokens: a full node keeps the states of prompts it has
seen, and a request that shares a prefix with one resumes from it instead of feeding it again.

A stored state is an mlx-lm prompt cache (the same classes the model made: `KVCache`,
`ArraysCache`, `RotatingKVCache`, `CacheList`...) with the tokens it holds. A request resumes from
the stored state of its own space (one API key's; engine callers name it) that covers the longest
prefix of its prompt:
- a state whose every layer trims (KV, MLA: mlx-lm's `can_trim_prompt_cache`) serves any prefix
  of its tokens, trimmed to the common prefix;
- a state that cannot trim (the recurrent state of KDA, Mamba, Gated DeltaNet; a sliding window
  that may have wrapped) serves only a request whose prompt starts with all of its tokens. For
  those, exact checkpoints are taken while a prompt is fed: at its message boundaries (the end of
  the system prompt, of each user turn, of each reply: the caller says where they are) and every
  `checkpoint_every` tokens of a long prefill, so a follow-up turn, or another conversation with
  the same system prompt, finds one.

Why not mlx-lm's `LRUPromptCache`: it deep-copies a whole cache on every hit, and it cannot be
told which entries are checkpoints of a prompt in flight. Here a hit costs no copy: the stored
arrays are held through fresh graph nodes (`speculative.hold`), so a layer that writes into its
cache in place copies only what it writes over, once (MLX never donates a buffer something else
holds). The trie is a linear scan of one space's entries (tens of them; a common prefix is one
numpy comparison). LRU by bytes (mlx-lm's `nbytes` of each cache) within a byte budget that the
memory plan counts (engine/memory.py).

A state may carry labels: the keys of the message prefixes whose tokens it holds exactly
(node/rpc/prefix_keys.py computes them from the request; the engine never reads them). The node
reports the labels of its states (`held`) so a coordinator sends a conversation's next turn here.

Every method that touches MLX runs on the MLX thread; the bookkeeping is locked, so a request's
thread may ask for a `PrefixSession` and read the counters.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import CacheList, KVCache, can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from expertmesh.node.engine.prefix_disk import PrefixDisk
from expertmesh.node.engine.speculative import hold

CHECKPOINT_EVERY = 1024  # tokens of a long prefill between two checkpoints of a state that cannot trim
# A checkpoint this close after where a prompt resumes is not taken: it would end a segment of a
# few tokens, whose experts a streamed layer-major prefill reads on their own (at K3's density a
# few tokens' union is a large part of a layer), to spare a later request at most this many tokens.
CHECKPOINT_MIN_GAP = 16


def clone_cache(cache: list) -> list:
    """An independent copy of an mlx-lm prompt cache that copies no array: each is held through a
    fresh graph node, so writing into one copy (in place) leaves the other as it was."""
    return [_clone(c) for c in cache]


def _clone(c):
    new = copy.copy(c)
    if isinstance(c, CacheList):
        new.caches = type(c.caches)(_clone(x) for x in c.caches)
        return new
    for name, value in vars(c).items():
        setattr(new, name, hold(value))
    return new


def cache_bytes(cache: list) -> int:
    return sum(int(c.nbytes) for c in cache)


def always_trims(cache: list) -> bool:
    """Whether a state of this model trims at every length (no checkpoints needed)."""

    def trims(c) -> bool:
        if isinstance(c, CacheList):
            return all(trims(x) for x in c.caches)
        return type(c) is KVCache

    return all(trims(c) for c in cache)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


@dataclass(eq=False)
class _Entry:
    space: str
    tokens: np.ndarray
    cache: list
    nbytes: int
    trims: bool
    labels: dict[bytes, int] = field(default_factory=dict)  # message-prefix key -> tokens it holds of it


@dataclass
class PrefixStats:
    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    stored: int = 0  # states stored (checkpoints and ends of replies)
    evicted: int = 0


class PrefixCache:
    """The states a full node keeps between requests, within `budget_bytes` (LRU by bytes)."""

    def __init__(
        self,
        budget_bytes: int,
        checkpoint_every: int = CHECKPOINT_EVERY,
        checkpoints: bool = True,
        disk: PrefixDisk | None = None,
        model: nn.Module | None = None,
    ):
        """`checkpoints`: whether the model's states need checkpoints (some cannot trim); a
        caller then says where a prompt's messages end (`session`'s `boundaries`). `disk` (with
        the `model` its states are loaded into) keeps long prefixes across restarts
        (engine/prefix_disk.py)."""
        if checkpoint_every < 1:
            raise ValueError("checkpoint_every must be at least 1")
        self.budget_bytes = budget_bytes
        self.checkpoint_every = checkpoint_every
        self.checkpoints = checkpoints
        self.disk, self.model = disk, model
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._next_id = 0
        self.bytes = 0
        self.stats = PrefixStats()

    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        budget_bytes: int,
        checkpoint_every: int = CHECKPOINT_EVERY,
        disk: PrefixDisk | None = None,
    ) -> PrefixCache:
        """The cache for `model`'s states (on the MLX thread: it makes one to look at)."""
        checkpoints = not always_trims(make_prompt_cache(model))
        return cls(budget_bytes, checkpoint_every, checkpoints, disk, model)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def session(
        self,
        space: str,
        prompt: list[int],
        boundaries: Iterable[int] = (),
        labels: Iterable[tuple[int, bytes]] = (),
    ) -> PrefixSession:
        """A request's use of the cache: where it resumes and where its prompt is checkpointed.
        `boundaries`: prompt positions that end a message (the caller's chat template knows);
        `labels`: (position, key) of its message prefixes, which the states it leaves carry."""
        return PrefixSession(self, space, list(prompt), sorted(set(boundaries)), list(labels))

    # -- on the MLX thread ----------------------------------------------------------------------

    def take(self, space: str, prompt: list[int]) -> tuple[list | None, int]:
        """A copy of the state holding the longest prefix of `prompt` in `space` (trimmed to it),
        and that prefix's length; (None, 0) when none. At least one token is left to feed."""
        ids = np.asarray(prompt, dtype=np.int64)
        most = len(prompt) - 1
        self._from_disk(space, ids, self._best(space, ids, most)[1])
        with self._lock:
            best, best_n = self._best(space, ids, most)
            if best is None:
                self.stats.misses += 1
                return None, 0
            self._entries.move_to_end(self._key(best))
            self.stats.hits += 1
            self.stats.reused_tokens += best_n
            cache = clone_cache(best.cache)
            extra = len(best.tokens) - best_n
        if extra:
            trim_prompt_cache(cache, extra)
        return cache, best_n

    def _best(self, space: str, ids: np.ndarray, most: int) -> tuple[_Entry | None, int]:
        best: _Entry | None = None
        best_n = 0
        for entry in list(self._entries.values()):
            if entry.space != space:
                continue
            n = min(common_prefix(entry.tokens, ids), most)
            if n < len(entry.tokens) and not entry.trims:
                continue  # a state that cannot trim serves only prompts that contain all of it
            if n > best_n:
                best, best_n = entry, n
        return best, best_n

    def _from_disk(self, space: str, ids: np.ndarray, have: int) -> None:
        """Bring into memory the state on disk that covers most of `ids`, if more than `have`: one
        whose tokens `ids` contain all of, or, for a model whose states all trim (no checkpoints),
        one sharing at least the disk's `min_tokens` with it (a conversation's end, serving another
        conversation with the same long system prompt once trimmed)."""
        if self.disk is None or self.model is None:
            return
        found, found_n = None, have
        for entry in self.disk.entries():
            if entry.space != space:
                continue
            n = min(common_prefix(np.asarray(entry.tokens), ids), len(ids) - 1)
            serves = n == len(entry.tokens) or (not self.checkpoints and n >= self.disk.min_tokens)
            if serves and n > found_n:
                found, found_n = entry, n
        if found is not None:
            cache = self.disk.load(found, self.model)
            if cache is not None:
                self.put(space, found.tokens, cache, to_disk=False)

    def put(
        self,
        space: str,
        tokens: list[int],
        cache: list,
        to_disk: bool = True,
        labels: Iterable[tuple[int, bytes]] = (),
    ) -> bool:
        """Keep a copy of `cache`, which holds exactly `tokens`; False when it alone is over the
        budget. Stored states that it makes useless (the same tokens, or a prefix of them in a
        state that trims, which this one serves by trimming) go, and their labels come here.
        `labels`: (prompt position, message-prefix key) of the prompt `tokens` begin with; the
        state keeps those it serves exactly: at its own length, or at any length if it trims."""
        if not tokens:
            return False
        trims = can_trim_prompt_cache(cache) and always_trims(cache)
        held = clone_cache(cache)
        nbytes = cache_bytes(held)
        if nbytes > self.budget_bytes:
            return False
        ids = np.asarray(tokens, dtype=np.int64)
        kept = {k: n for n, k in labels if n == len(ids) or (trims and n <= len(ids))}
        with self._lock:
            for key, entry in list(self._entries.items()):
                if entry.space != space or len(entry.tokens) > len(ids):
                    continue
                same = len(entry.tokens) == len(ids)
                if common_prefix(entry.tokens, ids) == len(entry.tokens) and (same or (trims and entry.trims)):
                    kept = {**entry.labels, **kept}
                    self._drop(key)
            self._entries[self._next_id] = _Entry(space, ids, held, nbytes, trims, kept)
            self._next_id += 1
            self.bytes += nbytes
            self.stats.stored += 1
            while self.bytes > self.budget_bytes and self._entries:
                self._drop(next(iter(self._entries)))
                self.stats.evicted += 1
        if to_disk and self.disk is not None:
            self.disk.save(space, list(tokens), held)
        return True

    def held(self, most: int) -> list[tuple[bytes, int]]:
        """The labels of the stored states, most recently used first, at most `most`: what a
        node reports of what it holds (never a token)."""
        out: dict[bytes, int] = {}
        with self._lock:
            for entry in reversed(self._entries.values()):
                for key, n in entry.labels.items():
                    if len(out) >= most:
                        return list(out.items())
                    out[key] = max(out.get(key, 0), n)
        return list(out.items())

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0

    def _key(self, entry: _Entry) -> int:
        return next(k for k, e in self._entries.items() if e is entry)

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        self.bytes -= entry.nbytes


@dataclass
class PrefixSession:
    """One request's use of the prefix cache, driven by the engine that runs it (engine/generation.py's
    `Generator`, engine/batching.py's `BatchEngine`) on the MLX thread."""

    owner: PrefixCache
    space: str
    prompt: list[int]
    boundaries: list[int]
    labels: list[tuple[int, bytes]] = field(default_factory=list)
    reused: int = 0
    _marks: list[int] = field(default_factory=list)
    _trims: bool | None = None

    def start(self) -> tuple[list | None, int]:
        """The cache to start from (None: a fresh one) and the prompt tokens it already holds."""
        cache, self.reused = self.owner.take(self.space, self.prompt)
        return cache, self.reused

    def plan(self, cache: list) -> None:
        """Where to checkpoint this prompt while it is fed into `cache` (nowhere when the state
        trims: the end of the reply then serves every prefix)."""
        self._trims = always_trims(cache)
        if self._trims:
            self._marks = []
            return
        every = self.owner.checkpoint_every
        end = len(self.prompt) - 1  # the prefill feeds all but the last token in chunks
        marks = set(self.boundaries) | set(range(every, end + 1, every))
        self._marks = sorted(m for m in marks if self.reused + CHECKPOINT_MIN_GAP <= m <= end)

    def marks_within(self, start: int, end: int) -> list[int]:
        """The checkpoints after `start` and up to `end` prompt tokens, in order."""
        return [m for m in self._marks if start < m <= end]

    def next_mark(self, fed: int) -> int | None:
        """The next checkpoint after `fed` prompt tokens, if any."""
        return next((m for m in self._marks if m > fed), None)

    def at(self, fed: int, history: list[int], cache: list) -> None:
        """Checkpoint `cache` if `fed` (== len(history)) is a mark."""
        if fed in self._marks and len(history) == fed:
            self.owner.put(self.space, history, cache, labels=self.labels)

    def finish(self, history: list[int], cache: list) -> None:
        """Keep the state at the end of the reply (`cache` holds exactly `history`)."""
        self.owner.put(self.space, history, cache, labels=self.labels)
