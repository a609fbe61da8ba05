"""The expert store: RAM -> disk -> (peers, later) -> Hub, behind one call per layer.

The engine asks for the distinct experts of one layer at once; the store answers from RAM what it
can and fetches the rest concurrently, each from the first byte source that has it. Sources are
an ordered list of `ByteSource`s, so a peers tier slots in between the disk and the Hub without
the engine noticing. Bytes that came from further away are written to the disk cache, and every
use is counted by the tier that answered it.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterable, Protocol

from node.cache_policies import DEFAULT_POLICY, make_policy
from node.errors import DownloadError
from node.expert_codec import ExpertCodec, ExpertWeights
from node.expert_digests import DigestBook, sha256
from node.expert_index import ExpertIndex, ExpertLocation

logger = logging.getLogger(__name__)

ExpertKey = tuple[int, int]  # (layer, expert) within the store's pinned (repo, commit)
SOURCES = ("ram", "disk", "peer", "hub")
DEFAULT_FETCH_CONCURRENCY = 8


class ByteSource(Protocol):
    """Somewhere an expert's upstream bytes can come from."""

    name: str  # the `source` it is counted as: disk | peer | hub

    def fetch(self, loc: ExpertLocation) -> bytes | None:
        """The expert's blob (its byte ranges concatenated), or None if this source lacks it."""


class ByteSink(Protocol):
    def put(self, loc: ExpertLocation, blob: bytes) -> None:
        """Keep a copy; failing to keep one is not an error for the caller."""


@dataclass
class StoreStats:
    """Expert uses and upstream bytes by source; thread-safe, cumulative."""

    uses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    fetch_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0.0))
    integrity_failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record_integrity_failure(self, source: str) -> None:
        with self._lock:
            self.integrity_failures[source] += 1

    def record(self, source: str, nbytes: int, seconds: float = 0.0) -> None:
        with self._lock:
            self.uses[source] += 1
            self.bytes[source] += nbytes
            self.fetch_seconds[source] += seconds

    def snapshot(self) -> "StoreStats":
        with self._lock:
            return StoreStats(dict(self.uses), dict(self.bytes), dict(self.fetch_seconds), dict(self.integrity_failures))

    def since(self, before: "StoreStats") -> "StoreStats":
        now = self.snapshot()
        return StoreStats({k: now.uses[k] - before.uses[k] for k in SOURCES},
                          {k: now.bytes[k] - before.bytes[k] for k in SOURCES},
                          {k: now.fetch_seconds[k] - before.fetch_seconds[k] for k in SOURCES},
                          {k: now.integrity_failures[k] - before.integrity_failures[k] for k in SOURCES})  # fmt: skip

    @property
    def total_uses(self) -> int:
        return sum(self.uses.values())


