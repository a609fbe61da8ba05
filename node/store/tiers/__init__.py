"""The tiers an expert's bytes come from after RAM, nearest first: disk, peers, the Hub.

A tier declares what it can do, so the store never singles one out by name:

    source        the `source` its uses are counted under (disk | peer | hub)
    local         its copies live on this machine: they are not written back to the disk, and a bad
                  one is not asked for again (a remote tier may send good bytes on a second try)
    household     its copies come from the household, whose owners keep them: a node writes one to
                  its disk only if it owns that expert (the household keeps one copy of each, and a
                  copy of another's expert never takes the room of one's own)
    fetch(loc, abandon)
                  the expert's upstream bytes (its ranges concatenated), or None if it lacks them;
                  a tier that moves bytes over a link stops when `abandon()` says so (Abandoned)
    discard(loc)  a copy it gave failed its digest: delete it (disk), blame its sender (peers)
    close()       stop its threads and connections

A tier that can also fetch experts lying back to back in a shard as one request (the Hub) is a
`RunFetcher`; the node hands it to the store explicitly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from expertmesh.node.hub.expert_index import ExpertLocation


class Tier(Protocol):
    source: str
    local: bool
    household: bool

    def fetch(self, loc: ExpertLocation, abandon: Callable[[], bool] | None = None) -> bytes | bytearray | None: ...

    def discard(self, loc: ExpertLocation) -> None: ...

    def close(self) -> None: ...


class RunFetcher(Tier, Protocol):
    """A tier that also fetches adjacent experts as one set of range requests (see store/runs.py)."""

    connections: int  # requests in flight at once
    min_piece_bytes: int  # an expert at least this large is already split across connections

    @property
    def run_bytes(self) -> int: ...

    def fetch_run(self, locs: list[ExpertLocation], abandon: Callable[[], bool] | None = None) -> list[bytes]: ...
