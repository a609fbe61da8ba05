"""The tiers after RAM as one fetch: nearest first, every copy checked, remote copies kept on disk.

An expert is asked of the disk, then of each remote tier (peers, the Hub) until one gives bytes
that match the expert's recorded sha256 (store/integrity.py). A copy that fails is discarded by
its tier and counted; a remote tier is asked again a few times, since a transfer can be damaged
where the source is not. Bytes from beyond this machine are decoded for MLX and written to the
disk cache, so the next use of the expert is a disk hit; in a household, a copy from a peer is
kept on disk only by the expert's owner (others hold it in RAM while they use it).

A peer's first copy of an expert becomes its reference as the Hub's would, but the record names
the peer (store/integrity.py), and the first copy a peer sends in this process is checked against
a fresh copy from the Hub (`_sender_checked`): one Hub fetch a peer, waited for a few seconds at
most, so with a Hub that answers, a member whose copies are all wrong is caught before any token
is computed with them; the rest are sampled on the idle link (store/peer_audit.py). When two fresh Hub copies that agree contradict such a record (on a
fetch here, or in the idle link's audit, store/peer_audit.py), the peer is shown to have sent
wrong bytes: every record it vouched for is forgotten, the copies made from them go from disk and
RAM (`on_forgotten`), and the household tier stops asking it (`peer_lied`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

from expertmesh.node.errors import DownloadError
from expertmesh.node.fetching import DEMAND, FetchContext
from expertmesh.node.model.codec import ExpertCodec, ExpertWeights
from expertmesh.node.model.expert_index import ExpertBytes, ExpertIndex
from expertmesh.node.store.integrity import DigestBook, book_peer_id, fast_digest, sha256
from expertmesh.node.store.origin_check import OriginVerdict, check_against_origin
from expertmesh.node.store.stats import ExpertKey, StoreStats
from expertmesh.node.store.tiers import HouseholdTier, RunFetcher, Tier
from expertmesh.node.store.tiers.disk import DiskCache

logger = logging.getLogger(__name__)

INTEGRITY_RETRIES = 2  # refetches from a remote tier whose bytes failed their sha256 check
# how long from the start of the check of a peer's first copy its fetches wait for the verdict: one
# K3 expert from the Hub takes about 0.3 s at 100 MB/s and 1.5 s at 100 Mbit/s; a check not done by
# then (a Hub that is down retries for seconds) goes on without holding the tokens
SENDER_CHECK_WAIT_S = 3.0
# a peer shown wrong: copies of it that were in flight then are refused unchecked for this long (its
# household tier stops asking it for far longer, household/membership.py's DISTRUST_S)
SENDER_WRONG_S = 60.0


@dataclass
class _SenderCheck:
    """The check of one peer's first copy: set when its verdict is in, waited for until `until`."""

    done: threading.Event
    until: float  # monotonic


@dataclass
class Fetched:
    """A decoded expert and where it came from; a fill that nobody waited for keeps its `blob`
    instead (decoding is for someone who computes with it)."""

    weights: ExpertWeights | None
    source: str
    seconds: float
    blob: ExpertBytes | None = None


