"""The experts a node serves to its peers: its disk copies, checked, and — as an owner — the Hub.

Full nodes and cache peers both have one; a cache peer has nothing else (no core, no MLX), which
is why this does not depend on a loaded model.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from expertmesh.node.errors import Abandoned, DownloadError
from expertmesh.node.model.expert_index import ExpertBytes, ExpertIndex, ExpertLocation
from expertmesh.node.store.integrity import DigestBook
from expertmesh.node.store.stats import StoreStats
from expertmesh.node.store.tiers import Tier
from expertmesh.node.store.tiers.disk import DiskCache


@dataclass
class ServedExperts:
    repo_id: str
    commit: str
    index: ExpertIndex
    disk: DiskCache
    digests: DigestBook
    remote_tiers: list[Tier]  # nearest first, after the disk: peers, then the Hub
    stats: StoreStats
    ram_budget_bytes: int = 0
    # Expert bytes the remote tiers have received since the node started (a counter): what a
    # peer waiting on this owner's fetch is shown as its progress (FetchExpert's `progress`).
    received_bytes: Callable[[], int] = field(default=lambda: 0, repr=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def held_copy(self, loc: ExpertLocation) -> bytes | None:
        """The disk copy if it matches its recorded digest (a bad one is deleted and counted)."""
        blob = self.disk.fetch(loc)
        if blob is None:
            return None
        if self.digests.check((loc.layer, loc.expert), blob, may_record=False):
            return bytes(blob)
        self.stats.record_integrity_failure("disk")
        self.disk.discard(loc)
        return None

    def fetch_as_owner(
        self,
        loc: ExpertLocation,
        wanted: Callable[[], bool] = lambda: True,
        begun: Callable[[], None] = lambda: None,
    ) -> ExpertBytes:
        """Fetch a missing expert from the sources after the disk, keep it and return it.

        One at a time, so peers asking for the same expert at once cost one Hub fetch. `wanted`
        is asked once this fetch's turn comes: a caller that gave up while it waited behind the
        others is not fetched for, since it is fetching the expert itself by then and the
        household's link would carry it twice. `begun` is called as the fetch starts.

        Raises:
            Abandoned: `wanted` said no.
            DownloadError: no source gave a good copy.
        """
        key = (loc.layer, loc.expert)
        self.disk.claim(key)  # asked as the owner: kept as one, whoever owns it in this node's view
        with self._lock:
            blob = self.held_copy(loc)
            if blob is not None:
                return blob
            if not wanted():
                raise Abandoned(f"expert {loc.expert} of layer {loc.layer}: its caller gave up before its turn")
            begun()
            for tier in self.remote_tiers:
                fetched = tier.fetch(loc)
                if fetched is None or len(fetched) != loc.nbytes:
                    continue
                if not self.digests.check(key, fetched, may_record=True):
                    self.stats.record_integrity_failure(tier.source)
                    tier.discard(loc)
                    continue
                self.stats.record(tier.source, loc.nbytes)
                self.disk.put(loc, fetched, wait=True)  # `keep` and a peer's next ask rely on it
                return fetched
        raise DownloadError(f"expert {loc.expert} of layer {loc.layer}: no source has a good copy")

    def keep(self, loc: ExpertLocation, wanted: Callable[[], bool] = lambda: True) -> bool:
        """Warm-up: hold this expert on disk, fetching it as its owner if missing, but never by
        evicting another — a warm fills free budget and must not churn what use has cached.

        Returns False when only an eviction (or a full file system) would make room.

        Raises:
            DownloadError: no source gave a good copy.
        """
        key = (loc.layer, loc.expert)
        self.disk.claim(key)
        with self._lock:  # the room check and the fetch as one step: two warms cannot both take the last slot
            if key in self.disk:
                return True
            if not self.disk.has_room(loc.nbytes):
                return False
            self.fetch_as_owner(loc, wanted)
            return key in self.disk

    def close(self) -> None:
        for tier in self.remote_tiers:
            tier.close()
