"""Admission for the calls peers make of a node: FetchExpert and ComputeExperts.

Every gRPC call runs on one of the server's `max_workers` threads, and these two can hold theirs
for long: an owner's fetch waits on the Hub, a stream waits on a slow reader, a computation waits
for the MLX thread. Unbounded, a few peers' cold prefills fill the pool, and health checks and
Info wait behind them until they time out, so peers mark the node down exactly when it is doing
its owner's work. `CallSlots` admits as many as the threads left after Generate's share and the
reserve (rpc/server.py sizes it) and refuses any more at once with RESOURCE_EXHAUSTED, which a
caller takes as "busy: ask another node or the Hub", never as a fault of the node.
"""

from __future__ import annotations

import threading

import grpc

BUSY = "this node is busy"  # how every "full, try elsewhere" refusal's details begin (Generate's too)
DEFAULT_PEER_CALLS = 8  # the default 18 workers, less the 4 reserved, Generate's 4 places and its 2 counts


class CallSlots:
    """At most `capacity` calls at once; `enter` refuses the next at once rather than queue it,
    since a queued call would hold a worker thread all the same."""

    def __init__(self, capacity: int = DEFAULT_PEER_CALLS):
        self.capacity = max(1, capacity)
        self._lock = threading.Lock()
        self._in_use = 0

    def fit(self, threads: int) -> None:
        """Admit as many calls as there are `threads` for them (one at least)."""
        with self._lock:
            self.capacity = max(1, threads)

    def enter(self) -> bool:
        """Take a slot; False when every one is taken. Pair with `leave`."""
        with self._lock:
            if self._in_use >= self.capacity:
                return False
            self._in_use += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self._in_use -= 1

    def in_use(self) -> int:
        with self._lock:
            return self._in_use


def is_busy(error: grpc.RpcError) -> bool:
    """Whether a call was refused because the node was full (try again later or elsewhere), as
    opposed to another RESOURCE_EXHAUSTED, such as warm's "the disk budget is full"."""
    return error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and (error.details() or "").startswith(BUSY)
