"""One expert's recorded digest against fresh copies from the origin (the Hub), as the audit of
peers' copies (store/peer_audit.py) and the check of a peer's first copy (store/tier_chain.py)
decide it, by the rule `expertmesh verify` follows (store/verify.py):

- a fresh copy equal to the record confirms it;
- one that differs is fetched again: two fresh copies that agree show the record wrong;
  a second copy equal to the record means the first fresh one was damaged (confirmed);
- three different answers decide nothing (undecided).
"""

from __future__ import annotations

from dataclasses import dataclass

from expertmesh.node.fetching import FetchContext
from expertmesh.node.model.expert_index import ExpertBytes, ExpertLocation
from expertmesh.node.store.integrity import sha256
from expertmesh.node.store.tiers import Tier


@dataclass
class OriginVerdict:
    outcome: str  # confirmed | wrong | undecided
    fetched_bytes: int
    digest: str = ""  # the origin's, when `wrong`
    blob: ExpertBytes | None = None  # the origin's copy, when `wrong`


def check_against_origin(origin: Tier, loc: ExpertLocation, recorded: str, ctx: FetchContext) -> OriginVerdict:
    """Compare `recorded` with fresh copies of `loc` from `origin`.

    Raises:
        LookupError: the origin has no copy; whatever its fetch raises (a DownloadError, Abandoned).
    """
    first = _fetch(origin, loc, ctx)
    digest = sha256(first)
    if digest == recorded:
        return OriginVerdict("confirmed", loc.nbytes)
    second = _fetch(origin, loc, ctx)
    again = sha256(second)
    if again == digest:
        return OriginVerdict("wrong", 2 * loc.nbytes, digest, second)
    return OriginVerdict("confirmed" if again == recorded else "undecided", 2 * loc.nbytes)


def _fetch(origin: Tier, loc: ExpertLocation, ctx: FetchContext) -> ExpertBytes:
    blob = origin.fetch(loc, ctx)
    if blob is None:
        raise LookupError(f"{origin.source} has no copy of expert {loc.expert} of layer {loc.layer}")
    return blob
