"""What the store asks of a routing trace: every layer call's experts, recorded as the store is asked.

The trace itself (observability/routing_trace.py's `TraceWriter`, which `expertmesh replay` reads)
sits a layer above the store, which may not import it; it satisfies this protocol as it is, and
the composition root hands it to the store (`ExpertStore(trace=...)`).
"""

from __future__ import annotations

from typing import Protocol


class RoutingRecorder(Protocol):
    def record(self, layer: int, experts: list[int]) -> None:
        """The experts one pass of `layer` routed to."""
        ...

    def close(self) -> None:
        """No more records: the store is closing."""
        ...
