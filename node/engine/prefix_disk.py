"""Long prompt prefixes kept on disk across restarts (issue 45): a long system prompt, a document,
an agent's tool list. The prefix cache (engine/prefix_cache.py) writes each state of at least
`MIN_TOKENS` tokens here and, when no state in memory covers as much of a prompt, loads the
longest one on disk that does.

One file a state, in safetensors (as mlx-lm's `save_prompt_cache`: arrays, strings in the
metadata), named by a hash of the model commit, the prefix space
and the tokens. mlx-lm's own loader is not used: it rebuilds each cache without its constructor
(an `ArraysCache` then lacks attributes a layer reads) and drops `meta_state`, so only states
whose layers are all `KVCache` or `ArraysCache` (what the state alone describes) are written, and
they are loaded into a fresh `make_prompt_cache` of the model. A file is written to a temporary
name and renamed (a crash leaves no half file under a real name), and checked on load: the
model commit, the space and the tokens' hash must match, and anything unreadable is deleted,
never used. Oldest first go beyond the disk budget.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

logger = logging.getLogger(__name__)

MIN_TOKENS = 1024  # shorter prefixes are cheap to feed again
FORMAT = "expertmesh-prefix-1"


def _tokens_digest(tokens: list[int]) -> str:
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()


@dataclass
class DiskPrefix:
    path: Path
    space: str
    tokens: list[int]


def _flatten(cache: list) -> tuple[dict[str, mx.array], list[list[bool]]]:
    """Each layer's arrays by name ("layer.slot"), and which slots of each layer hold one: a
    KVCache's keys and values up to its offset, an ArraysCache's slots (None where still empty)."""
    arrays, slots = {}, []
    for i, c in enumerate(cache):
        if isinstance(c, KVCache):  # what it holds, without the room it keeps for the next tokens
            parts = [None, None] if c.keys is None else [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
        else:
            parts = list(c.cache)
        slots.append([a is not None for a in parts])
        arrays.update({f"{i}.{j}": a for j, a in enumerate(parts) if a is not None})
    return arrays, slots


def _restore(cache: list, arrays: dict[str, mx.array], slots: list[list[bool]]) -> None:
    if len(slots) != len(cache):
        raise ValueError("its layers are not this model's")
    for i, (c, held) in enumerate(zip(cache, slots)):
        parts = [arrays[f"{i}.{j}"] if present else None for j, present in enumerate(held)]
        if isinstance(c, KVCache):
            if len(parts) != 2:
                raise ValueError("its attention cache is not this model's")
            c.keys, c.values = parts
            c.offset = 0 if c.keys is None else c.keys.shape[2]
        else:
            if len(parts) != len(c.cache):
                raise ValueError("its recurrent state is not this model's")
            c.cache = parts


def storable(cache: list) -> bool:
    """Whether the state alone describes every layer of `cache` (see the module's docstring)."""
    return all(type(c) in (KVCache, ArraysCache) for c in cache)


@dataclass
class StoredPrefix:
    """One file as `expertmesh cache --prefixes` lists it."""

    commit: str
    path: Path
    tokens: int
    nbytes: int
    used: float  # when it was last written or loaded (its mtime)


def stored_prefixes(root: Path) -> list[StoredPrefix]:
    """Every prefix file under `root` (the home's `prefixes/`), least recently used first; an
    unreadable one is left out (a node deletes it when it next starts)."""
    out = []
    for folder in sorted(p for p in Path(root).glob("*") if p.is_dir()):
        for entry in _scan(folder, None, drop=False):
            st = entry.path.stat()
            out.append(StoredPrefix(folder.name, entry.path, len(entry.tokens), st.st_size, st.st_mtime))
    return sorted(out, key=lambda p: p.used)


def prune_prefixes(root: Path, budget_bytes: int) -> int:
    """Delete the least recently used prefix files until they hold at most `budget_bytes`;
    returns how many were deleted."""
    stored = stored_prefixes(root)
    total, gone = sum(p.nbytes for p in stored), 0
    for p in stored:
        if total <= budget_bytes:
            break
        p.path.unlink(missing_ok=True)
        total -= p.nbytes
        gone += 1
    return gone


class PrefixDisk:
    """The files of one model's prefixes under `root` (the home's `prefixes/<commit>`)."""

    def __init__(self, root: Path, commit: str, budget_bytes: int, min_tokens: int = MIN_TOKENS):
        self.root, self.commit, self.budget_bytes = Path(root), commit, budget_bytes
        self.min_tokens = min_tokens  # a test's tiny model proves the tier with shorter prefixes
        self.root.mkdir(parents=True, exist_ok=True)
        self._index: dict[Path, DiskPrefix] = {e.path: e for e in _scan(self.root, commit, drop=True)}
        self._prune()  # a budget lowered since the files were written

    def entries(self) -> list[DiskPrefix]:
        return list(self._index.values())

    def _name(self, space: str, tokens: list[int]) -> Path:
        key = hashlib.sha256(f"{self.commit}\0{space}\0{_tokens_digest(tokens)}".encode()).hexdigest()[:40]
        return self.root / f"{key}.safetensors"

    def save(self, space: str, tokens: list[int], cache: list) -> bool:
        """Write the state (MLX thread); False when it is too short, not storable or written already."""
        if len(tokens) < self.min_tokens or not storable(cache):
            return False
        path = self._name(space, tokens)
        if path in self._index:
            return False
        meta = {
            "format": FORMAT,
            "commit": self.commit,
            "space": space,
            "tokens": json.dumps(tokens),
            "tokens_sha256": _tokens_digest(tokens),
            "classes": json.dumps([type(c).__name__ for c in cache]),
        }
        arrays, slots = _flatten(cache)
        meta["slots"] = json.dumps(slots)
        tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
        try:
            mx.eval(list(arrays.values()))
            arrays = {k: mx.contiguous(v) for k, v in arrays.items()}  # a slice is saved as its own bytes
            mx.save_safetensors(str(tmp), arrays, meta)
            os.replace(tmp, path)
        except OSError as e:
            logger.warning("a prompt prefix could not be written to %s: %s", self.root, e)
            tmp.unlink(missing_ok=True)
            return False
        self._index[path] = DiskPrefix(path, space, list(tokens))
        self._prune()
        return True

    def load(self, entry: DiskPrefix, model: nn.Module) -> list | None:
        """The state in `entry`'s file, in a fresh cache of `model` (MLX thread); None (and the
        file deleted) when it is damaged or not this model's."""
        try:
            loaded = mx.load(str(entry.path), return_metadata=True)
            if not isinstance(loaded, tuple):
                raise ValueError("no metadata")
            arrays: dict[str, mx.array] = dict(loaded[0])
            meta: dict[str, str] = dict(loaded[1])
            if (
                meta.get("format") != FORMAT
                or meta.get("commit") != self.commit
                or meta.get("space") != entry.space
                or meta.get("tokens_sha256") != _tokens_digest(json.loads(meta.get("tokens", "null")))
            ):
                raise ValueError("not this model's prefix, or its tokens do not match")
            cache = make_prompt_cache(model)
            if json.loads(meta["classes"]) != [type(c).__name__ for c in cache]:
                raise ValueError("its caches are not this model's")
            _restore(cache, arrays, json.loads(meta["slots"]))
            mx.eval(
                [a for c in cache for a in ([c.keys, c.values] if isinstance(c, KVCache) else c.cache) if a is not None]
            )
        except Exception as e:  # noqa: BLE001 - a damaged or foreign file is dropped, never used
            logger.warning("dropped a damaged prompt prefix %s: %s", entry.path.name, e)
            self.forget(entry)
            return None
        os.utime(entry.path)  # used: the last to go
        return cache

    def forget(self, entry: DiskPrefix) -> None:
        self._index.pop(entry.path, None)
        entry.path.unlink(missing_ok=True)

    def _prune(self) -> None:
        sizes = {p: p.stat().st_size for p in self._index if p.exists()}
        total = sum(sizes.values())
        for path in sorted(sizes, key=lambda p: p.stat().st_mtime):
            if total <= self.budget_bytes:
                break
            total -= sizes[path]
            self.forget(self._index[path])


def _scan(root: Path, commit: str | None, drop: bool) -> list[DiskPrefix]:
    """The prefixes (of `commit`, if given) under `root`, from their headers (`drop`: delete the unreadable)."""
    found = []
    for path in sorted(Path(root).glob("*.safetensors")):
        entry = _read_header(path, commit, drop)
        if entry is not None:
            found.append(entry)
    return found


def _read_header(path: Path, commit: str | None, drop: bool) -> DiskPrefix | None:
    """The space and tokens from a file's safetensors header (the arrays are not read)."""
    try:
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 64 << 20:
                raise ValueError("header too large")
            meta = json.loads(f.read(n))["__metadata__"]
        if meta.get("format") != FORMAT or (commit is not None and meta.get("commit") != commit):
            return None  # another model's (or not ours): left alone
        return DiskPrefix(path, meta["space"], json.loads(meta["tokens"]))
    except Exception as e:  # noqa: BLE001 - unreadable: dropped
        if drop:
            logger.warning("dropped an unreadable prompt prefix %s: %s", path.name, e)
            path.unlink(missing_ok=True)
        return None
