"""Looking after a home's expert caches from outside a node: usage, verification, pruning, removal.

`expertmesh ls`, `rm` and `cache` use this. Reading (usage) touches nothing, so it is safe beside a
running node. Everything that deletes takes the cache as a node does — through `DiskCache`, which
holds the exclusive `flock` on the cache's lock file while it is open — so it never runs while
another process keeps the cache (that process's accounting would silently go wrong), and it
deletes through `DiskCache.discard`, the tier's own way of dropping a copy. What opening a
`DiskCache` already guarantees, the maintenance inherits: debris of interrupted writes, files of the
wrong size and files without a recorded digest are deleted at open, so after any of these
operations every expert file left has its record in the digest book (records of deleted files
may stay: a record without a file is what any eviction leaves).

"Least recently used" for pruning is the newer of a file's access and modification times: the
disk tier keeps its recency in memory only, and a file's times are what survives the process (a
file is written when it is fetched; macOS and Linux' default `relatime` note a read at least once
a day). `verify` puts the times back after reading, so checking the cache does not make every
file look freshly used.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from expertmesh.node.errors import ExpertmeshError
from expertmesh.node.hub import local_models
from expertmesh.node.model.expert_index import INDEX_FILENAME, ExpertIndex
from expertmesh.node.store.integrity import DIGESTS_FILENAME, DigestBook, sha256
from expertmesh.node.store.tiers import disk as disk_tier
from expertmesh.node.store.tiers.disk import LOCK_FILENAME, DiskCache, cache_dir

Key = tuple[int, int]


class CacheBusyError(ExpertmeshError):
    """Another process keeps the cache (a node is running on it), or its disk refuses writes."""


@dataclass
class CacheUsage:
    """One model revision's expert cache as it is on disk now."""

    repo_id: str
    commit: str
    root: Path
    experts: int = 0
    nbytes: int = 0
    last_used: float | None = None  # the newest file's access or modification time
    pulled: bool = True  # False: the model's folder is gone (the cache is kept until `rm`)


def expert_files(root: Path) -> dict[Key, Path]:
    """`(layer, expert)` -> path of the expert files under a cache folder (the layout DiskCache writes:
    `{layer}/{expert}.bin`); temporary and stray files are left out."""
    out = {}
    with contextlib.suppress(OSError):
        for path in root.glob("*/*.bin"):
            with contextlib.suppress(ValueError, OSError):
                if not stat.S_ISREG(path.lstat().st_mode):  # a folder or a link is no expert the cache wrote
                    continue
                out[(int(path.parent.name), int(path.stem))] = path
    return out


def _used_at(st: os.stat_result) -> float:
    return max(st.st_atime, st.st_mtime)


def usage(home: Path, repo_id: str, commit: str) -> CacheUsage:
    """What the cache of `repo_id@commit` holds now; read only."""
    root = cache_dir(home, repo_id, commit)
    out = CacheUsage(repo_id, commit, root, pulled=local_models.model_dir(home, repo_id, commit).is_dir())
    for path in expert_files(root).values():
        with contextlib.suppress(OSError):
            st = path.stat()
            out.experts += 1
            out.nbytes += st.st_size
            out.last_used = max(out.last_used or 0.0, _used_at(st))
    return out


def all_usage(home: Path, repo_id: str | None = None) -> list[CacheUsage]:
    """Every expert cache under `home/experts` (of `repo_id` only, if given), sorted by repo and commit."""
    base = home / "experts"
    folders = [base / local_models.repo_folder(repo_id)] if repo_id else sorted(base.glob("*"))
    out = []
    for folder in folders:
        if not folder.is_dir():
            continue
        name = repo_id or local_models.repo_from_folder(folder.name)
        for commit_dir in sorted(p for p in folder.iterdir() if p.is_dir()):
            out.append(usage(home, name, commit_dir.name))
    return out


@contextlib.contextmanager
def _quiet(logger: logging.Logger) -> Iterator[None]:
    """Drop `logger`'s records while inside (the CLI's own error says the same in one line)."""
    drop = logging.Filter(name="\0")  # matches no logger name: every record is filtered out
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


