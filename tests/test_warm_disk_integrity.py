"""A warm disk is trusted by the fast hash recorded when each expert was written (xxh3_128), not by
sha256 on every read, and it still refuses every bad copy: a byte flipped in the middle of a
multi-MB expert, two files of the same size swapped. A digest book written before fast hashes
existed still works: each expert is checked by its sha256 once, then by the fast hash."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from expertmesh.assembly import open_model
from expertmesh.devtools.local_hub import HubServer
from expertmesh.devtools.tiny import k3_proportions
from expertmesh.node.config import StoreConfig
from expertmesh.node.hub import client as hub_client
from expertmesh.node.hub.pull import pull
from expertmesh.node.store import integrity, tier_chain
from expertmesh.node.store.integrity import DIGESTS_FILENAME, DigestBook, fast_digest, format_record, parse_record
from tests.store_calls import take_layer

REPO_ID = "expertmesh/k3-small-warm"
# SMALL's experts (1.6 MB, K3's layout and packing), fewer of them: the test is about bytes, not routing
P = k3_proportions.Proportions(
    moe_layers=1,
    experts=8,
    top_k=4,
    latent=k3_proportions.SMALL.latent,
    intermediate=k3_proportions.SMALL.intermediate,
    hidden=k3_proportions.SMALL.hidden,
)


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory):
    hub_dir = tmp_path_factory.mktemp("k3-small-hub")
    k3_proportions.build(hub_dir / REPO_ID, 0, P)
    with HubServer(hub_dir) as server:
        yield server


@pytest.fixture(scope="module")
def warm(hub: HubServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A home with every expert on disk and its digests recorded, as the first fetches left it."""
    home = tmp_path_factory.mktemp("k3-small-home")
    with hub_client.using_endpoint(hub.url):
        pull(REPO_ID, home=home, progress=False)
        _, stats = _fetch_all(home)
    assert stats.uses["hub"] == P.moe_layers * P.experts
    return home


@pytest.fixture
def home(warm: Path, tmp_path: Path) -> Path:
    home = tmp_path / "home"
    shutil.copytree(warm, home)
    return home


@pytest.fixture
def sha256_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many sha256s the store takes (by the size hashed)."""
    calls: list[int] = []
    real = integrity.sha256

    def counting(blob):
        calls.append(len(blob))
        return real(blob)

    monkeypatch.setattr(integrity, "sha256", counting)
    monkeypatch.setattr(tier_chain, "sha256", counting)
    return calls


def _fetch_all(home: Path, hub_url: str | None = None):
    """Every expert of every MoE layer through the store, RAM empty; returns the cache folder and the stats."""
    sm = open_model(REPO_ID, home=home, store=StoreConfig(ram_budget="0", prefetch=False, fill=False))
    try:
        for layer in sm.index.moe_layers:
            take_layer(sm.store, layer, list(range(P.experts)))
        sm.store.disk.flush()
        return sm.store.disk.root, sm.store.stats.snapshot()
    finally:
        sm.close()


def _files(root: Path) -> list[Path]:
    return sorted(root.glob("*/*.bin"), key=lambda p: (int(p.parent.name), int(p.stem)))


def _key(path: Path) -> tuple[int, int]:
    return int(path.parent.name), int(path.stem)


def test_warm_reads_are_checked_by_the_fast_hash_not_sha256(home: Path, hub: HubServer, sha256_calls) -> None:
    with hub_client.using_endpoint(hub.url):
        root, stats = _fetch_all(home)
    assert stats.uses["disk"] == P.moe_layers * P.experts and stats.uses["hub"] == 0
    assert sum(stats.integrity_failures.values()) == 0
    assert sha256_calls == []  # no expert read back from disk was hashed with sha256
    book = DigestBook(root / DIGESTS_FILENAME)
    for path in _files(root):
        assert book.fast(_key(path)) == fast_digest(path.read_bytes())  # recorded at first fetch


def test_a_byte_flipped_in_the_middle_of_an_expert_is_caught(home: Path, hub: HubServer, sha256_calls) -> None:
    root = next((home / "experts").glob("*/*"))
    victim = _files(root)[3]
    data = bytearray(victim.read_bytes())
    assert len(data) == P.expert_bytes > 1_000_000
    data[len(data) // 2] ^= 0x01  # one bit, same size
    victim.write_bytes(bytes(data))
    with hub_client.using_endpoint(hub.url):
        root, stats = _fetch_all(home)
    assert stats.integrity_failures["disk"] == 1 and stats.uses["hub"] == 1  # exactly the bad copy fetched again
    assert sha256_calls == [P.expert_bytes]  # the Hub's copy, checked by sha256 (it crossed a network)
    book = DigestBook(root / DIGESTS_FILENAME)
    assert integrity.sha256(victim.read_bytes()) == book.get(_key(victim))  # replaced by a good copy


def test_two_swapped_files_of_the_right_size_are_refused(home: Path, hub: HubServer) -> None:
    root = next((home / "experts").glob("*/*"))
    a, b = _files(root)[1], _files(root)[5]
    tmp = a.with_name("swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)
    with hub_client.using_endpoint(hub.url):
        root, stats = _fetch_all(home)
    assert stats.integrity_failures["disk"] == 2 and stats.uses["hub"] == 2
    book = DigestBook(root / DIGESTS_FILENAME)
    assert all(fast_digest(p.read_bytes()) == book.fast(_key(p)) for p in (a, b))


def test_a_book_without_fast_hashes_still_works_and_learns_them(home: Path, hub: HubServer, sha256_calls) -> None:
    root = next((home / "experts").glob("*/*"))
    book_path = root / DIGESTS_FILENAME
    records = [parse_record(line) for line in book_path.read_text().splitlines()]
    assert all(r is not None and r.fast is not None for r in records)
    book_path.write_text("".join(format_record(r.key, r.digest, r.verified) for r in records))  # the older format
    victim = _files(root)[2]  # and one damaged file, which only the sha256 can catch now
    data = bytearray(victim.read_bytes())
    data[len(data) // 2 + 1] ^= 0x80
    victim.write_bytes(bytes(data))
    with hub_client.using_endpoint(hub.url):
        root, stats = _fetch_all(home)
    n = P.moe_layers * P.experts
    assert stats.uses["disk"] == n - 1 and stats.uses["hub"] == 1 and stats.integrity_failures["disk"] == 1
    assert len(sha256_calls) == n + 1  # each old record's disk copy checked by sha256 once, and the Hub's copy
    book = DigestBook(book_path)
    assert all(book.fast(r.key) is not None for r in records)  # learnt and kept
    sha256_calls.clear()
    with hub_client.using_endpoint(hub.url):
        _, stats = _fetch_all(home)
    assert stats.uses["disk"] == n and sha256_calls == []  # from now on the fast way
