"""The peers tier: experts from other Macs of the household, between the disk and the Hub.

A miss goes to the expert's owner first (household/membership.py), who fetches it from the Hub
if it lacks it, keeps it and serves it, so each expert crosses the internet once per household;
if this node is the owner, the store goes to the Hub itself. After the owner, only peers whose
inventories list the expert are asked. Everything a peer sends is checked (size, its digest, and
then the store's recorded digest): a peer that errs, times out or lies is skipped for a while
and counted by reason, longer each time it does it again. A peer that answers "busy"
(RESOURCE_EXHAUSTED: its admission is full) is not skipped: it is asked again after a short,
growing pause for up to BUSY_WAIT_S, since an owner is busy while it fetches for the household and
going to the Hub instead would download the expert twice; only then is the next one asked.

A peer that hangs (SIGSTOP, a frozen Mac) keeps its connections open, so a fetch from it would wait
its whole deadline: a fetch that hears nothing for PEER_QUIET_S has the peer's health asked at once
(node/rpc/call_watch.py), and a peer that does not answer it is given up within seconds: its
fetches in flight are cancelled and it is skipped as a failed health check. So is a peer whose
fetch failed UNAVAILABLE and whose health check fails too (its process is gone): it is used again
as soon as it is restarted and answers SERVING.

Each peer's gRPC health is checked in the background: a peer skipped because its health check
failed is used again as soon as it answers SERVING. A skip for a failed call is not lifted by
health: a peer whose disk or Hub link hangs still answers its health check, and lifting its skip
would make every miss it owns wait the whole deadline again.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2

from expertmesh.node.fetching import DEMAND, FetchContext, hub_fetch_bound_s
from expertmesh.node.household.membership import SKIP_AFTER_ERROR_S, Peer, PeerTable, expert_key
from expertmesh.node.household.owner_wait import DEADLINE_EXCEEDED, OwnerWait
from expertmesh.node.model.expert_index import ExpertBytes, ExpertIndex, ExpertLocation
from expertmesh.node.rpc.admission import DEFAULT_PEER_CALLS
from expertmesh.node.rpc.call_watch import CallWatch
from expertmesh.node.rpc.client import INFO_DEADLINE_S, NodeClient, model_key
from expertmesh.node.rpc.inventory import layer_sizes
from expertmesh.node.store.buffers import shared_pool
from expertmesh.node.store.integrity import book_peer_id

logger = logging.getLogger(__name__)

FETCH_DEADLINE_S = 30.0  # for one expert from one peer; an owner has its own Hub fetch's bound more
# An owner fetching for us whose links receive nothing this long is given up (`OwnerWait`): many
# times its progress messages' period, and longer than a Hub response's first byte takes.
OWNER_STALL_S = 30.0
INVENTORY_TTL_S = 30.0  # how long a peer's inventory is trusted before it is asked again
HEALTH_EVERY_S = 10.0  # every peer's gRPC health is checked this often
HEALTH_DEADLINE_S = 2.0
PEER_QUIET_S = 2.0  # a fetch silent this long has its peer's health asked (an owner's Hub fetch may be)
HUNG = "health_hung"  # the skip reason of a peer that went quiet mid-fetch and failed its health check
MAX_SKIP_S = 300.0  # a peer that keeps failing calls is skipped 30, 60, 120, 240, then 300 s
STRIKES_KEPT_S = MAX_SKIP_S  # a peer's failed calls are forgotten this long after its last skip ends
BUSY_WAIT_S = 2.0  # how long a busy peer is asked again before the next one (or the Hub) is
BUSY_PAUSES_S = (0.02, 0.05, 0.1, 0.2, 0.4)  # between those asks (the last one repeats)
_BUSY = object()  # `_fetch_from`'s answer when the peer refused as busy
# An owner's fetches for peers that may run ahead of ours (its admission's default): what the
# call's deadline allows beyond our own wait, which progress ends sooner (`OwnerWait`).
OWNER_QUEUE = DEFAULT_PEER_CALLS


@dataclass(frozen=True)
class SkipPolicy:
    """How long a peer is skipped after a failed call: `first_s`, doubled for each failure that
    follows within `kept_s` of the previous skip's end, at most `max_s`."""

    first_s: float = SKIP_AFTER_ERROR_S
    max_s: float = MAX_SKIP_S
    kept_s: float = STRIKES_KEPT_S

    def skip_s(self, strikes: int) -> float:
        """The skip after the `strikes`-th failure in a row (1: the first)."""
        return min(self.max_s, self.first_s * 2 ** min(max(0, strikes - 1), 32))