class TierChain:
    """Fetches experts of one pinned model from `disk`, then `remote` tiers in order.

    Args:
        runs: the tier that fetches adjacent experts as one request (the Hub), when it is the
            only remote tier; None: every expert is fetched on its own.
        digests: the sha256 of each expert, checked on every copy not from RAM (None: no checks).
    """

    def __init__(
        self,
        index: ExpertIndex,
        codec: ExpertCodec,
        disk: DiskCache,
        remote: list[Tier],
        stats: StoreStats,
        digests: DigestBook | None = None,
        runs: RunFetcher | None = None,
    ):
        self.index = index
        self.codec = codec
        self.disk = disk
        self.remote = list(remote)
        self.tiers: list[Tier] = [disk, *self.remote]
        self.stats = stats
        self.digests = digests
        self.runs = runs
        # told of a peer shown wrong and the experts whose records went with it (the RAM tier
        # drops its copies of them, the audit samples the peer afresh)
        self.on_forgotten: Callable[[str, list[ExpertKey]], None] | None = None
        # told of an expert two peers' copies disagreed on (the audit takes it first)
        self.on_suspect: Callable[[ExpertKey], None] | None = None
        self.origin: Tier | None = next((t for t in self.remote if not t.household), None)
        self.check_senders = True  # False: a peer's copies are used unchecked (`--no-audit`)
        self._senders_lock = threading.Lock()
        self._trusted: set[str] = set()  # peers (node ids) a first copy of which the Hub confirmed here
        self._checking: dict[str, _SenderCheck] = {}  # peers whose first copy is being checked
        self._shown_wrong: dict[str, float] = {}  # peer (book id) -> when (monotonic) it was

    def fetch(self, key: ExpertKey, keep_now: bool = False, ctx: FetchContext = DEMAND, decode: bool = True) -> Fetched:
        """The expert from the nearest tier with a good copy. Bytes from beyond this machine are
        queued for the disk (written behind), or written before returning with `keep_now`.
        `ctx`: whom the fetch serves; one nobody waits for gives up its link to a demand when
        `ctx.abandon()` says so (Abandoned, not an error of a tier).

        Raises:
            DownloadError: no tier gave a good copy, or one gave the wrong number of bytes.
        """
        loc = self.index.expert(*key)
        for tier in self.tiers:
            contradicting: set[str] = set()  # digests of this tier's copies that failed the check
            for _ in range(1 if tier.local else 1 + INTEGRITY_RETRIES):
                t0 = time.perf_counter()
                blob = tier.fetch(loc, ctx)
                if blob is None:
                    break
                if len(blob) != loc.nbytes:  # a tier must never hand over a partial expert
                    raise DownloadError(f"{tier.source} gave {len(blob)} bytes for expert {key}, expected {loc.nbytes}")
                if self.verify(key, tier, blob, contradicting):
                    break
                blob = None
            if blob is None:
                continue
            if tier.household and not self._sender_checked(key, cast(HouseholdTier, tier)):
                continue  # its sender was shown to send wrong copies: the next tier (the Hub)
            if not tier.local and (not tier.household or self.disk.owns(key)):
                self.disk.put(loc, blob, wait=keep_now)
            if not decode:
                return Fetched(None, tier.source, time.perf_counter() - t0, blob)
            return Fetched(self.codec.decode(loc, blob), tier.source, time.perf_counter() - t0)
        raise DownloadError(f"expert {key} of {self.index.repo_id}: no source has a good copy")

    def decoded(self, key: ExpertKey, fetched: Fetched) -> Fetched:
        """`fetched` with its weights, decoded from its blob if it came as bytes."""
        if fetched.weights is not None:
            return fetched
        if fetched.blob is None:
            raise ValueError(f"expert {key} was fetched with neither its weights nor its bytes")
        return Fetched(self.codec.decode(self.index.expert(*key), fetched.blob), fetched.source, fetched.seconds)

    def fetch_run(
        self,
        keys: list[ExpertKey],
        keep_now: bool = False,
        ctx: FetchContext = DEMAND,
        decode: bool = True,
    ) -> list[Fetched | BaseException]:
        """Each expert of a run, fetched as one request when there are several; an expert whose
        bytes fail their checks is fetched again on its own (with `fetch`'s retries). A run whose
        request failed (its retries and its deadline spent) hands that error to each expert: asking
        again one by one would spend the budget once more per expert. Without `decode` the run's
        experts come back as bytes (`Fetched.blob`)."""
        out: list[Fetched | BaseException] = []
        blobs: Sequence[ExpertBytes | None] = [None] * len(keys)
        runs = self.runs if len(keys) > 1 else None
        t0 = time.perf_counter()
        if runs is not None:
            try:
                blobs = runs.fetch_run([self.index.expert(*k) for k in keys], ctx)
            except Exception as e:  # noqa: BLE001 - handed to each demand that joined (Abandoned too)
                return [e] * len(keys)
        seconds = (time.perf_counter() - t0) / len(keys)
        for key, blob in zip(keys, blobs):
            loc = self.index.expert(*key)
            try:
                if runs is not None and blob is not None and len(blob) == loc.nbytes and self.verify(key, runs, blob):
                    self.disk.put(loc, blob, wait=keep_now)
                    if decode:
                        out.append(Fetched(self.codec.decode(loc, blob), runs.source, seconds))
                    else:
                        out.append(Fetched(None, runs.source, seconds, blob))
                else:
                    out.append(self.fetch(key, keep_now, ctx, decode))
            except BaseException as e:  # noqa: BLE001 - handed to a demand that joined, if any
                out.append(e)
        return out

    def verify(self, key: ExpertKey, tier: Tier, blob: ExpertBytes, contradicting: set[str] | None = None) -> bool:
        """Check a copy against the digest recorded at first fetch, or record it if this is the first.

        Only bytes a remote tier vouched for may become the reference; a local copy without a
        recorded digest is unverifiable and treated like a bad one. A recorded digest can be wrong
        (a first fetch damaged in a way the 206 checks miss, a bad line in the book): when two
        fresh copies from the origin (the Hub, not a peer) agree with each other against it,
        theirs replaces it. `contradicting` collects the failed digests of one tier's attempts.
        """
        if self.digests is None:
            return True
        digest = None
        if tier.local:  # read back from this machine's disk: the fast hash recorded with it (store/integrity.py)
            if self.digests.check_local(key, blob):
                return True
        else:
            digest = sha256(blob)
            voucher = cast(HouseholdTier, tier).voucher(self.index.expert(*key)) if tier.household else None
            if self.digests.check_digest(key, digest, may_record=True, blob=blob, vouched_by=voucher):
                return True
        if contradicting is not None and digest is not None and not tier.household:
            if digest in contradicting:
                self.correct(key, digest, blob)
                return True
            contradicting.add(digest)
        if tier.household and self.on_suspect is not None and self.digests.vouched_by(key) is not None:
            self.on_suspect(key)  # this peer or the one whose copy was recorded is wrong
        self.stats.record_integrity_failure(tier.source)
        logger.warning("expert %s from %s failed its integrity check; discarding that copy", key, tier.source)
        tier.discard(self.index.expert(*key))
        return False

    def _sender_checked(self, key: ExpertKey, tier: HouseholdTier) -> bool:
        """Whether the copy of `key` that `tier` just gave may be used.

        The first copy a peer sends in this run is checked against a fresh Hub copy, in a thread
        of its own; the peer's fetches wait for the verdict for up to SENDER_CHECK_WAIT_S from the
        check's start (a Hub that answers takes well under that for one expert), and a copy of a
        peer shown wrong is refused. A verdict later than that lets the copies be used meanwhile,
        as any unchecked copy: a Hub that is down or slow must not hold the household's tokens,
        and a late "wrong" still drops the peer and all it sent (`peer_lied`). A copy that
        matched a record the Hub gave proves its sender without a check."""
        loc = self.index.expert(*key)
        peer = tier.voucher(loc)
        if peer is None or self.origin is None or self.digests is None or not self.check_senders:
            return True
        book_id = book_peer_id(peer)
        with self._senders_lock:
            if peer in self._trusted:
                return True
            check = self._checking.get(peer)
            if check is None and not self._recently_wrong(book_id):
                check = self._checking[peer] = _SenderCheck(threading.Event(), time.monotonic() + SENDER_CHECK_WAIT_S)
                threading.Thread(
                    target=self._check_sender, args=(peer, key, check), name="peer-first-copy-check", daemon=True
                ).start()
        if check is not None:
            check.done.wait(max(0.0, check.until - time.monotonic()))
        with self._senders_lock:
            if peer in self._trusted:
                return True
            wrong = self._recently_wrong(book_id)
        if wrong:
            self.digests.forget_vouched(book_id)  # what it recorded while the check ran
            return False
        return True  # no verdict in time: used unchecked, as before the check existed

    def _recently_wrong(self, peer: str) -> bool:
        """Whether `peer` (a book id) was shown wrong within SENDER_WRONG_S (the senders' lock held)."""
        at = self._shown_wrong.get(peer)
        return at is not None and time.monotonic() - at < SENDER_WRONG_S

    def _check_sender(self, peer: str, key: ExpertKey, check: _SenderCheck) -> None:
        """Check `peer`'s copy of `key` against the origin, and settle what it shows."""
        assert self.digests is not None and self.origin is not None
        trusted = True
        try:
            if self.digests.vouched_by(key) == book_peer_id(peer):
                verdict = check_against_origin(
                    self.origin, self.index.expert(*key), self.digests.get(key) or "", DEMAND
                )
                self.settle(key, verdict)
                trusted = verdict.outcome != "wrong"
            # else the copy matched a record the Hub gave (or one confirmed): that proves it
        except Exception as e:  # noqa: BLE001 - the Hub cannot say now: the peer's copies are used as before
            self.stats.record_audit("failed", 0)
            logger.warning(
                "could not check peer %s's first copy against %s (%s): trusting it", peer, self.origin.source, e
            )
        finally:
            with self._senders_lock:
                if trusted:
                    self._trusted.add(peer)
                self._checking.pop(peer, None)
            check.done.set()

    def settle(self, key: ExpertKey, verdict: OriginVerdict) -> None:
        """Act on what fresh origin copies said of `key`'s peer-given record, and count it."""
        assert self.digests is not None
        self.stats.record_audit(verdict.outcome, verdict.fetched_bytes)
        if verdict.outcome == "confirmed":
            self.digests.mark_verified(key)
        elif verdict.outcome == "wrong" and verdict.blob is not None:
            self.correct(key, verdict.digest, verdict.blob)
        else:
            logger.warning("expert %s: a peer's copy and two fresh copies from the Hub all differ", key)

    def correct(self, key: ExpertKey, digest: str, blob: ExpertBytes) -> None:
        """Two fresh Hub copies agree on `digest` against `key`'s record: theirs is the reference
        now, and a peer that vouched for the old one lied (`peer_lied`)."""
        assert self.digests is not None
        peer = self.digests.replace(key, digest, fast_digest(blob))
        if peer is not None:
            self.peer_lied(peer, key)

    def peer_lied(self, peer: str, key: ExpertKey) -> None:
        """`peer` (a `book_peer_id`) vouched for a wrong copy of `key`: forget every record it
        vouched for, drop the copies made from them, and stop asking it."""
        assert self.digests is not None
        with self._senders_lock:  # its copies in flight are refused; when its distrust ends, checked again
            self._shown_wrong[peer] = time.monotonic()
            self._trusted = {p for p in self._trusted if book_peer_id(p) != peer}
        forgotten = self.digests.forget_vouched(peer)
        logger.warning(
            "peer %s sent a wrong copy of expert %s (two agreeing Hub copies differ from it): it is no longer "
            "asked for experts, and the %d other records it vouched for are forgotten; on that peer, "
            "`expertmesh verify` finds its damaged copies",
            peer,
            key,
            len(forgotten),
        )
        for k in (key, *forgotten):  # a copy of `key` on disk is the wrong one too
            self.disk.discard(self.index.expert(*k))
        if self.on_forgotten is not None:
            self.on_forgotten(peer, [key, *forgotten])
        for tier in self.remote:
            if tier.household:
                cast(HouseholdTier, tier).distrust(peer)

    def close(self) -> None:
        for tier in self.remote:
            tier.close()
