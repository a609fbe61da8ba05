"""Auditing what peers computed: a sample of ComputeExperts answers computed again here.

Why: remote execution sends a peer an expert's input rows and uses the rows it answers as the
expert's output. The answer's shape, dtype and finiteness are checked (remote_experts.py), but
nothing in it tells right values from wrong ones: a member whose copy of an expert was damaged
after its checks, whose build computes wrongly, or that lies, changes every token its answers
touch, and the household goes on asking it.

What: each peer's first answer in a run, then one in AUDIT_EVERY of its calls at random (it
cannot tell which), one expert of the call each. The sampled expert's rows are computed again
here, the way this node serves a peer's call (`ExpertComputer.recompute`: the expert got through
the store, so its bytes are checked as any fetch's, and the same kernels), and compared with what
the peer answered. An answer further than TOLERANCE from it (relative L2 distance; the same
kernels on another machine or batch differ in a few low bits, a wrong answer in all of them)
gets the peer distrusted as a liar of copies is (household/membership.py: asked for nothing for
an hour). Each audit waits for an idle link, as the copies' audit does (store/peer_audit.py), or
for AUDIT_BUSY_BOUND_S of busy generations, so a cold prompt's first token never waits behind
one; a first answer's audit goes ahead of the sample's.

What it costs: one expert's bytes (from the household or the Hub, kept as any use) and its compute
for each peer per run, and as much again for one call in AUDIT_EVERY. What it catches: a peer
wrong in every answer at its first; one wrong in a fraction f of its calls after about
AUDIT_EVERY / f of them. The tokens computed with a wrong answer before its audit stay as they
were: the audit stops the harm, it does not undo it.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from expertmesh.node.errors import ExpertmeshError
from expertmesh.node.household.expert_compute import ExpertComputer
from expertmesh.node.household.membership import Peer
from expertmesh.node.rpc import activations
from expertmesh.node.store.flights import Flights
from expertmesh.node.store.peer_audit import AUDIT_BUSY_BOUND_S
from expertmesh.node.store.stats import StoreStats
from expertmesh.v1 import node_pb2

logger = logging.getLogger(__name__)

AUDIT_EVERY = 4096  # one call in this many: an audit costs a whole expert, an answer a few rows
TOLERANCE = 0.02  # relative L2 distance: bf16 keeps 8 bits, so a few differing low bits stay far below
MAX_PENDING = 4  # sampled answers waiting for their audit (each holds its call's rows, MBs at most)
_ACTIVE_S = 3600.0  # the idle-link rule applies whether or not a generation is going on


@dataclass
class _Sample:
    peer: Peer
    layer: int
    expert: int
    asked: node_pb2.Tensor
    answered: node_pb2.Tensor
    first: bool


def relative_distance(got: np.ndarray, want: np.ndarray) -> float:
    """||got - want|| / ||want|| (0 when both are zero)."""
    scale = float(np.linalg.norm(want))
    diff = float(np.linalg.norm(got - want))
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


class ComputeAudit:
    """Samples ComputeExperts answers (`sample`, `offer`) and checks them on a thread of its own."""

    def __init__(
        self,
        computer: ExpertComputer,
        flights: Flights,
        distrust: Callable[[Peer], None],
        stats: StoreStats,
        every: int = AUDIT_EVERY,
        rng: random.Random | None = None,
        background: bool = True,
    ):
        """`distrust(peer)`: what a wrong answer does to its peer (PeerSource.distrust_peer);
        `background` False: no thread of its own, `run_pending` audits what waits."""
        self.computer, self.flights, self.distrust, self.stats = computer, flights, distrust, stats
        self.every = max(1, every)
        self._rng = rng or random.Random()
        self._seen: set[str] = set()  # peers whose first answer was taken
        self._pending: deque[_Sample] = deque()
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._background = background

    def sample(self, peer: Peer) -> str | None:
        """Whether the call about to be sent to `peer` is audited: "first" (its first this run),
        "sampled" (one in `every` of the rest, while few wait) or None."""
        with self._lock:
            if peer.node_id not in self._seen:  # until an answer of it is offered
                return "first"
            if len(self._pending) < MAX_PENDING and self._rng.randrange(self.every) == 0:
                return "sampled"
            return None

    def pick(self, n: int) -> int:
        """Which of a sampled call's `n` experts is audited: any, at random."""
        with self._lock:
            return self._rng.randrange(n)

    def offer(
        self, peer: Peer, layer: int, expert: int, asked: node_pb2.Tensor, answered: node_pb2.Tensor, first: bool
    ) -> None:
        """A sampled call's answer for `expert`, checked already as well formed: queued for its
        audit (a first answer's ahead of the sample's)."""
        with self._lock:
            first = first and peer.node_id not in self._seen  # another call's answer came first
            self._seen.add(peer.node_id)
            sample = _Sample(peer, layer, expert, asked, answered, first)
            if first:
                self._pending.appendleft(sample)
            elif len(self._pending) < MAX_PENDING:
                self._pending.append(sample)
            else:
                return
            self._lock.notify_all()
        self._start()

    def _start(self) -> None:
        with self._lock:
            if self._background and self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._loop, name="compute-audit", daemon=True)
                self._thread.start()

    def check(self, s: _Sample) -> str:
        """Audit one answer now: "confirmed", "wrong" (its peer distrusted) or "failed" (the
        expert could not be had or computed here: nothing is decided)."""
        try:
            want = self.computer.recompute(s.layer, s.expert, s.asked)
        except ExpertmeshError as e:
            logger.info(
                "could not audit peer %s's answer for expert %d of layer %d: %s", s.peer.node_id, s.expert, s.layer, e
            )
            return "failed"
        distance = relative_distance(activations.as_float32(s.answered), activations.as_float32(want))
        if distance <= TOLERANCE:
            return "confirmed"
        logger.warning(
            "peer %s computed expert %d of layer %d wrongly (%.3g from this node's result): not asking it for an hour",
            s.peer.node_id,
            s.expert,
            s.layer,
            distance,
        )
        self.distrust(s.peer)
        self.forget(s.peer.node_id)  # trusted again in an hour: its first answer then is audited again
        return "wrong"

    def forget(self, node_id: str) -> None:
        """The next answer of the peer `node_id` is audited as its first."""
        with self._lock:
            self._seen.discard(node_id)

    def run_pending(self) -> list[str]:
        """Audit every answer that waits, now, in order (first answers first); their outcomes."""
        with self._lock:
            samples, self._pending = list(self._pending), deque()
        return [self.check(s) for s in samples]

    def _next(self) -> _Sample | None:
        with self._lock:
            while not self._pending and not self._stop.is_set():
                self._lock.wait(1.0)
            return self._pending.popleft() if self._pending else None

    def _loop(self) -> None:
        while not self._stop.is_set():
            s = self._next()
            if s is None:
                continue
            self.flights.wait_for_idle_link(
                len(s.asked.data),
                lambda: time.monotonic() + _ACTIVE_S,
                self._stop.is_set,
                busy_bound_s=AUDIT_BUSY_BOUND_S,
            )
            if self._stop.is_set():
                return
            try:
                self.stats.record_compute_audit(self.check(s))
            except Exception:  # the audit must outlive one bad round
                logger.exception("auditing peer %s's answer failed", s.peer.node_id)

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(5.0)
