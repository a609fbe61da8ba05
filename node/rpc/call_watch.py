"""Noticing a node that stopped answering while a call waits on it.

A node that is killed closes its connections and a gRPC call to it fails at once; a node that
hangs (SIGSTOP, a frozen Mac, a machine that dropped off the network without a reset) keeps them
open, and the call just goes quiet until its deadline: up to an hour for the coordinator's
Generate, half a minute for a peer's FetchExpert. Quiet alone proves nothing: a cold Kimi K3 token
takes minutes, and an owner fetching an expert from the Hub sends nothing until it has it. So when
a watched call has heard nothing for `quiet_s`, its node's standard health service is asked (a
separate, tiny call the node answers from its gRPC threads whatever its model or its Hub link is
doing); a node that does not answer SERVING within `health_deadline_s` is taken as hung, and its
quiet calls are marked so and cancelled. The caller turns that into its fallback: the coordinator
tries another node or ends the answer with a clear error, the peers tier skips the peer and asks
the next tier.

One daemon thread watches every call of its owner; it starts with the first call and asks each
quiet node at most once per `quiet_s`.
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


@dataclass(eq=False)  # hashed by identity: kept in a set while watched
class Watched:
    """One call being watched: when it last heard from its node, and whether the node was found hung."""

    address: str
    call: grpc.Future
    heard_at: float = field(default_factory=time.monotonic)
    hung: bool = False

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
    ):
        """`serving(address, timeout_s)`: whether the node answers its health check SERVING."""
        self._serving = serving
        self.quiet_s = quiet_s
        self.health_deadline_s = health_deadline_s
        self._calls: set[Watched] = set()
        self._asked: dict[str, float] = {}  # address -> when its health was last asked
        self._lock = threading.Lock()
        self._stop = threading.Event()
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
        """One round: ask the health of every node with a quiet call (not asked within `quiet_s`)."""
        now = time.monotonic()
        with self._lock:
            quiet = {w.address for w in self._calls if now - w.heard_at >= self.quiet_s and not w.hung}
            due = [a for a in quiet if now - self._asked.get(a, -self.quiet_s) >= self.quiet_s]
            for address in due:
                self._asked[address] = now
        for address in due:
            if self._serving(address, self.health_deadline_s):
                continue
            with self._lock:
                hung = [w for w in self._calls if w.address == address and now - w.heard_at >= self.quiet_s]
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

    def _loop(self) -> None:
        every_s = max(0.05, min(1.0, self.quiet_s / 4))
        while not self._stop.wait(every_s):
            try:
                self.check()
            except Exception:  # the watch must outlive one bad round
                logger.exception("watching calls to other nodes failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.health_deadline_s + 2)
