"""What the store counts: expert uses, bytes and fetch time by the tier that answered, integrity
failures, the fate of prefetched guesses and of remote execution. Summaries, `Info` and
`/metrics` all read these same counters, so no two views of one generation disagree."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

ExpertKey = tuple[int, int]  # (layer, expert) within the store's pinned (repo, commit)

# remote: computed by the peer that holds it (activations moved, not the expert); its expert bytes
# are 0, and the LAN bytes of its activations are in `remote` (sent_bytes, received_bytes)
SOURCES = ("ram", "disk", "peer", "hub", "remote")
# issued: guesses fetched; used: demanded by the pass they were for; wasted: not demanded, dropped;
# ready: used guesses that had arrived before their demand (no wait: as good as a RAM hit);
# filled: fetched onto the disk on an idle link (not a guess: see store/fill.py)
PREFETCH_OUTCOMES = ("issued", "used", "wasted", "ready", "filled")
# remote execution (household/remote_experts.py): calls made, activation bytes each way, and
# experts a peer was asked for that were fetched and computed here instead, by why
REMOTE_COUNTS = (
    "calls",
    "sent_bytes",
    "received_bytes",
    "fallback_error",
    "fallback_deadline",
    "fallback_bad_output",
    "fallback_missing",
)
# checks of peers' copies against the Hub (each peer's first, store/tier_chain.py; a sample,
# store/peer_audit.py): the record confirmed, shown wrong
# (replaced, its peer no longer trusted), undecided (three different copies), or not made (the Hub failed)
AUDIT_OUTCOMES = ("confirmed", "wrong", "undecided", "failed")
# checks of peers' ComputeExperts answers computed again here (household/compute_audit.py): right,
# wrong (the peer no longer trusted), or not made (the expert could not be had here)
COMPUTE_AUDIT_OUTCOMES = ("confirmed", "wrong", "failed")
# how each MoE layer of a pass ran: resident (every expert of the layer in a slot: no sync, the
# experts mapped to slots on the device) or streamed (a sync to read the routing, then the store)
LAYER_PASSES = ("resident", "streamed")


@dataclass
class StoreStats:
    """Expert uses and upstream bytes by source; thread-safe, cumulative."""

    uses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    fetch_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0.0))
    integrity_failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    prefetch: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PREFETCH_OUTCOMES, 0))
    remote: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REMOTE_COUNTS, 0))
    layers: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LAYER_PASSES, 0))
    # what generation waited for over a link: the bytes of demanded experts that came from the
    # Hub or a peer (not in RAM, not an arrived guess, not on disk), and the seconds the layer
    # calls that waited for them waited
    waited_bytes: int = 0
    wait_seconds: float = 0.0
    audits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(AUDIT_OUTCOMES, 0))
    audit_bytes: int = 0  # fetched from the Hub by audits: not a use of any expert
    compute_audits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COMPUTE_AUDIT_OUTCOMES, 0))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # called as observer(source, nbytes, seconds) after each use (observability/metrics.py: the fetch histogram)
    observer: Callable[[str, int, float], None] | None = field(default=None, repr=False, compare=False)

    def record_prefetch(self, outcome: str, n: int = 1) -> None:
        with self._lock:
            self.prefetch[outcome] += n

    def record_remote(self, **counts: int) -> None:
        with self._lock:
            for k, n in counts.items():
                self.remote[k] += n

    def record_layer(self, how: str) -> None:
        with self._lock:
            self.layers[how] += 1

    def record_wait(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.waited_bytes += nbytes
            self.wait_seconds += seconds

    def record_audit(self, outcome: str | None, nbytes: int) -> None:
        """An audit's `outcome` (None: given up to a demand, to be made again) and its Hub bytes."""
        with self._lock:
            if outcome is not None:
                self.audits[outcome] += 1
            self.audit_bytes += nbytes

    def record_compute_audit(self, outcome: str) -> None:
        with self._lock:
            self.compute_audits[outcome] += 1

    def record_integrity_failure(self, source: str) -> None:
        with self._lock:
            self.integrity_failures[source] += 1

    def record(self, source: str, nbytes: int, seconds: float = 0.0) -> None:
        with self._lock:
            self.uses[source] += 1
            self.bytes[source] += nbytes
            self.fetch_seconds[source] += seconds
        if self.observer is not None:
            self.observer(source, nbytes, seconds)

    def record_ram(self, sizes: list[int]) -> None:
        """Uses answered from RAM at once, one per size in `sizes` (a resident layer's experts)."""
        with self._lock:
            self.uses["ram"] += len(sizes)
            self.bytes["ram"] += sum(sizes)
        if self.observer is not None:
            for nbytes in sizes:
                self.observer("ram", nbytes, 0.0)

    def snapshot(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                dict(self.uses),
                dict(self.bytes),
                dict(self.fetch_seconds),
                dict(self.integrity_failures),
                dict(self.prefetch),
                dict(self.remote),
                dict(self.layers),
                self.waited_bytes,
                self.wait_seconds,
                dict(self.audits),
                self.audit_bytes,
                dict(self.compute_audits),
            )

    def since(self, before: StoreStats) -> StoreStats:
        now = self.snapshot()
        return StoreStats(
            {k: now.uses[k] - before.uses[k] for k in SOURCES},
            {k: now.bytes[k] - before.bytes[k] for k in SOURCES},
            {k: now.fetch_seconds[k] - before.fetch_seconds[k] for k in SOURCES},
            {k: now.integrity_failures[k] - before.integrity_failures[k] for k in SOURCES},
            {k: now.prefetch[k] - before.prefetch[k] for k in PREFETCH_OUTCOMES},
            {k: now.remote[k] - before.remote[k] for k in REMOTE_COUNTS},
            {k: now.layers[k] - before.layers[k] for k in LAYER_PASSES},
            now.waited_bytes - before.waited_bytes,
            now.wait_seconds - before.wait_seconds,
            {k: now.audits[k] - before.audits[k] for k in AUDIT_OUTCOMES},
            now.audit_bytes - before.audit_bytes,
            {k: now.compute_audits[k] - before.compute_audits[k] for k in COMPUTE_AUDIT_OUTCOMES},
        )

    @property
    def total_uses(self) -> int:
        return sum(self.uses.values())
