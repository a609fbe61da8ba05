"""The Hub tier: an expert's bytes by range requests to the upstream shards, strict 206 or an error.

An expert is split into a few pieces fetched on separate connections of one shared pool. A home
link gives each connection a fraction of its bandwidth (12.5 of 100 MB/s is typical), so a
layer needing fewer experts than there are connections would otherwise leave most of the link
idle; pieces keep every connection busy. Pieces are not made smaller than `min_piece_bytes`,
since each request pays the time to first byte. How many connections the pool runs is measured:
it grows while more connections carry more, as where a CDN edge caps every connection well
below the link's share (hub_connections.py). Queued pieces are taken demands first, then
guesses, then idle-link fills (the fetch's `FetchContext`, node/fetching.py).

Idle-link fill asks for runs of experts that lie back to back in a shard as one request
(`fetch_run`): each request pays its time to first byte once, which is what a small expert's
transfer is mostly made of. A run stops growing at `run_bytes`, the size of a request that
already fills every piece, so K3's 17.5 MB experts are never run together.

A Hub that only drips or stalls ends each fetch in one error within a bound: the pieces of an
expert or of a run share one `Deadline` (node/fetching.py, `HUB_FETCH_DEADLINE_S` from the
first request, plus what their bytes earn at the speed floor as they arrive, so a slow, full link
never ends a fetch that keeps receiving), and pieces still queued when it passes are cancelled. The experts of a run whose
request failed are not asked for again one by one (store/tier_chain.py): the run had the budget
of one fetch, and asking again per expert would multiply it by the run's length.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, wait

from expertmesh.node import constants
from expertmesh.node.errors import Abandoned, DownloadError
from expertmesh.node.fetching import DEMAND, Deadline, FetchContext
from expertmesh.node.model.expert_index import ByteRange, ExpertBytes, ExpertIndex, ExpertLocation, run_ranges
from expertmesh.node.store.buffers import expert_buffer, shared_pool
from expertmesh.node.store.priority import PriorityPool
from expertmesh.node.store.tiers.hub_connections import AdaptiveConnections

DEFAULT_CONNECTIONS = constants.HUB_CONNECTIONS
DEFAULT_MAX_CONNECTIONS = constants.HUB_MAX_CONNECTIONS
DEFAULT_PIECES_PER_EXPERT = constants.HUB_PIECES_PER_EXPERT
DEFAULT_MIN_PIECE_BYTES = constants.HUB_MIN_PIECE_BYTES


def split_ranges(ranges: list[ByteRange], pieces: int, min_piece_bytes: int) -> list[ByteRange]:
    """`ranges` cut into about `pieces` parts of at least `min_piece_bytes` (a range is never merged)."""
    total = sum(r.nbytes for r in ranges)
    size = max(min_piece_bytes, -(-total // max(1, pieces)))
    out = []
    for r in ranges:
        start = r.start
        while start < r.end:
            end = min(r.end, start + size)
            if r.end - end < size // 4:  # no sliver at the end
                end = r.end
            out.append(ByteRange(r.file, start, end))
            start = end
    return out


class HubSource:
    """The Hub tier (a `RunFetcher`, store/tiers): the last tier, it answers or raises."""

    source = "hub"
    local = False
    household = False

    def __init__(
        self,
        index: ExpertIndex,
        reader=None,
        connections: int = DEFAULT_CONNECTIONS,
        pieces_per_expert: int = DEFAULT_PIECES_PER_EXPERT,
        min_piece_bytes: int = DEFAULT_MIN_PIECE_BYTES,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ):
        """`connections`: the count of range requests in flight at first; it grows up to
        `max_connections` while more connections carry more (hub_connections.py; equal counts:
        fixed)."""
        from expertmesh.node.hub.client import RangeReader

        self.index = index
        self.reader = reader or RangeReader()
        self.adaptive = AdaptiveConnections(connections, max_connections)
        self.pieces_per_expert = pieces_per_expert
        self.min_piece_bytes = min_piece_bytes
        self._pool = PriorityPool(connections, "hub-range")  # demands' pieces before guesses' and fills'
        self._busy = 0  # pieces being read now
        self._busy_lock = threading.Lock()

    @property
    def connections(self) -> int:
        """Range requests in flight at once now (the store groups a layer's experts into runs
        where it wants more than these)."""
        return self.adaptive.allowed

    def start(self) -> None:
        self._pool.start()

    def _read_into(self, r: ByteRange, out: memoryview, ctx: FetchContext) -> None:
        from expertmesh.node.hub.client import RemoteFile

        remote = RemoteFile(self.index.repo_id, self.index.commit, r.file)
        with self._busy_lock:
            self._busy += 1
            busy = self._busy
        started = time.monotonic()
        try:
            got = self.reader.read_into(remote, r.start, r.end, out, ctx)
        finally:
            with self._busy_lock:
                self._busy -= 1
        if got != r.nbytes:
            raise DownloadError(f"{self.index.repo_id} {r.file}: asked for {r.nbytes} bytes, got {got}")
        changed = self.adaptive.record(got, time.monotonic() - started, busy)
        if changed is not None:
            self._pool.resize(changed)

    def _read_pieces(self, pieces: list[ByteRange], into: memoryview, ctx: FetchContext) -> None:
        """Each piece into its place in `into`, on the pool's connections (one piece: here), all
        within one `Deadline`, queued at the fetch's priority."""
        deadline = self.reader.deadline()
        ctx = ctx.with_deadline(deadline)
        offsets, off = [], 0
        for p in pieces:
            offsets.append(off)
            off += p.nbytes
        if len(pieces) == 1:
            self._read_into(pieces[0], into[: pieces[0].nbytes], ctx)
            return
        futures = [
            self._pool.submit(self._read_into, p, into[o : o + p.nbytes], ctx, priority=ctx.priority)
            for p, o in zip(pieces, offsets)
        ]
        _await_pieces(futures, deadline)  # every piece ends (an abandoned one at once) before the buffer goes
        ran = [f.exception() for f in futures if not f.cancelled()]
        for e in ran:
            if e is not None:
                raise e
        if len(ran) < len(futures):
            raise DownloadError(f"pieces not asked for: the {deadline.seconds:g} s to fetch them had passed")

    def fetch(self, loc: ExpertLocation, ctx: FetchContext = DEMAND) -> memoryview:
        """The expert's bytes, its pieces read on separate connections straight into one buffer
        lent by the process's pool (a fresh mapping's page faults cost 20 ms per K3 expert)."""
        blob = shared_pool().lend(loc.nbytes)
        try:
            pieces = split_ranges(loc.ranges, self.pieces_per_expert, self.min_piece_bytes)
            self._read_pieces(pieces, blob, ctx)
        except Abandoned:
            raise
        except DownloadError as e:
            raise DownloadError(
                f"expert {loc.expert} of layer {loc.layer} from the Hub at {self.reader.endpoint}: {e}; "
                "what was fetched is cached, so running again continues"
            ) from None
        return blob

    @property
    def run_bytes(self) -> int:
        """The largest run worth one request: beyond it, pieces on separate connections pay more."""
        return self.pieces_per_expert * self.min_piece_bytes

    def fetch_run(self, locs: list[ExpertLocation], ctx: FetchContext = DEMAND) -> list[ExpertBytes]:
        """The blobs of experts whose ranges merge (`run_ranges`), fetched as one set of ranges into
        one buffer; an expert of one range is a view of it, not a copy.

        The run has the budget of one fetch (retries, `Deadline`); when it fails, its error is
        each expert's (TierChain.fetch_run does not ask for them again one by one)."""
        merged = run_ranges(locs)
        if merged is None:
            raise ValueError("fetch_run needs experts whose byte ranges lie back to back")
        buffer = expert_buffer(sum(m.nbytes for m in merged))
        view = memoryview(buffer)
        try:
            self._read_pieces(split_ranges(merged, self.pieces_per_expert, self.min_piece_bytes), view, ctx)
        except Abandoned:
            raise
        except DownloadError as e:
            first, last = locs[0], locs[-1]
            error = (
                f"experts {first.expert}-{last.expert} of layer {first.layer} from the Hub at "
                f"{self.reader.endpoint}: {e}; what was fetched is cached, so running again continues"
            )
            raise DownloadError(error) from None
        where, off = {}, 0  # merged range -> its offset in the buffer
        for m in merged:
            where[m] = off
            off += m.nbytes
        out: list[ExpertBytes] = []
        for loc in locs:
            parts = []
            for r in loc.ranges:
                m = next(m for m in merged if m.file == r.file and m.start <= r.start and r.end <= m.end)
                parts.append(view[where[m] + r.start - m.start : where[m] + r.end - m.start])
            out.append(parts[0] if len(parts) == 1 else b"".join(parts))
        return out

    def discard(self, loc: ExpertLocation) -> None:
        """Bad bytes from the Hub: nothing is kept here, so the next try asks again."""

    def close(self) -> None:
        self.reader.cancel()  # a fetch in flight ends at its next chunk instead of running on
        self._pool.shutdown()


def _await_pieces(futures: list[Future], deadline: Deadline) -> None:
    """Wait until every piece has ended. Once the fetch's `deadline` passed, pieces still queued
    behind other fetches are cancelled: when their turn came they would fail at once, and the fetch
    would have waited for that turn. A running piece stops by itself within one read."""
    while True:
        _, pending = wait(futures, timeout=deadline.left())  # the whole budget while no piece started
        if not pending:
            return
        if deadline.passed():
            for f in pending:
                f.cancel()  # only a queued one is; the running ones are waited for
            wait(futures)
            return