@contextlib.contextmanager
def kept_cache(home: Path, repo_id: str, commit: str) -> Iterator[DiskCache]:
    """The cache of `repo_id@commit`, opened as its one keeper (the node's own `DiskCache`, which
    also clears debris and unverifiable files at open), closed on exit.

    Raises:
        NotPulledError: the model's expert index is not here (the cache cannot be read without it).
        CacheBusyError: another process keeps the cache, or its disk refuses writes.
    """
    index = ExpertIndex.load(local_models.find_index(home, repo_id, commit) / INDEX_FILENAME)
    root = cache_dir(home, repo_id, commit)
    digests = DigestBook(root / DIGESTS_FILENAME)
    with _quiet(disk_tier.logger):  # its "kept by another process" warning: CacheBusyError below says it better
        disk = DiskCache(root, index, budget_bytes=1 << 62, digests=digests)
    try:
        if disk.refused:
            raise CacheBusyError(
                f"the expert cache of {repo_id} at {root} is kept by another expertmesh process (a `serve`, "
                "`run` or `chat` on this home), or its disk refuses writes: stop that process and try again"
            )
        yield disk
    finally:
        disk.close()


# -- verify ----------------------------------------------------------------------------------


@dataclass
class VerifyReport:
    repo_id: str
    commit: str
    checked: int = 0
    checked_bytes: int = 0
    bad: list[tuple[Key, str]] = field(default_factory=list)  # deleted: (key, why)
    dropped_at_open: list[Key] = field(default_factory=list)  # wrong size or no recorded digest: deleted
    unverified: int = 0  # good files whose digest came from one fetch (`expertmesh verify` asks the Hub)
    stray_folders: list[Path] = field(default_factory=list)  # folders where an expert's file belongs: left

    @property
    def deleted(self) -> int:
        return len(self.bad) + len(self.dropped_at_open)


