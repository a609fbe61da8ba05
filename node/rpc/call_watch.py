"""Noticing a node that stopped answering while a call waits on it.

A node that is killed closes its connections and a gRPC call to it fails at once; a node that
hangs (SIGSTOP, a frozen Mac, a machine that dropped off the network without a reset) keeps them
open, and the call just goes quiet until its deadline: up to an hour for the coordinator's
Generate, half a minute for a peer's FetchExpert. Quiet alone proves nothing: a cold Kimi K3 token
takes minutes, and an owner fetching an expert from the Hub sends nothing until it has it. So when
a watched call has heard nothing for `quiet_s`, its node's standard health service is asked (a
separate, tiny call the node answers from its gRPC threads whatever its model or its Hub link is
doing); a node that fails `strikes` such checks in a row (none answered SERVING within
`health_deadline_s`) is taken as hung, and its calls that heard nothing all that while are marked
so and cancelled. The caller turns that into its fallback: the coordinator tries another node or
ends the answer with a clear error, the peers tier skips the peer and asks the next tier.

Why more than one strike for the coordinator: a live node can miss one check, since a Mac that
swaps under a model larger than its RAM, or a loaded machine, stalls for seconds; giving up its
call after one missed check cut a user's answer short with a 502 although the node went on a
moment later. Two checks `quiet_s` apart tell a stall from a hang; a hang costs `quiet_s` and a
check more. The peers tier keeps one strike: giving up a peer costs one expert from the next tier,
never an answer, and a token waits on it.

One daemon thread watches every call of its owner; it starts with the first call and asks each
quiet node at most once per `quiet_s`. Nothing is kept of a node no watched call waits on.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc

logger = logging.getLogger(__name__)

QUIET_S = 5.0  # a call silent this long has its node's health asked
HEALTH_DEADLINE_S = 3.0
STRIKES = 2  # failed health checks in a row that give a node up (see the module docstring)


@dataclass(eq=False)  # hashed by identity: kept in a set while watched
class Watched:
    """One call being watched: when it last heard from its node, and whether the node was found hung."""

    address: str
    call: grpc.Future
    heard_at: float = field(default_factory=time.monotonic)
    hung: bool = False
    # The caller's own end of its wait, which it may move as it hears from the node (monotonic
    # seconds; None: the call's deadline only): the watch cancels the call once it passes.
    give_up_at: float | None = None
    gave_up: bool = False

    def heard(self) -> None:
        """An event arrived: the node is alive."""
        self.heard_at = time.monotonic()


class CallWatch:
    """Cancels the calls to nodes that went quiet and do not answer their health check."""

    def __init__(
        self,
        serving: Callable[[str, float], bool],
        quiet_s: float = QUIET_S,
        health_deadline_s: float = HEALTH_DEADLINE_S,
        strikes: int = STRIKES,
    ):
        """`serving(address, timeout_s)`: whether the node answers its health check SERVING."""
        self._serving = serving
        self.quiet_s = quiet_s
        self.health_deadline_s = health_deadline_s
        self.strikes = max(1, strikes)
        self._calls: set[Watched] = set()
        self._asked: dict[str, float] = {}  # address -> when its health was last asked
        # address -> when each of its last failed checks in a row was asked (at most `strikes`)
        self._failed: dict[str, list[float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()  # a call's `give_up_at` was set: the next round may be sooner
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watching(self, address: str, call: grpc.Future) -> Iterator[Watched]:
        """Watch `call` to the node at `address` while the block runs."""
        watched = Watched(address, call)
        with self._lock:
            self._calls.add(watched)
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._loop, name="call-watch", daemon=True)
                self._thread.start()
        try:
            yield watched
        finally:
            with self._lock:
                self._calls.discard(watched)

    def check(self) -> None:
        """One round: cancel the calls whose `give_up_at` passed; ask the health of every node with
        a quiet call (not asked within `quiet_s`); give up the calls to a node that failed
        `strikes` checks in a row and that heard nothing since before the first of them."""
        now = time.monotonic()
        with self._lock:
            ended = [w for w in self._calls if w.give_up_at is not None and now >= w.give_up_at and not w.gave_up]
            for w in ended:
                w.gave_up = True
            watched = {w.address for w in self._calls}
            for address in [a for a in self._asked if a not in watched]:  # no call waits on it any more
                del self._asked[address]
                self._failed.pop(address, None)
            quiet = {w.address for w in self._calls if now - w.heard_at >= self.quiet_s and not w.hung}
            due = [a for a in quiet if now - self._asked.get(a, -self.quiet_s) >= self.quiet_s]
            for address in due:
                self._asked[address] = now
        for w in ended:
            w.call.cancel()
        for address in due:
            serving = self._serving(address, self.health_deadline_s)
            with self._lock:
                if serving:
                    self._failed.pop(address, None)
                    continue
                failed = self._failed.setdefault(address, [])
                failed.append(now)
                del failed[: -self.strikes]
                if len(failed) < self.strikes:
                    logger.info("node %s went quiet and missed a health check: asking again", address)
                    continue
                since = failed[0]  # when the first of the failed checks in a row was asked
                hung = [
                    w
                    for w in self._calls
                    if w.address == address and not w.hung and w.heard_at <= since and now - w.heard_at >= self.quiet_s
                ]
                for w in hung:
                    w.hung = True
            if hung:
                logger.warning(
                    "node %s went quiet and does not answer its health check: giving up %d call(s) to it",
                    address,
                    len(hung),
                )
            for w in hung:
                w.call.cancel()

    def _next_round_s(self) -> float:
        """Until the next round: a fraction of `quiet_s`, or sooner when a call's `give_up_at` comes."""
        every_s = max(0.05, min(1.0, self.quiet_s / 4))
        with self._lock:
            ends = [w.give_up_at for w in self._calls if w.give_up_at is not None and not w.gave_up]
        if ends:
            every_s = min(every_s, max(0.01, min(ends) - time.monotonic()))
        return every_s

    def give_up_at(self, watched: Watched, at: float) -> None:
        """Set when the caller stops waiting on `watched` (monotonic seconds): the watch cancels
        the call then, to within a few milliseconds."""
        with self._lock:
            watched.give_up_at = at
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # before the next end is read: a `give_up_at` set after it wakes the wait
            self._wake.wait(self._next_round_s())
            if self._stop.is_set():
                break
            try:
                self.check()
            except Exception:  # the watch must outlive one bad round
                logger.exception("watching calls to other nodes failed")

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(self.health_deadline_s + 2)
