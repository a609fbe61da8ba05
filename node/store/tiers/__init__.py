"""The tiers an expert's bytes come from after RAM, nearest first: disk, peers, the Hub.

A tier declares what it can do, so the store never singles one out by name:

    source        the `source` its uses are counted under (disk | peer | hub)
    local         its copies live on this machine: they are not written back to the disk, and a bad
                  one is not asked for again (a remote tier may send good bytes on a second try)
    household     its copies come from the household, whose owners keep them: a node writes one to
                  its disk only if it owns that expert (the household keeps one copy of each, and a
                  copy of another's expert never takes the room of one's own)
    fetch(loc, ctx)
                  the expert's upstream bytes (its ranges concatenated), or None if it lacks them;
                  `ctx` (node/fetching.py) says whom the fetch serves: a tier that moves bytes over
                  a link stops when `ctx.abandon()` says so (Abandoned)
    discard(loc)  a copy it gave failed its digest: delete it (disk), blame its sender (peers)
    close()       stop its threads and connections

A household tier (`household` true) is a `HouseholdTier`: it says which peer sent the copy it just
gave (`voucher`), and stops asking a peer whose copies two agreeing Hub copies contradicted
(`distrust`, store/integrity.py).

A tier that can also fetch experts lying back to back in a shard as one request (the Hub) is a
`RunFetcher`; the node hands it to the store explicitly.
"""

from __future__ import annotations

from typing import Protocol

from expertmesh.node.fetching import DEMAND, FetchContext
from expertmesh.node.model.expert_index import ExpertBytes, ExpertLocation


class Tier(Protocol):
    source: str
    local: bool
    household: bool

    def fetch(self, loc: ExpertLocation, ctx: FetchContext = DEMAND) -> ExpertBytes | None: ...

    def discard(self, loc: ExpertLocation) -> None: ...

    def close(self) -> None: ...


class RunFetcher(Tier, Protocol):
    """A tier that also fetches adjacent experts as one set of range requests (see store/runs.py)."""

    min_piece_bytes: int  # an expert at least this large is already split across connections

    @property
    def connections(self) -> int:
        """Requests in flight at once (the Hub's count adapts to what the link carries)."""
        ...

    @property
    def run_bytes(self) -> int: ...

    def fetch_run(self, locs: list[ExpertLocation], ctx: FetchContext = DEMAND) -> list[ExpertBytes]: ...


class HouseholdTier(Tier, Protocol):
    """A tier whose copies come from peers, each of which vouches for what it sent."""

    def voucher(self, loc: ExpertLocation) -> str | None:
        """The node id of the peer whose copy of `loc` this tier gave last (None: unknown)."""
        ...

    def distrust(self, peer: str) -> None:
        """Stop taking content from the peer whose `book_peer_id` is `peer` (a proven wrong copy)."""
        ...
