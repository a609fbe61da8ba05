"""The digests of every expert, recorded at first fetch, so later copies can be checked.

Upstream publishes a digest per shard, not per byte range, so an expert's sha256 is taken from
the first copy that crossed a network, and every copy that comes from anywhere but RAM afterwards
(the disk cache, a peer, the Hub again) must match it. That first copy is the Hub's, after its
strict 206 checks, or a household peer's (store/tier_chain.py `verify`): members hold the
household's secret, as they do for the outputs they compute for each other
(household/remote_experts.py), which nothing here could check either. But a member's copy can be
wrong without malice (its own first fetch damaged in a way the 206 checks miss, and recorded as
the truth there), and a wrong first copy would otherwise spread through the household unseen. So
a record made from a peer's copy says whose copy it was (state `p:<peer>`), and is audited: on an
idle link a sample of such records is checked against fresh copies from the Hub
(store/peer_audit.py), and a record that two agreeing Hub copies contradict, there or on any
later fetch, costs its peer the household's trust for content: every record it vouched for is
forgotten (a `forgotten` line), so each of those experts is taken anew from another source.
`expertmesh verify` checks them as it checks every unverified expert on disk (store/verify.py).

Two digests, for two kinds of copy. What crosses a network (the Hub, a peer) is checked against
the sha256: it is what the Hub and the household vouch for, and a peer's bytes must not be able to
pass for another expert's. A copy read back from this machine's own disk guards against something
else: bit rot, a truncated, swapped or overwritten file, never a forger (whoever can write the cache
can write this book too). For that a fast hash is enough, and sha256 is too slow for it: at an
SSD's speed hashing every read with sha256 would bound a warm read, not the disk. xxh3_128 is
about ten times cheaper per byte, as cheap as crc32c with 96 more bits; the candidates, their cost
and the command that measures them are in docs/benchmarks.md, "Warm disk at the SSD's speed".
Its 128 bits make an accidental match of a damaged or swapped file as likely as a sha256 collision
is for any practical purpose; it is not a defence against a chosen forgery, which the disk copy
does not need. Its one cost: the xxhash binding holds the interpreter lock while it hashes.

Kept as an append-only text file beside the disk cache, one record per line:
`layer expert sha256 state [xxh3_128] crc32`, state `u` (unverified: taken from one fetch from the
Hub), `p:<peer>` (unverified: a household peer's copy, `<peer>` its node id as `book_peer_id`
writes it) or `v` (verified: two independent fresh copies agreed, store/verify.py), the xxh3_128 (32 hex
digits; optional: books written before it have none, and an expert without one is checked once by
its sha256 on its next disk read, which then records it), the crc32 (8 hex digits) taken
over the fields before it, so a torn, cut or merged line is recognised and skipped instead of read
as a record of the wrong expert (a cut inside a layer number would otherwise parse). A line is written before the
expert's file is published, so a cached file always has its digest; a file whose record was lost
is deleted as unverifiable. Nothing is appended onto a torn tail (a newline goes first), and a
book with skipped lines, duplicates, forgotten experts or lines of the older three-field format is
compacted at load (written anew and renamed into place). When records of one expert disagree, the
last one wins: that is how a wrong digest is replaced (`replace`), and `layer expert forgotten
crc32` drops the expert's record (`forget_vouched`).

Several processes may share a home: appends and compaction happen under an exclusive `flock`
on a lock file beside the book, and before appending, a process reads what the others appended
since it last looked, so it neither duplicates their records nor contradicts them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import xxhash

from expertmesh.node.model.expert_index import ExpertBytes

logger = logging.getLogger(__name__)

DIGESTS_FILENAME = "digests.tsv"
# a write refused for these is the disk tier's warning (store/tiers/disk.py), not the book's
_DISK_REFUSES = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
LOCK_SUFFIX = ".lock"
FORGOTTEN = "forgotten"  # the third field of a line that drops an expert's record
# a peer's id as the book writes it: one field, no spaces, never more than 64 characters
_BOOK_PEER_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


def sha256(blob: ExpertBytes) -> str:
    """hashlib releases the interpreter lock on large buffers, so fetch threads hash in parallel."""
    return hashlib.sha256(blob).hexdigest()


def fast_digest(blob: ExpertBytes) -> str:
    """The xxh3_128 of `blob`: the check of a copy read back from the local disk (see the module's docstring)."""
    return xxhash.xxh3_128(blob).hexdigest()


def _is_hex(s: str, n: int) -> bool:
    return len(s) == n and all(c in "0123456789abcdef" for c in s)


def book_peer_id(node_id: str) -> str:
    """`node_id` as a record names its peer: as it is when it is a plain one-word id (a node's own
    are 16 hex digits), else a digest of it, so an id a peer chose cannot break a line or pass
    for another peer's."""
    if _BOOK_PEER_ID.fullmatch(node_id):
        return node_id
    return "h" + hashlib.sha256(node_id.encode("utf-8", "surrogatepass")).hexdigest()[:31]


def _state(field: str) -> tuple[bool, str | None] | None:
    """(verified, the peer that vouched) of a record's state field; None if it is not one."""
    if field in ("u", "v"):
        return field == "v", None
    if field.startswith("p:") and _BOOK_PEER_ID.fullmatch(field[2:]):
        return False, field[2:]
    return None


@dataclass(frozen=True)
class Record:
    key: tuple[int, int]
    digest: str
    verified: bool = False
    fast: str | None = None  # the xxh3_128 of the same bytes, when recorded
    old_format: bool = False  # a line of an earlier format: the book is rewritten in this one
    vouched_by: str | None = None  # the peer whose copy the digest was taken from (`book_peer_id`)
    forgotten: bool = False  # the line drops the expert's record (its digest is "")


def _crc(fields: list[str]) -> str:
    return f"{zlib.crc32(' '.join(fields).encode()):08x}"


def format_record(
    key: tuple[int, int], digest: str, verified: bool = False, fast: str | None = None, vouched_by: str | None = None
) -> str:
    """One record's line; `vouched_by`: the `book_peer_id` of the peer whose copy it is (unverified)."""
    state = "v" if verified else ("u" if vouched_by is None else f"p:{vouched_by}")
    fields = [str(key[0]), str(key[1]), digest, state]
    if fast is not None:
        fields.append(fast)
    return " ".join([*fields, _crc(fields)]) + "\n"


def format_forgotten(key: tuple[int, int]) -> str:
    """The line that drops `key`'s record: the next good copy from anywhere is recorded afresh."""
    fields = [str(key[0]), str(key[1]), FORGOTTEN]
    return " ".join([*fields, _crc(fields)]) + "\n"


def parse_record(line: str) -> Record | None:
    """The record of one line, or None if it is not a whole one. Earlier formats are read too:
    `layer expert sha256` and `layer expert sha256 crc32` (both unverified), and the current one
    without its optional xxh3_128."""
    parts = line.split()
    if len(parts) not in (3, 4, 5, 6) or not (parts[0].isdigit() and parts[1].isdigit()):
        return None
    key = (int(parts[0]), int(parts[1]))
    if len(parts) == 4 and parts[2] == FORGOTTEN:
        return Record(key, "", forgotten=True) if parts[3] == _crc(parts[:3]) else None
    if not _is_hex(parts[2], 64):
        return None
    state = _state(parts[3]) if len(parts) >= 5 else None
    if len(parts) == 6:
        if state is None or not _is_hex(parts[4], 32) or parts[5] != _crc(parts[:5]):
            return None
        return Record(key, parts[2], verified=state[0], fast=parts[4], vouched_by=state[1])
    if len(parts) == 5:
        if state is None or parts[4] != _crc(parts[:4]):
            return None
        return Record(key, parts[2], verified=state[0], vouched_by=state[1])
    if len(parts) == 4 and parts[3] != _crc(parts[:3]):
        return None
    return Record(key, parts[2], old_format=True)


class DigestBook:
    def __init__(self, path: Path):
        self.path = path
        self._digests: dict[tuple[int, int], str] = {}
        self._fast: dict[tuple[int, int], str] = {}  # xxh3_128 of the bytes whose sha256 is in _digests
        self._unpersisted: set[tuple[int, int]] = set()
        self._verified: set[tuple[int, int]] = set()
        self._vouched: dict[tuple[int, int], str] = {}  # unverified records taken from a peer's copy: whose
        self._lock = threading.Lock()
        self._seen: tuple[int, int] = (0, 0)  # (inode, offset) of the book read so far
        self._torn_at: tuple[int, int] | None = None  # (inode, offset) of a torn tail already counted
        self.skipped_lines = 0  # torn or malformed lines found (metrics, status)
        self.replaced = 0  # recorded digests replaced by what the Hub agreed on twice
        self.write_error: OSError | None = None  # the last failed write: the disk tier stops writing too
        with self._lock, self._locked():
            needs_compaction = self._read_new()
            if needs_compaction:
                self._compact()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The book to ourselves across processes (a read-only or missing folder: without a lock,
        since nobody can write there either)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path.with_name(self.path.name + LOCK_SUFFIX), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _read_new(self) -> bool:
        """Read what was appended since we last looked (all of it if the book was replaced);
        True if anything found calls for compaction. Called with both locks held."""
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                inode, offset = self._seen
                if st.st_ino != inode or st.st_size < offset:
                    offset = 0  # compacted by another process, or new
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            self._seen = (0, 0)
            return False
        except IsADirectoryError:  # not a book: moved aside, and the cache starts a new one
            aside = self.path.with_name(f"{self.path.name}.not-a-book.{int(time.time())}")
            os.replace(self.path, aside)
            logger.warning(
                "%s was a folder, not the digest book: moved it to %s and started a new book", self.path, aside
            )
            self._seen = (0, 0)
            return False
        lines = data.split(b"\n")
        torn = lines.pop()  # after the last newline: empty, or a record cut short
        consumed = len(data) - len(torn)
        messy = False
        for n, raw in enumerate(lines):
            record = parse_record(raw.decode("ascii", errors="replace"))
            if record is None:
                if raw.strip():
                    self.skipped_lines += 1
                    messy = True
                    logger.warning(
                        "%s: skipping a torn or malformed record (line %d of what was read)", self.path, n + 1
                    )
                continue
            key = record.key
            if record.forgotten:
                messy = True  # the record and this line both go at the next compaction
                self._drop(key)
                continue
            messy |= record.old_format or key in self._digests
            if self._digests.get(key) != record.digest:
                self._fast.pop(key, None)  # a fast hash belongs to the bytes of one sha256
            self._digests[key] = record.digest  # the last record of an expert wins
            if record.fast is not None:
                self._fast[key] = record.fast
            if record.verified:
                self._verified.add(key)
            else:
                self._verified.discard(key)
            self._vouch(key, record.vouched_by)
            self._unpersisted.discard(key)
        if torn.strip() and (st.st_ino, offset + consumed) != self._torn_at:
            self._torn_at = (st.st_ino, offset + consumed)  # counted once, however often it is read
            self.skipped_lines += 1
            messy = True
            logger.warning("%s: skipping a torn last record (an interrupted write)", self.path)
        self._seen = (st.st_ino, offset + consumed)
        return messy

    def _vouch(self, key: tuple[int, int], peer: str | None) -> None:
        if peer is None:
            self._vouched.pop(key, None)
        else:
            self._vouched[key] = peer

    def _drop(self, key: tuple[int, int]) -> None:
        """Forget everything known of `key` (the book's lock held)."""
        self._digests.pop(key, None)
        self._fast.pop(key, None)
        self._verified.discard(key)
        self._vouched.pop(key, None)
        self._unpersisted.discard(key)

    def _compact(self) -> None:
        """One record per expert, written anew and renamed into place (both locks held)."""
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "w", encoding="ascii") as f:
                for key, digest in self._digests.items():
                    if key not in self._unpersisted:
                        f.write(
                            format_record(
                                key, digest, key in self._verified, self._fast.get(key), self._vouched.get(key)
                            )
                        )
            os.replace(tmp, self.path)
            self._seen = (os.stat(self.path).st_ino, os.stat(self.path).st_size)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            logger.warning("could not compact %s (%s); its good records are used as they are", self.path, e.strerror)

    def get(self, key: tuple[int, int]) -> str | None:
        return self._digests.get(key)

    def __len__(self) -> int:
        return len(self._digests)

    def check(self, key: tuple[int, int], blob, may_record: bool) -> bool:
        """Whether `blob` is a good copy of expert `key`: equal to the recorded digest, or, when
        none is recorded yet and `may_record` (bytes that passed a remote source's checks), the
        first copy, whose digest is then recorded. A disk copy without a digest is unverifiable."""
        return self.check_digest(key, sha256(blob), may_record, blob)

    def check_digest(
        self, key: tuple[int, int], digest: str, may_record: bool, blob=None, vouched_by: str | None = None
    ) -> bool:
        """`check` for a sha256 already computed; given the `blob` too, its fast hash is recorded
        with it (or beside an older record without one) for `check_local`. `vouched_by`: the node
        id of the peer the copy came from, recorded with a first copy (None: from the Hub)."""
        known = self.get(key)
        if known is None and may_record:
            self.record(key, digest, fast_digest(blob) if blob is not None else None, vouched_by)
            return True
        if digest != known:
            return False
        if blob is not None and key not in self._fast:
            self._learn_fast(key, digest, fast_digest(blob))
        return True

    def check_local(self, key: tuple[int, int], blob: ExpertBytes) -> bool:
        """Whether `blob`, read back from this machine's disk, is the copy of `key` that was written:
        its xxh3_128 equal to the recorded one. An expert recorded without one (an older book) is
        checked by its sha256 once, and its xxh3_128 recorded then. No record: unverifiable, False."""
        known = self.get(key)
        if known is None:
            return False
        fast = self._fast.get(key)
        if fast is not None:
            return fast_digest(blob) == fast
        if sha256(blob) != known:
            return False
        self._learn_fast(key, known, fast_digest(blob))
        return True

    def fast(self, key: tuple[int, int]) -> str | None:
        """The recorded xxh3_128 of `key`, if any."""
        return self._fast.get(key)

    def _learn_fast(self, key: tuple[int, int], digest: str, fast: str) -> None:
        """Add the fast hash of bytes that matched the sha256 `digest` to the record of `key`."""
        self._write(
            key,
            digest,
            replace=True,
            verified=key in self._verified,
            fast=fast,
            unless_changed=True,
            vouched_by=self._vouched.get(key),
        )

    def verified(self, key: tuple[int, int]) -> bool:
        """Whether the digest of `key` was confirmed by two independent fresh copies from the Hub."""
        return key in self._verified

    def vouched_by(self, key: tuple[int, int]) -> str | None:
        """The peer (`book_peer_id`) whose copy gave `key`'s unverified record, if a peer's did."""
        return self._vouched.get(key)

    def vouched(self) -> dict[tuple[int, int], str]:
        """Every unverified record a peer's copy gave, and whose copy it was."""
        with self._lock:
            return dict(self._vouched)

    def mark_verified(self, key: tuple[int, int]) -> None:
        """A fresh copy from the Hub agreed with the recorded digest (taken from another copy, the
        Hub's or a peer's): it is the expert's."""
        digest = self.get(key)
        if digest is not None and key not in self._verified:
            self._write(key, digest, replace=True, verified=True, fast=self._fast.get(key))

    def persisted(self, key: tuple[int, int]) -> bool:
        """Whether the digest of `key` is on disk: only then may its expert be cached on disk."""
        return key in self._digests and key not in self._unpersisted

    def record(self, key: tuple[int, int], digest: str, fast: str | None = None, vouched_by: str | None = None) -> None:
        """Remember `digest` (and `fast`, the xxh3_128 of the same bytes) for `key` unless one is
        recorded (here or by another process sharing the book): the first one stays the reference
        until `replace`d. `vouched_by`: the node id of the peer whose copy it is (None: the Hub's).

        A failed write (a full or read-only disk) keeps the digest in memory only; `persisted`
        then says no.
        """
        peer = None if vouched_by is None else book_peer_id(vouched_by)
        self._write(key, digest, replace=False, verified=False, fast=fast, vouched_by=peer)

    def replace(self, key: tuple[int, int], digest: str, fast: str | None = None) -> str | None:
        """Make `digest` (and `fast`, the xxh3_128 of the same bytes) the reference for `key`: the
        recorded one was contradicted by fresh copies from the Hub that agreed with each other
        (store/tier_chain.py, store/peer_audit.py). Returns the peer that had vouched for the
        record replaced (`book_peer_id`), if a peer's copy gave it."""
        old, peer = self.get(key), self._vouched.get(key)
        self._write(key, digest, replace=True, verified=True, fast=fast)  # two fresh copies agreed on it
        self.replaced += 1
        logger.warning(
            "expert %s: the recorded sha256 %s… was contradicted by two fresh copies from the Hub that agree; "
            "recording theirs (%s…)",
            key,
            (old or "none")[:12],
            digest[:12],
        )
        return peer

    def forget_vouched(self, peer: str) -> list[tuple[int, int]]:
        """Drop every unverified record `peer` (a `book_peer_id`) vouched for, in this process and
        in the book (one `forgotten` line each); the experts whose records were dropped. What
        another process recorded meanwhile is read first, so its records from that peer go too."""
        with self._lock:
            try:
                with self._locked():
                    self._read_new()
                    keys = [k for k, p in self._vouched.items() if p == peer]
                    if keys:
                        self._append("".join(format_forgotten(k) for k in keys).encode())
            except OSError as e:  # kept in RAM only: the copies go, and the book forgets at its next load
                keys = [k for k, p in self._vouched.items() if p == peer]
                logger.warning("could not write to %s (%s): its records are dropped in RAM only", self.path, e.strerror)
            for key in keys:
                self._drop(key)
        return keys

    def _write(
        self,
        key: tuple[int, int],
        digest: str,
        replace: bool,
        verified: bool,
        fast: str | None = None,
        unless_changed: bool = False,
        vouched_by: str | None = None,
    ) -> None:
        """Append a record; `unless_changed`: only while `digest` is still the recorded one (adding
        a fast hash must not bring back a sha256 another process replaced meanwhile)."""
        if verified:
            vouched_by = None
        with self._lock:
            if not replace and key in self._digests:
                return
            try:
                with self._locked():
                    self._read_new()  # what other processes recorded meanwhile
                    if not replace and key in self._digests:
                        return
                    if unless_changed and (self._digests.get(key) != digest or key in self._unpersisted):
                        return
                    if self._digests.get(key) != digest:
                        self._fast.pop(key, None)
                    self._digests[key] = digest
                    if fast is not None:
                        self._fast[key] = fast
                    self._append(format_record(key, digest, verified, fast, vouched_by).encode())
                self._unpersisted.discard(key)
                if verified:
                    self._verified.add(key)
                else:
                    self._verified.discard(key)
                self._vouch(key, vouched_by)
            except OSError as e:
                if unless_changed:  # only a fast hash was to be added: kept in RAM, the record stands
                    if self._digests.get(key) == digest and fast is not None:
                        self._fast[key] = fast
                    return
                if self._digests.get(key) != digest:
                    self._fast.pop(key, None)
                self._digests[key] = digest
                if fast is not None:
                    self._fast[key] = fast
                self._vouch(key, vouched_by)
                self._unpersisted.add(key)
                # once, not per expert; a disk that refuses (full, read-only) is the disk tier's one
                # warning already (it stops writing when the book cannot be written), not a second one
                quiet = self.write_error is not None or e.errno in _DISK_REFUSES
                self.write_error = e
                (logger.debug if quiet else logger.warning)(
                    "could not record the digest of expert %s (%s): it stays in RAM only", key, e.strerror
                )

    def _append(self, line: bytes) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                line = b"\n" + line  # never onto a torn tail: that record is lost, this one is not
            try:
                if os.write(fd, line) != len(line):  # one write: lines never interleave
                    raise OSError(errno.ENOSPC, "No space left on device (a short write)")
            except OSError:
                # a full disk took part of the record: cut it off again (the book's lock is ours), so
                # no half-written record stays behind to be skipped, warned about and compacted later
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)
                raise
            self._seen = (os.fstat(fd).st_ino, size + len(line))
        finally:
            os.close(fd)
