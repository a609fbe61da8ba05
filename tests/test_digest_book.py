"""The digest book alone: records check themselves, a torn tail is neither read nor appended onto,
a book with damage or duplicates is compacted at load, and two processes sharing one book see each
other's records instead of duplicating or contradicting them."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from expertmesh.node.store.integrity import DigestBook, Record, fast_digest, format_record, parse_record, sha256

A = "a" * 64
B = "b" * 64
C = "c" * 64


def test_a_record_checks_itself() -> None:
    line = format_record((12, 5), A)
    assert parse_record(line) == Record((12, 5), A)
    assert parse_record(format_record((12, 5), A, verified=True)) == Record((12, 5), A, verified=True)
    assert parse_record(line[1:]) is None  # "2 5 …": a cut inside the layer number is caught
    assert parse_record(line.replace("a", "b", 1)) is None
    assert parse_record(line.replace(" u ", " v ")) is None  # the state is covered too
    assert parse_record(f"12 5 {A}") == Record((12, 5), A, old_format=True)  # older formats are still read


def test_nothing_is_appended_onto_a_torn_tail_and_the_book_is_compacted(tmp_path: Path) -> None:
    path = tmp_path / "digests.tsv"
    path.write_text(format_record((1, 1), A) + format_record((1, 1), A) + f"1 2 {B}\n" + format_record((1, 3), C)[:20])
    book = DigestBook(path)
    assert book.get((1, 1)) == A and book.get((1, 2)) == B and book.get((1, 3)) is None
    assert book.skipped_lines == 1
    assert path.read_text() == format_record((1, 1), A) + format_record((1, 2), B)  # compacted, one format
    with path.open("a") as f:  # a crash tears the next append too
        f.write(format_record((2, 0), C)[:9])
    book.record((2, 1), C)
    assert DigestBook(path).get((2, 1)) == C  # its own line, not glued to the torn one


def _record(path: str, key: tuple[int, int], digest: str) -> None:
    DigestBook(Path(path)).record(key, digest)


@pytest.mark.e2e
def test_two_processes_share_one_book(tmp_path: Path) -> None:
    path = tmp_path / "digests.tsv"
    mine = DigestBook(path)
    ctx = multiprocessing.get_context("spawn")
    other = ctx.Process(target=_record, args=(str(path), (3, 3), A))
    other.start()
    other.join(60)
    assert other.exitcode == 0
    mine.record((3, 3), B)  # the other process was first: its record stands, ours is not appended
    assert mine.get((3, 3)) == A
    assert [parse_record(line).key for line in path.read_text().splitlines()] == [(3, 3)]
    mine.replace((3, 3), C)  # until the Hub says otherwise
    assert DigestBook(path).get((3, 3)) == C and mine.replaced == 1
    assert DigestBook(path).verified((3, 3))  # two fresh copies agreed on it


F = "0123456789abcdef" * 2  # an xxh3_128


def test_the_fast_hash_is_an_optional_field_covered_by_the_crc() -> None:
    line = format_record((3, 7), A, verified=True, fast=F)
    assert parse_record(line) == Record((3, 7), A, verified=True, fast=F)
    assert parse_record(line.replace(F, F[::-1])) is None  # a changed fast hash fails the crc
    assert parse_record(line.replace(F, F[:-1])) is None  # so does a short one
    assert parse_record(format_record((3, 7), A, verified=True)) == Record((3, 7), A, verified=True)  # none: fine


def test_an_older_book_without_fast_hashes_learns_them_and_a_new_sha256_drops_the_old_one(tmp_path: Path) -> None:
    path = tmp_path / "digests.tsv"
    blob = bytes(range(256)) * 4096  # 1 MiB
    digest = sha256(blob)
    path.write_text(format_record((1, 1), digest) + format_record((1, 2), B))  # as books were before
    book = DigestBook(path)
    assert book.fast((1, 1)) is None
    assert book.check_local((1, 1), blob)  # checked by its sha256 once, the fast hash learnt then
    assert book.fast((1, 1)) == fast_digest(blob)
    again = DigestBook(path)  # and kept in the book for the next process
    assert again.fast((1, 1)) == fast_digest(blob) and again.get((1, 1)) == digest
    damaged = bytearray(blob)
    damaged[len(blob) // 2] ^= 1
    assert not again.check_local((1, 1), damaged)
    assert not again.check_local((1, 2), blob)  # no fast hash, wrong sha256: refused, nothing learnt
    assert again.fast((1, 2)) is None
    assert not again.check_local((9, 9), blob)  # no record: unverifiable
    again.replace((1, 1), C)  # another sha256: the fast hash of the old bytes no longer holds
    assert again.fast((1, 1)) is None and DigestBook(path).fast((1, 1)) is None


def test_a_folder_where_the_book_belongs_is_moved_aside(tmp_path: Path) -> None:
    """A digest book that is a folder made every `run` refuse to start (found by an audit): it
    is moved aside and a new book begins, so the cache works again and nothing is deleted."""
    path = tmp_path / "digests.tsv"
    path.mkdir()
    (path / "kept.txt").write_text("someone's")
    book = DigestBook(path)
    book.record((1, 2), "ab" * 32)
    assert book.get((1, 2)) == "ab" * 32
    assert path.is_file()
    [aside] = tmp_path.glob("digests.tsv.not-a-book.*")
    assert (aside / "kept.txt").read_text() == "someone's"


def test_a_peers_copy_is_recorded_as_its_and_forgotten_with_it(tmp_path: Path) -> None:
    """A record taken from a peer's copy names the peer, across a reload; when that peer is shown
    wrong, all it vouched for is forgotten in this process and in the book, and the next copy of
    each expert is recorded afresh."""
    path = tmp_path / "digests.tsv"
    book = DigestBook(path)
    book.record((1, 1), A, vouched_by="liar")
    book.record((1, 2), B, vouched_by="honest")
    book.record((1, 3), C, vouched_by="liar")
    book.record((1, 4), C)  # the Hub's
    assert parse_record(format_record((1, 1), A, vouched_by="liar")) == Record((1, 1), A, vouched_by="liar")
    assert DigestBook(path).vouched() == {(1, 1): "liar", (1, 2): "honest", (1, 3): "liar"}
    book.mark_verified((1, 3))  # the Hub agreed with this one: no longer the peer's word
    assert book.vouched_by((1, 3)) is None and DigestBook(path).verified((1, 3))

    assert book.forget_vouched("liar") == [(1, 1)]
    assert book.get((1, 1)) is None and book.get((1, 2)) == B and book.get((1, 3)) == C
    reloaded = DigestBook(path)  # the book forgets too, and is compacted at load
    assert reloaded.get((1, 1)) is None and reloaded.vouched() == {(1, 2): "honest"}
    assert "forgotten" not in path.read_text()
    assert reloaded.check((1, 1), b"another copy", may_record=True)  # recorded afresh


def test_a_peer_id_that_could_break_a_line_is_written_as_a_digest_of_it(tmp_path: Path) -> None:
    book = DigestBook(tmp_path / "digests.tsv")
    book.record((2, 2), A, vouched_by="evil id\n2 3 " + B)
    (peer,) = DigestBook(tmp_path / "digests.tsv").vouched().values()
    assert peer.startswith("h") and " " not in peer and len(peer) <= 64
    assert DigestBook(tmp_path / "digests.tsv").get((2, 3)) is None  # no record smuggled in