class RamCache:
    """Decoded experts within a byte budget, kept by a replacement policy (node/cache_policies.py).

    The budget becomes a number of slots of one decoded expert's size (a model's experts share
    one size). The experts a layer is using stay alive through the caller's references even
    when the budget is smaller than one layer, so a tiny budget costs refetches, never wrong answers.
    """

    def __init__(self, budget_bytes: int, policy: str = DEFAULT_POLICY):
        self.budget_bytes = budget_bytes
        self.policy_name = policy
        make_policy(policy, 0)  # an unknown name fails here, not at the first expert
        self._policy = None  # made at the first put, once an expert's size is known
        self._items: dict[ExpertKey, ExpertWeights] = {}
        self._lock = threading.Lock()
        self.nbytes = 0
        self.evictions = 0

    def get(self, key: ExpertKey) -> ExpertWeights | None:
        with self._lock:
            weights = self._items.get(key)
            if weights is not None:
                self._policy.access(key)
            return weights

    def put(self, key: ExpertKey, weights: ExpertWeights) -> None:
        with self._lock:
            if key in self._items:
                return
            if self._policy is None:
                self._policy = make_policy(self.policy_name, self.budget_bytes // max(1, weights.nbytes))
            _, evicted = self._policy.access(key)
            self._items[key] = weights
            self.nbytes += weights.nbytes
            for old in evicted:
                gone = self._items.pop(old, None)
                if gone is not None:
                    self.nbytes -= gone.nbytes
                    self.evictions += 1

    def keys(self) -> list[ExpertKey]:
        with self._lock:
            return list(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: ExpertKey) -> bool:
        return key in self._items


class HubSource:
    """Expert bytes by range requests to the upstream shards, strict 206 or an error."""

    name = "hub"

    def __init__(self, index: ExpertIndex, reader=None):
        from node.hub_client import RangeReader

        self.index = index
        self.reader = reader or RangeReader()

    def fetch(self, loc: ExpertLocation) -> bytes:
        from node.hub_client import RemoteFile, endpoint

        parts = []
        try:
            for r in loc.ranges:
                data = self.reader.read(RemoteFile(self.index.repo_id, self.index.commit, r.file), r.start, r.end)
                if len(data) != r.nbytes:
                    raise DownloadError(f"{self.index.repo_id} {r.file}: asked for {r.nbytes} bytes, got {len(data)}")
                parts.append(data)
        except DownloadError as e:
            raise DownloadError(f"expert {loc.expert} of layer {loc.layer} from the Hub at {endpoint()}: {e}; "
                                "what was fetched is cached, so running again continues") from None  # fmt: skip
        return b"".join(parts)


class ExpertStore:
    """Experts of one pinned model, from the nearest tier that has them.

    Args:
        index: where every expert lives upstream.
        codec: turns blobs into kernel arrays.
        ram: the RAM tier.
        sources: byte sources nearest first (disk, peers, Hub); the last must always answer.
        sinks: where bytes from further away are kept (the disk cache).
        digests: the sha256 of each expert, checked on every copy not from RAM (None: no checks).
    """

    def __init__(self, index: ExpertIndex, codec: ExpertCodec, ram: RamCache, sources: list[ByteSource],
                 sinks: Iterable[ByteSink] = (), concurrency: int = DEFAULT_FETCH_CONCURRENCY,
                 digests: DigestBook | None = None):  # fmt: skip
        self.index = index
        self.digests = digests
        self.trace = None  # a TraceWriter (node/routing_trace.py) records every call when set
        self.codec = codec
        self.ram = ram
        self.sources = sources
        self.sinks = list(sinks)
        self.stats = StoreStats()
        self._pool = ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="expert-fetch")
        self._inflight: dict[ExpertKey, Future] = {}
        self._lock = threading.Lock()

    def get_layer(self, layer: int, experts: Iterable[int]) -> dict[int, ExpertWeights]:
        """The given experts of `layer`, fetching the ones not in RAM concurrently."""
        experts = [int(e) for e in experts]
        if self.trace is not None:
            self.trace.record(layer, experts)
        out: dict[int, ExpertWeights] = {}
        waiting: dict[int, Future] = {}
        for e in experts:
            e = int(e)
            weights = self.ram.get((layer, e))
            if weights is not None:
                out[e] = weights
                self.stats.record("ram", self.index.expert(layer, e).nbytes)
            else:
                waiting[e] = self._fetch_once((layer, e))
        for e, fut in waiting.items():
            out[e] = fut.result()
        return out

    def _fetch_once(self, key: ExpertKey) -> Future:
        """Single flight: concurrent requests for one expert share one fetch."""
        with self._lock:
            fut = self._inflight.get(key)
            if fut is None:
                fut = self._pool.submit(self._fetch_and_forget, key)
                self._inflight[key] = fut
            return fut

    def _fetch_and_forget(self, key: ExpertKey) -> ExpertWeights:
        # Not a done-callback: one added to a finished future runs at once in the adding thread,
        # which holds the lock then, and deadlocked. Here the lock also orders the pop after the insert.
        try:
            return self._fetch(key)
        finally:
            with self._lock:
                self._inflight.pop(key, None)

    def _fetch(self, key: ExpertKey) -> ExpertWeights:
        loc = self.index.expert(*key)
        for source in self.sources:
            t0 = time.perf_counter()
            blob = source.fetch(loc)
            if blob is None:
                continue
            if len(blob) != loc.nbytes:  # a source must never hand over a partial expert
                raise DownloadError(f"{source.name} gave {len(blob)} bytes for expert {key}, expected {loc.nbytes}")
            if not self._verify(key, source, blob):
                continue
            weights = self.codec.decode(loc, blob)
            self.stats.record(source.name, loc.nbytes, time.perf_counter() - t0)
            if source.name != "disk":
                for sink in self.sinks:
                    sink.put(loc, blob)
            self.ram.put(key, weights)
            return weights
        raise DownloadError(f"expert {key} of {self.index.repo_id}: no source has a good copy")

    def _verify(self, key: ExpertKey, source: ByteSource, blob) -> bool:
        """Check a copy against the digest recorded at first fetch, or record it if this is the first.

        Only bytes that passed the Hub's (or a peer's) checks may become the reference; a disk copy
        without a recorded digest is unverifiable and treated like a bad one.
        """
        if self.digests is None:
            return True
        digest = sha256(blob)
        known = self.digests.get(key)
        if known is None and source.name != "disk":
            self.digests.record(key, digest)
            return True
        if digest == known:
            return True
        self.stats.record_integrity_failure(source.name)
        logger.warning("expert %s from %s failed its sha256 check; discarding that copy", key, source.name)
        discard = getattr(source, "discard", None)
        if discard is not None:
            discard(self.index.expert(*key))
        return False

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.trace is not None:
            self.trace.close()
