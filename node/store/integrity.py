"""The sha256 of every expert, recorded at first fetch, so later copies can be checked.

Upstream publishes a digest per shard, not per byte range, so an expert's digest is taken from
the first bytes that passed the Hub's strict 206 checks, and every copy that comes from anywhere
but RAM afterwards (the disk cache, a peer) must match it.

Kept as an append-only text file (`layer expert sha256` per line) beside the disk cache. A line
is written before the expert's file is published, so a cached file always has its digest; a
torn last line after a crash is ignored, and the file it would have covered is then deleted as
unverifiable.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

DIGESTS_FILENAME = "digests.tsv"


def sha256(blob: bytes | bytearray | memoryview) -> str:
    """hashlib releases the interpreter lock on large buffers, so fetch threads hash in parallel."""
    return hashlib.sha256(blob).hexdigest()


class DigestBook:
    def __init__(self, path: Path):
        self.path = path
        self._digests: dict[tuple[int, int], str] = {}
        self._unpersisted: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        self._load()

    def _load(self) -> None:
        try:
            text = self.path.read_text(encoding="ascii", errors="replace")
        except FileNotFoundError:
            return
        for n, line in enumerate(text.splitlines(), 1):
            parts = line.split()
            if len(parts) == 3 and len(parts[2]) == 64 and parts[0].isdigit() and parts[1].isdigit():
                self._digests[(int(parts[0]), int(parts[1]))] = parts[2]
            elif line.strip():
                logger.warning("%s:%d: ignoring a malformed line (an interrupted write?)", self.path, n)

    def get(self, key: tuple[int, int]) -> str | None:
        return self._digests.get(key)

    def __len__(self) -> int:
        return len(self._digests)

    def check(self, key: tuple[int, int], blob, may_record: bool) -> bool:
        """Whether `blob` is a good copy of expert `key`: equal to the recorded digest, or, when
        none is recorded yet and `may_record` (bytes that passed a remote source's checks), the
        first copy, whose digest is then recorded. A disk copy without a digest is unverifiable."""
        digest = sha256(blob)
        known = self.get(key)
        if known is None and may_record:
            self.record(key, digest)
            return True
        return digest == known

    def persisted(self, key: tuple[int, int]) -> bool:
        """Whether the digest of `key` is on disk: only then may its expert be cached on disk."""
        return key in self._digests and key not in self._unpersisted

    def record(self, key: tuple[int, int], digest: str) -> None:
        """Remember `digest` for `key`; the first one recorded stays (it is the reference).

        A failed write (a full disk) keeps the digest in memory only; `persisted` then says no.
        """
        with self._lock:
            if key in self._digests:
                return
            self._digests[key] = digest
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    line = f"{key[0]} {key[1]} {digest}\n".encode()
                    if os.write(fd, line) != len(line):  # one write: lines never interleave
                        raise OSError(28, "short write")
                finally:
                    os.close(fd)
            except OSError as e:
                self._unpersisted.add(key)
                logger.warning("could not record the digest of expert %s (%s): it stays in RAM only", key, e)