def health_reason(reason: str) -> bool:
    """Whether a skip's reason is a failed health check (lifted when health is SERVING again)."""
    return reason.startswith("health_") or reason == "not_serving"


@dataclass
class _Skips:
    """One peer's skips as this tier set them: the reason of the last, when its last skip for a
    failed call ends, when its last skip for a failed health check ends, and how many call skips
    came one after another (each doubles the next, up to MAX_SKIP_S)."""

    reason: str = ""
    call_until: float = -math.inf
    health_until: float = -math.inf
    strikes: int = 0


class PeerSource:
    """A tier over the household: the owner first, then the other live peers that hold the expert."""

    source = "peer"
    local = False
    household = True

    def __init__(
        self,
        index: ExpertIndex,
        table: PeerTable,
        secret: str,
        deadline_s: float = FETCH_DEADLINE_S,
        tls_ca: bytes | None = None,
        skips: SkipPolicy = SkipPolicy(),
        quiet_s: float = PEER_QUIET_S,
        owner_hub_s: Callable[[int], float] = hub_fetch_bound_s,
        owner_stall_s: float = OWNER_STALL_S,
    ):
        """`deadline_s`: for one expert from one peer; from its owner, `owner_hub_s(nbytes)` more,
        the longest the owner's own Hub fetch of it may run (see `fetch`), unless the owner's
        progress shows its links received nothing for `owner_stall_s`."""
        self.index = index
        self.owner_hub_s = owner_hub_s
        self.owner_stall_s = owner_stall_s
        self.skip_policy = skips
        self.table = table
        self.secret = secret
        self.tls_ca = tls_ca
        self.deadline_s = deadline_s
        self._model = model_key(index.repo_id, index.commit)
        self._clients: dict[str, NodeClient] = {}
        self._last_server: dict[tuple[int, int], Peer] = {}
        self._inventories: dict[str, tuple[float, set[tuple[int, int]]]] = {}  # node id -> (when, held keys)
        self._sizes = layer_sizes(index)  # what a peer's inventory is read against
        self._skips: dict[str, _Skips] = {}  # node id -> why and until when it is skipped
        self._lock = threading.Lock()
        # called as transfer_observer(peer, nbytes, seconds) after each expert that came from a
        # peer: how remote execution measures each peer's bandwidth
        self.transfer_observer: Callable[[Peer, int, float], None] | None = None
        self._stop = threading.Event()
        self._prober: threading.Thread | None = None
        self._received_bytes = 0  # expert bytes peers sent this tier: part of this node's progress as an owner
        # one strike: a peer given up costs one expert from the next tier, and a token waits on it
        self.watch = CallWatch(
            lambda address, timeout_s: self.client(address).serving(timeout_s), quiet_s, HEALTH_DEADLINE_S, strikes=1
        )

    def client(self, address: str) -> NodeClient:
        """The kept-open client of the node at `address`."""
        with self._lock:
            client = self._clients.get(address)
            if client is None:
                client = self._clients[address] = NodeClient(address, self.secret, self.tls_ca)
            return client

    # -- inventories --------------------------------------------------------------------------

    def inventory(self, peer: Peer, timeout: float = INFO_DEADLINE_S) -> set[tuple[int, int]] | None:
        """The keys `peer` holds, as its inventory said at most INVENTORY_TTL_S ago (asked again
        when older); None when it cannot be had."""
        now = time.monotonic()
        with self._lock:
            known = self._inventories.get(peer.node_id)
        if known is None or now - known[0] > INVENTORY_TTL_S:
            try:
                held = self.client(peer.address).inventory(
                    self._model, self._sizes, timeout=min(timeout, INFO_DEADLINE_S)
                )
            except grpc.RpcError:
                return None
            known = (now, held)
            with self._lock:
                self._inventories[peer.node_id] = known
        return known[1]

    def held_keys(self) -> set[tuple[int, int]]:
        """Every key some live peer's inventory lists (each asked again when stale): what the
        household holds, which an approximate prompt uses instead of fetching from the Hub
        (engine/prompt_experts.py). A peer whose inventory cannot be had adds nothing."""
        keys: set[tuple[int, int]] = set()
        for peer in self.table.all():
            if peer.live:
                keys |= self.inventory(peer) or set()
        return keys

    def known_inventory(self, peer: Peer) -> set[tuple[int, int]]:
        """What `peer` was last known to hold, without asking (empty if never asked)."""
        with self._lock:
            known = self._inventories.get(peer.node_id)
        return known[1] if known is not None else set()

    def note_holding(self, peer: Peer, key: tuple[int, int], held: bool) -> None:
        """Correct the cached inventory from what a call showed (an expert computed or missing)."""
        with self._lock:
            known = self._inventories.get(peer.node_id)
            if known is not None:
                (known[1].add if held else known[1].discard)(key)

    def _holds(self, peer: Peer, key: tuple[int, int], timeout: float) -> bool:
        """Whether `peer`'s inventory lists `key`; a peer whose inventory cannot be had is assumed
        to hold it, so it is still asked."""
        held = self.inventory(peer, timeout)
        return held is None or key in held

    # -- the tier -----------------------------------------------------------------------------

    def fetch(self, loc: ExpertLocation, ctx: FetchContext = DEMAND) -> ExpertBytes | None:
        """The expert from the household, or None: the caller goes to the Hub (this node owns it, or
        no peer could serve it in time)."""
        ranked = self.table.ranked(expert_key(self.index, loc.layer, loc.expert))
        started = time.monotonic()
        for n, peer in enumerate(ranked):
            if peer is None:
                if n == 0:
                    return None  # we own it: we fetch it from the Hub ourselves
                continue
            deadline = started + self.deadline_s
            if n == 0:
                # The owner fetches it from the Hub on a miss and goes on when we give up: given up
                # before its own fetch would end, the expert crosses the household's one internet
                # link twice, on the slow links where that hurts most. A dead owner, or a hung one
                # that fails its health check, is noticed apart from it (`penalise_call`, `watch`).
                deadline += self.owner_hub_s(loc.nbytes)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if n > 0 and not self._holds(peer, (loc.layer, loc.expert), left):
                continue
            blob = self._fetch_patiently(peer, loc, n == 0, deadline, ctx)
            if blob is not None:
                self._last_server[(loc.layer, loc.expert)] = peer
                return blob
        return None

    def _fetch_patiently(
        self, peer: Peer, loc: ExpertLocation, owner: bool, deadline: float, ctx: FetchContext
    ) -> memoryview | None:
        """`_fetch_from`, asked again while the peer answers busy, for up to BUSY_WAIT_S (within
        `deadline`, and not once the caller abandons the fetch)."""
        give_up = min(deadline, time.monotonic() + BUSY_WAIT_S)
        for ask in range(1000):  # bounded by `give_up` long before
            blob = self._fetch_from(peer, loc, owner, timeout=deadline - time.monotonic())
            if blob is not _BUSY:
                return blob
            pause = BUSY_PAUSES_S[min(ask, len(BUSY_PAUSES_S) - 1)]
            if time.monotonic() + pause >= give_up or ctx.should_abandon():
                break
            time.sleep(pause)
        logger.debug("peer %s stayed busy for %s; asking the next", peer.node_id, loc)
        return None

    def _fetch_from(self, peer: Peer, loc: ExpertLocation, owner: bool, timeout: float):
        """The expert's checked bytes from `peer`, None when it failed (skipped) or missed, or
        `_BUSY` when it refused for now. The owner is asked for its progress and waited for while
        it moves (`OwnerWait`); the call's own deadline then only bounds a queue of its fetches."""
        t0 = time.perf_counter()
        blob = shared_pool().lend(loc.nbytes)  # the chunks land in place: no join, no fresh pages
        wait = OwnerWait(timeout, self.owner_stall_s) if owner else None
        call_timeout = timeout + OWNER_QUEUE * (self.deadline_s + self.owner_hub_s(loc.nbytes)) if owner else timeout
        call = self.client(peer.address).fetch_expert(
            self._model, loc.layer, loc.expert, call_timeout, fetch_on_miss=owner, progress=owner
        )
        try:
            size, digest, received = None, None, 0
            with self.watch.watching(peer.address, call) as watched:
                if wait is not None:
                    self.watch.give_up_at(watched, wait.give_up_at)
                for chunk in call:
                    watched.heard()
                    if chunk.HasField("progress"):
                        if wait is None or size is not None:  # not asked for, or after the data began
                            self.penalise(peer, "malformed")
                            return None
                        self.watch.give_up_at(watched, wait.heard(chunk.progress))
                        continue
                    if size is None:
                        size, digest = chunk.size, chunk.sha256
                        if wait is not None:  # the owner has it: what is left is a LAN transfer
                            self.watch.give_up_at(watched, time.monotonic() + self.deadline_s)
                    if received + len(chunk.data) > loc.nbytes:
                        self.penalise(peer, "oversized")
                        return None
                    blob[received : received + len(chunk.data)] = chunk.data
                    received += len(chunk.data)
                    with self._lock:
                        self._received_bytes += len(chunk.data)
        except grpc.RpcError as e:
            if watched.hung:  # it failed its health check: skipped until it answers SERVING again
                if peer.live:
                    self._penalise_health(peer, HUNG, counted_as="hung")
                return None
            if watched.gave_up and wait is not None:  # the owner's fetch stalled or ran past its bound
                why = wait.why() if size is None else DEADLINE_EXCEEDED  # or its data came too slowly
                logger.info(
                    "owner %s of %s: its fetch %s; asking the next tier", peer.node_id, loc, why.replace("_", " ")
                )
                self.penalise(peer, why)
                return None
            if e.code() == grpc.StatusCode.NOT_FOUND and not owner:
                # an honest miss (evicted since its inventory was read), or an inventory that lies:
                # either way it is not asked for this expert again until its inventory is read anew
                self.note_holding(peer, (loc.layer, loc.expert), False)
                return None
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                return _BUSY  # its admission is full: it works, so it is not skipped
            self.penalise_call(peer, e.code(), e.code().name.lower())
            return None
        finally:
            call.cancel()  # a no-op once the stream ended; frees the peer when this gave up early
        if size != loc.nbytes or received != loc.nbytes:
            self.penalise(peer, "wrong_size")
            return None
        if hashlib.sha256(blob).hexdigest() != digest:
            self.penalise(peer, "bad_digest")
            return None
        self._forgive(peer)
        if self.transfer_observer is not None:
            self.transfer_observer(peer, len(blob), time.perf_counter() - t0)
        return blob

    def received_bytes(self) -> int:
        """Expert bytes peers have sent this tier since it started."""
        with self._lock:
            return self._received_bytes

    def voucher(self, loc: ExpertLocation) -> str | None:
        """The node id of the peer that sent the copy of `loc` fetched last."""
        peer = self._last_server.get((loc.layer, loc.expert))
        return peer.node_id if peer is not None else None

    def distrust(self, peer: str) -> None:
        """Skip the member whose `book_peer_id` is `peer` for DISTRUST_S: two agreeing Hub copies
        contradicted a copy it sent (store/tier_chain.py)."""
        for member in self.table.all():
            if book_peer_id(member.node_id) == peer:
                self.table.distrust(member)
                with self._lock:
                    skips = self._skips.setdefault(member.node_id, _Skips())
                    skips.reason, skips.call_until = "lied", max(skips.call_until, member.skip_until)

    def distrust_peer(self, peer: Peer) -> None:
        """`distrust` `peer`: an answer it computed was shown wrong (household/compute_audit.py)."""
        self.distrust(book_peer_id(peer.node_id))

    def discard(self, loc: ExpertLocation) -> None:
        """The store found these bytes disagree with the digest it recorded: the peer lied."""
        peer = self._last_server.pop((loc.layer, loc.expert), None)
        if peer is not None:
            self.penalise(peer, "bad_bytes")

    # -- skips --------------------------------------------------------------------------------

    def penalise(self, peer: Peer, reason: str) -> None:
        """Skip `peer` after a call to it failed (`reason`: a gRPC status name, or what was wrong
        with its answer), counted by reason in the table.

        The skip follows `skip_policy`: 30 s at first, doubled for each failure that follows
        soon after the last skip, up to 300 s, so a peer that hangs costs a miss the whole
        deadline every few minutes at most, not every half minute. Failures while it is already
        skipped (calls that were in flight) count as one. Health checks do not lift these skips.
        """
        policy, now = self.skip_policy, time.monotonic()
        with self._lock:
            skips = self._skips.setdefault(peer.node_id, _Skips())
            if now >= skips.call_until:  # a new failure, not another call of the one skipped
                recent = skips.strikes > 0 and now - skips.call_until < policy.kept_s
                skips.strikes = skips.strikes + 1 if recent else 1
            skip_s = policy.skip_s(skips.strikes)
            skips.reason, skips.call_until = reason, max(skips.call_until, now + skip_s)
            until, strikes = skips.call_until, skips.strikes
        self.table.penalise(peer, reason)  # counts it (and skips it for the table's first 30 s)
        peer.skip_until = until
        if strikes > 1:
            logger.warning("peer %s failed %d times in a row: skipping it for %.0f s", peer.node_id, strikes, skip_s)

    def penalise_call(self, peer: Peer, code: grpc.StatusCode, reason: str) -> None:
        """Skip `peer` after a call to it failed with `code`, counted as `reason`.

        A call that found the peer UNAVAILABLE while its health check fails too means its process
        is gone (killed, crashed, its Mac asleep), not a call that failed on a live peer: it is
        skipped like a failed health check, so it is back as soon as it is restarted and answers
        SERVING, instead of after a skip that doubled with every miss while it was down. Any
        other failure is `penalise`d."""
        if code == grpc.StatusCode.UNAVAILABLE and not self.client(peer.address).serving(HEALTH_DEADLINE_S):
            if peer.live:
                self._penalise_health(peer, f"health_{reason}", counted_as=reason)
            return
        self.penalise(peer, reason)

    def _penalise_health(self, peer: Peer, reason: str, counted_as: str | None = None) -> None:
        """Skip `peer` because its health check failed: lifted as soon as it is SERVING again.
        `counted_as`: the reason the table counts, when a failed call is what found it."""
        self.table.penalise(peer, counted_as or reason)
        with self._lock:
            skips = self._skips.setdefault(peer.node_id, _Skips())
            skips.reason, skips.health_until = reason, peer.skip_until

    def _lifted_by_health(self, peer: Peer) -> bool:
        """Whether `peer`'s skip may end now that its health is SERVING: only when a failed health
        check set it and no failed call has skipped it since (a skip this tier did not set, as by
        a direct PeerTable.penalise, lasts its own time too)."""
        with self._lock:
            skips = self._skips.get(peer.node_id)
            return (
                skips is not None
                and health_reason(skips.reason)
                and time.monotonic() >= skips.call_until
                and peer.skip_until <= skips.health_until
            )

    def _forgive(self, peer: Peer) -> None:
        """A call to `peer` went well: its next failure is a first one again."""
        with self._lock:
            skips = self._skips.get(peer.node_id)
            if skips is not None:
                skips.strikes = 0

    def skip_reason(self, peer: Peer) -> str:
        """Why `peer` is skipped now ('' when it is live, or this tier did not skip it)."""
        with self._lock:
            skips = self._skips.get(peer.node_id)
        return skips.reason if skips is not None and not peer.live else ""

    # -- health -------------------------------------------------------------------------------

    def check_health(self) -> None:
        """Ask every known peer's standard health service once: one that is not SERVING (or does
        not answer in HEALTH_DEADLINE_S) is skipped, and one skipped for that which is SERVING
        again is used again at once (a skip for a failed call lasts its own time, see
        `penalise`); a compute peer's inventory is refreshed here when stale, so remote
        execution's placement reads it without a call. Generation never waits for this."""
        for peer in self.table.all():
            try:  # a skipped peer may just have been restarted: wait out the channel's reconnect backoff
                status = self.client(peer.address).health(HEALTH_DEADLINE_S, wait_for_ready=not peer.live)
            except grpc.RpcError as e:
                if peer.live:
                    self._penalise_health(peer, f"health_{e.code().name.lower()}")
                continue
            if status != health_pb2.HealthCheckResponse.SERVING:
                if peer.live:
                    self._penalise_health(peer, "not_serving")
                continue
            if not peer.live:
                if not self._lifted_by_health(peer):
                    continue  # skipped for a failed call: that skip runs its course
                self.table.restore(peer)
            if peer.compute:
                self.inventory(peer)  # asked again when stale, here rather than in a generation's layer
        self.forget_departed()

    def forget_departed(self) -> None:
        """Drop what is kept for peers that left the table: their channels (closed), inventories,
        and skips once their strikes are forgotten (a peer back before keeps its backoff; a
        health skip means nothing once it is gone: a returning peer is checked afresh).
        A long-lived node sees peers come and go on new addresses (DHCP, restarts); without this
        each left a channel and its entries behind for good."""
        peers = self.table.all()
        ids, addresses = {p.node_id for p in peers}, {p.address for p in peers}
        now = time.monotonic()
        with self._lock:
            gone = [a for a in self._clients if a not in addresses]
            clients = [self._clients.pop(a) for a in gone]
            for node_id in [i for i in self._inventories if i not in ids]:
                del self._inventories[node_id]
            for node_id, skips in list(self._skips.items()):
                if node_id not in ids and now >= skips.call_until + self.skip_policy.kept_s:
                    del self._skips[node_id]
        for client in clients:
            client.close()

    def start_health_checks(self, every_s: float = HEALTH_EVERY_S) -> None:
        """Check every peer's health every `every_s` seconds until `close`."""

        def loop() -> None:
            while not self._stop.wait(every_s):
                try:
                    self.check_health()
                except Exception:  # a prober must never die of one bad round
                    logger.exception("peer health check failed")

        self._prober = threading.Thread(target=loop, name="peer-health", daemon=True)
        self._prober.start()

    def close(self) -> None:
        self.watch.close()
        self._stop.set()
        if self._prober is not None:
            self._prober.join(HEALTH_DEADLINE_S + 1)
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()