def verify(home: Path, repo_id: str, commit: str, progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Check every expert file of one cache against its sha256 in the digest book; delete the bad ones.

    Nothing is fetched: a deleted expert is fetched again the next time the router asks for it.
    `expertmesh verify REPO` is the other check, of the recorded digests themselves against the Hub.

    Raises:
        NotPulledError, CacheBusyError: as `kept_cache`.
    """
    report = VerifyReport(repo_id, commit)
    before = set(expert_files(cache_dir(home, repo_id, commit)))
    with kept_cache(home, repo_id, commit) as disk:
        held = disk.held()
        report.stray_folders = list(disk.stray_folders)
        strays = {(int(p.parent.name), int(p.name.split(".")[0])) for p in report.stray_folders}
        report.dropped_at_open = sorted(before - set(held) - strays)
        files = expert_files(disk.root)
        for key in held:
            loc = disk.index.expert(*key)
            times = _times(files.get(key))
            blob = disk.fetch(loc)  # a short, long or unreadable file is dropped by the tier itself
            if blob is None:
                report.bad.append((key, "unreadable or of the wrong size"))
                continue
            report.checked += 1
            report.checked_bytes += len(blob)
            digest, recorded = sha256(blob), disk.digests.get(key)
            del blob
            if digest != recorded:
                disk.discard(loc)
                report.bad.append((key, f"sha256 {digest[:12]}… is not the recorded {(recorded or 'none')[:12]}…"))
            else:
                if not disk.digests.verified(key):
                    report.unverified += 1
                if times is not None:  # reading is not using: keep the file's place in the LRU order
                    with contextlib.suppress(OSError):
                        os.utime(files[key], ns=times)
            if progress is not None:
                progress(loc.nbytes)
    return report


def _times(path: Path | None) -> tuple[int, int] | None:
    try:
        st = path.stat() if path is not None else None
    except OSError:
        return None
    return (st.st_atime_ns, st.st_mtime_ns) if st is not None else None


# -- prune -----------------------------------------------------------------------------------


@dataclass
class PruneReport:
    budget_bytes: int
    before_bytes: int = 0
    after_bytes: int = 0
    deleted: list[tuple[str, Key, int]] = field(default_factory=list)  # (repo_id, key, bytes)
    not_pulled: list[CacheUsage] = field(default_factory=list)  # caches of models whose index is gone: left

    @property
    def within(self) -> bool:
        return self.after_bytes <= self.budget_bytes


def prune(home: Path, budget_bytes: int, repo_id: str | None = None) -> PruneReport:
    """Delete the least recently used expert files of every cache (or of `repo_id`'s) until together
    they hold at most `budget_bytes`.

    Every cache is taken before anything is deleted, so either all of them are pruned or, when one is
    kept by a running node, none is (CacheBusyError). Caches of models whose expert index is gone
    are counted but not touched (`expertmesh rm REPO` removes them).

    Raises:
        CacheBusyError: a running process keeps one of the caches.
    """
    report = PruneReport(budget_bytes)
    caches = all_usage(home, repo_id)
    with contextlib.ExitStack() as stack:
        disks: list[DiskCache] = []
        for c in caches:
            if not c.pulled or not _has_index(home, c.repo_id, c.commit):
                report.not_pulled.append(c)
                continue
            disks.append(stack.enter_context(kept_cache(home, c.repo_id, c.commit)))
        orphan_bytes = sum(c.nbytes for c in report.not_pulled)
        total = orphan_bytes + sum(d.nbytes for d in disks)
        report.before_bytes = total
        candidates = []
        for d in disks:
            files = expert_files(d.root)
            for key in d.held():
                with contextlib.suppress(OSError):
                    candidates.append((_used_at(files[key].stat()), d.index.repo_id, key, d))
        candidates.sort(key=lambda c: c[0])
        for _, repo, key, d in candidates:
            if total <= budget_bytes:
                break
            loc = d.index.expert(*key)
            d.discard(loc)
            total -= loc.nbytes
            report.deleted.append((repo, key, loc.nbytes))
        report.after_bytes = orphan_bytes + sum(d.nbytes for d in disks)
    return report


def _has_index(home: Path, repo_id: str, commit: str) -> bool:
    try:
        local_models.find_index(home, repo_id, commit)
    except ExpertmeshError:
        return False
    return True


# -- rm --------------------------------------------------------------------------------------


@dataclass
class Removal:
    """What `rm` takes away for one repo: revision folders, expert caches, and the bytes of both."""

    repo_id: str
    models: list[local_models.PulledModel] = field(default_factory=list)
    caches: list[CacheUsage] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(m.disk_bytes for m in self.models) + sum(c.nbytes for c in self.caches)

    @property
    def empty(self) -> bool:
        return not self.models and not self.caches


def plan_removal(home: Path, repo_id: str, commit: str | None = None) -> Removal:
    """What removing `repo_id` (one commit of it, if given) would delete; deletes nothing."""
    models = [m for m in local_models.pulled_models(home, repo_id) if commit is None or m.commit == commit]
    caches = [c for c in all_usage(home, repo_id) if commit is None or c.commit == commit]
    return Removal(repo_id, models, caches)


@contextlib.contextmanager
def _cache_lock(root: Path) -> Iterator[None]:
    """The cache's lock as DiskCache takes it (without its index: a partial pull has none), held
    while the cache is deleted. Raises CacheBusyError while a node keeps the cache."""
    try:
        fd = os.open(root / LOCK_FILENAME, os.O_RDWR | os.O_CREAT, 0o644)
    except FileNotFoundError:  # no cache folder at all
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise CacheBusyError(
                f"{root} is in use by a running expertmesh process (a `serve`, `run` or `chat` of this model): "
                "stop it and run `expertmesh rm` again"
            ) from None
        yield
    finally:
        os.close(fd)


def remove(home: Path, removal: Removal) -> None:
    """Delete what `plan_removal` listed: each expert cache under its lock, then the revision folders,
    the refs that point to them, and the repo's folders once empty.

    Raises:
        CacheBusyError: a running process keeps one of the caches (nothing of that one is deleted).
    """
    with contextlib.ExitStack() as stack:
        for c in removal.caches:  # every lock first: all or nothing while nodes run
            stack.enter_context(_cache_lock(c.root))
        for c in removal.caches:
            shutil.rmtree(c.root, ignore_errors=True)
    gone = set()
    for m in removal.models:
        shutil.rmtree(m.path, ignore_errors=True)
        gone.add(m.commit)
    root = local_models.model_root(home, removal.repo_id)
    for ref in list((root / "refs").glob("*")):
        with contextlib.suppress(OSError):
            if ref.read_text().strip() in gone:
                ref.unlink()
    for folder in (root / "refs", root, home / "experts" / local_models.repo_folder(removal.repo_id)):
        with contextlib.suppress(OSError):
            folder.rmdir()  # only when empty: other revisions stay
