"""Auditing what the household vouched for: a sample of the experts whose recorded digest came from
a peer's copy is checked against fresh copies from the Hub, on an idle link.

Why: a peer's first copy of an expert becomes its reference here (store/integrity.py), and nothing
on the household's path can tell a wrong copy from a right one: the peer's own records say what it
believes, and a member whose first Hub fetch was damaged believes its damage. Left alone, that copy
spreads through the household and every token computed with it is wrong.

What it costs: one in AUDIT_EVERY of the records each peer vouched for, drawn at random, so the
peer cannot tell which of its copies are checked: at most 1/AUDIT_EVERY of the household's expert
bytes again from the Hub (a peer's first copy in each process is checked apart, before it is
used: store/tier_chain.py). An audit is one Hub download (two when the first disagrees), made by
the fill's rule (store/fill.py): while a generation is going on and neither a demand nor a guess
wants the link (store/flights.py), at the fill's priority in the Hub's pool; or after
AUDIT_BUSY_BOUND_S of generations that never left the link idle. Its bytes are
counted apart from the experts' uses (`StoreStats.audit_bytes`). Experts two peers' copies
disagreed on (store/tier_chain.py) are audited first, beyond the sample. A peer's very first copy
is not left to the sample: it is checked before it is used (`TierChain`'s first-copy check).

What it decides, as `expertmesh verify` does (store/origin_check.py): a fresh copy equal to the
record confirms it (`v`: the peer's copy and the Hub's agree); two Hub copies that agree against
it show the peer wrong (`TierChain.correct`: its records are forgotten and it is no longer
asked); three different answers leave the record as it is (`undecided`).

What it catches: a peer wrong in a fraction f of its copies after about AUDIT_EVERY / f of them,
each of which is also caught by any later fetch of that expert from the Hub (a peer wrong in every
copy is caught by the check of its first).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter

from expertmesh.node.fetching import FetchContext, Priority
from expertmesh.node.model.expert_index import ExpertIndex
from expertmesh.node.store.flights import Flights
from expertmesh.node.store.origin_check import check_against_origin
from expertmesh.node.store.stats import ExpertKey, StoreStats
from expertmesh.node.store.tier_chain import TierChain
from expertmesh.node.store.tiers import Tier

logger = logging.getLogger(__name__)

# one in this many of a peer's records: a peer wrong in every copy is caught by the check of its
# first, so the sample is for rarer damage, at 0.4% more Hub bytes (1/32 cost 9% for a household of four)
AUDIT_EVERY = 256
AUDIT_ACTIVE_S = 2.0  # audits run while a layer was asked for within this many seconds (as fills do)
AUDIT_RECHECK_S = 5.0  # how often the book is looked at again when nothing is due
AUDIT_BACKOFF_S = 60.0  # after the Hub failed an audit (offline, rate-limited), before the next
# A household's decode asks its peers at every layer, so its link is never idle: an audit due
# waits at most this long of busy generations, then goes anyway (at the fill's priority in the
# Hub's pool, behind every demand's piece): at most one expert a minute from the Hub.
AUDIT_BUSY_BOUND_S = 60.0
AUDIT = FetchContext(Priority.FILL)


class PeerAudit:
    """One thread that audits peers' copies against `origin` (the Hub tier) on an idle link."""

    def __init__(
        self,
        index: ExpertIndex,
        chain: TierChain,
        origin: Tier,
        flights: Flights,
        stats: StoreStats,
        rng: random.Random | None = None,
    ):
        if chain.digests is None:
            raise ValueError("auditing needs the digest book")
        self.index = index
        self.chain = chain
        self.digests = chain.digests
        self.origin = origin
        self.flights = flights
        self.stats = stats
        self._rng = rng or random.SystemRandom()  # unpredictable to a peer
        self._lock = threading.Lock()
        self._audited: set[ExpertKey] = set()
        self._audits_of: Counter[str] = Counter()  # peer -> records of it audited in this process
        self._suspects: list[ExpertKey] = []
        self._active_until = -1.0
        self._cap = max((loc.nbytes for loc in index.experts.values()), default=1)
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="peer-audit", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def touch(self) -> None:
        """A generation asked for a layer: the link may be used while it is otherwise idle."""
        self._active_until = time.monotonic() + AUDIT_ACTIVE_S

    def suspect(self, key: ExpertKey) -> None:
        """Two copies of `key` from the household disagreed: audit it before the sample."""
        with self._lock:
            if key not in self._suspects:
                self._suspects.append(key)
        self._wake.set()

    def forgotten(self, peer: str) -> None:
        """`peer`'s records were forgotten: what it vouches for from now on is sampled afresh."""
        with self._lock:
            self._audits_of.pop(peer, None)

    def due(self) -> ExpertKey | None:
        """The next record to audit, or None when the sample is complete for now."""
        vouched = self.digests.vouched()
        with self._lock:
            while self._suspects:
                key = self._suspects.pop(0)
                if key in vouched:
                    return key
            by_peer: dict[str, list[ExpertKey]] = {}
            for key, peer in vouched.items():
                if key not in self._audited:
                    by_peer.setdefault(peer, []).append(key)
            for peer, keys in sorted(by_peer.items()):
                done = self._audits_of[peer]
                if done < (len(keys) + done) // AUDIT_EVERY:
                    return self._rng.choice(keys)
        return None

    def audit(self, key: ExpertKey) -> str | None:
        """Check `key`'s record against the Hub now; its outcome (confirmed | wrong | undecided |
        failed), or None when there was nothing to audit."""
        peer, recorded = self.digests.vouched_by(key), self.digests.get(key)
        if peer is None or recorded is None:
            return None  # verified or forgotten meanwhile
        try:
            # not given up to a demand: the Hub's pool serves demands' pieces first, and bytes
            # fetched and dropped halfway would be bytes nobody counted
            verdict = check_against_origin(self.origin, self.index.expert(*key), recorded, AUDIT)
        except Exception as e:  # noqa: BLE001 - an audit that cannot be made now is made later
            self.stats.record_audit("failed", 0)
            logger.info("could not audit expert %s against the Hub (%s); trying again later", key, e)
            return "failed"
        with self._lock:
            self._audited.add(key)
            self._audits_of[peer] += 1
        self.chain.settle(key, verdict)
        return verdict.outcome

    def _loop(self) -> None:
        while not self._closing.is_set():
            key = self.due()
            if key is None:
                self._wake.wait(AUDIT_RECHECK_S)
                self._wake.clear()
                continue
            if not self.flights.wait_for_idle_link(
                self._cap, lambda: self._active_until, self._closing.is_set, AUDIT_BUSY_BOUND_S
            ):
                return
            if self.audit(key) == "failed":
                self._closing.wait(AUDIT_BACKOFF_S)

    def stop(self) -> None:
        self._closing.set()
        self._wake.set()
        self.flights.notify()

    def join(self, timeout_s: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout_s)
