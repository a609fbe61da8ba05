"""Checking the experts on disk against fresh copies from the Hub: `expertmesh verify`.

The Hub publishes a sha256 per shard, not per expert, so the digest an expert is checked against
is taken from its first fetch (store/integrity.py). A first fetch damaged in a way the 206 checks
miss (right length, wrong bytes: a bad proxy, a flipped bit in a CDN's memory) would otherwise be
the truth forever: every later copy is checked against it, and the damaged file on disk matches
it. Verification asks the Hub again, bypassing every cache, for each expert whose digest came from
one fetch only:

- the fresh copy matches the record: the record is confirmed (`v` in the book);
- it does not: a second fresh copy decides. Two fresh copies that agree replace the record and
  the file on disk (and are counted); a second copy equal to the record means the first fresh
  one was the damaged one, and the record is confirmed;
- three different answers: the expert is reported undecided and left as it was.

What it guarantees: after a run, every expert on disk that it confirmed or corrected matches what
the Hub served twice independently. It cannot catch a Hub that serves the same wrong bytes every
time (the Hub is the origin). It costs one more download of each unverified expert, which is why
it is a command a user runs when the link is idle, not part of every fetch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from expertmesh.node.model.expert_index import ExpertIndex
from expertmesh.node.store.integrity import DigestBook, fast_digest, sha256
from expertmesh.node.store.stats import ExpertKey
from expertmesh.node.store.tiers.disk import DiskCache
from expertmesh.node.store.tiers.hub import HubSource

logger = logging.getLogger(__name__)


@dataclass
class VerifyReport:
    confirmed: int = 0  # records a fresh copy agreed with
    corrected: list[ExpertKey] = field(default_factory=list)  # records (and files) replaced
    undecided: list[ExpertKey] = field(default_factory=list)  # three different answers
    failed: list[tuple[ExpertKey, str]] = field(default_factory=list)  # the Hub did not answer
    already: int = 0  # verified before this run
    bytes_fetched: int = 0


def unverified_on_disk(disk: DiskCache, digests: DigestBook) -> list[ExpertKey]:
    return sorted(k for k in disk.held() if not digests.verified(k))


def verify_experts(
    index: ExpertIndex,
    disk: DiskCache,
    hub: HubSource,
    digests: DigestBook,
    keys: list[ExpertKey] | None = None,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Verify `keys` (default: every expert held on disk whose record is unverified) against
    fresh copies from `hub`; `progress(bytes)` after each expert."""
    report = VerifyReport()
    if keys is None:
        held = disk.held()
        keys = unverified_on_disk(disk, digests)
        report.already = len(held) - len(keys)
    for key in keys:
        loc = index.expert(*key)
        try:
            fresh = hub.fetch(loc)
            report.bytes_fetched += loc.nbytes
            digest = sha256(fresh)
            recorded = digests.get(key)
            if digest == recorded:
                digests.mark_verified(key)
                report.confirmed += 1
            else:
                again = hub.fetch(loc)
                report.bytes_fetched += loc.nbytes
                second = sha256(again)
                if second == digest:
                    digests.replace(key, digest, fast_digest(again))
                    disk.discard(loc)
                    disk.put(loc, again, wait=True)
                    report.corrected.append(key)
                elif second == recorded:
                    digests.mark_verified(key)
                    report.confirmed += 1
                else:
                    logger.warning("expert %s: the record and two fresh copies from the Hub all differ", key)
                    report.undecided.append(key)
        except Exception as e:  # noqa: BLE001 - reported per expert, the others go on
            report.failed.append((key, str(e)))
        if progress is not None:
            progress(loc.nbytes)
    return report
