"""The store never uses a bad copy of an expert: altered, truncated or unverifiable files on disk are
dropped and fetched again, and the output stays the same as with clean caches."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from repos import KIMI_K3

from expertmesh.assembly import open_model
from expertmesh.node.config import StoreConfig
from expertmesh.node.engine.generation import Generator, SamplingSettings
from expertmesh.node.store.integrity import DIGESTS_FILENAME, DigestBook, sha256

PROMPT = "The store keeps every expert"


def _generate(home: Path, **budgets):
    # no guesses and no idle-link fill: every count below is then exact (either would add fetches)
    sm = open_model(KIMI_K3, home=home, store=StoreConfig(**budgets, prefetch=False, fill=False))
    try:
        ids = sm.tokenizer.encode(PROMPT)
        tokens = [t.id for t in Generator(sm).generate(ids, SamplingSettings(max_tokens=16))]
        return tokens, sm.store.stats.snapshot(), sm.disk
    finally:
        sm.close()


@pytest.fixture(scope="module")
def reference(module_home: Path) -> list[int]:
    return _generate(module_home)[0]


def _cached_files(disk_root: Path) -> list[Path]:
    return sorted(disk_root.glob("*/*.bin"))


def test_an_altered_file_on_disk_is_caught_and_fetched_again(home: Path, reference: list[int]) -> None:
    tokens, first, disk = _generate(home)
    assert tokens == reference and first.uses["hub"] > 0
    victims = _cached_files(disk.root)[:3]
    for path in victims:  # flip one byte in the middle: same size, wrong bytes
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    tokens, stats, disk = _generate(home)
    assert tokens == reference
    assert stats.integrity_failures["disk"] == len(victims)
    assert stats.uses["hub"] == len(victims)  # exactly the bad copies were fetched again
    book = DigestBook(disk.root / DIGESTS_FILENAME)
    for path in victims:  # and replaced by good ones
        assert sha256(path.read_bytes()) == book.get((int(path.parent.name), int(path.stem)))


def test_truncated_and_stray_files_are_removed_at_start(home: Path, reference: list[int]) -> None:
    _, _, disk = _generate(home)
    files = _cached_files(disk.root)
    truncated = files[0]
    truncated.write_bytes(truncated.read_bytes()[:-7])
    (disk.root / "1" / "3.bin.123.456.tmp").write_bytes(b"debris of a killed write")
    tokens, stats, disk = _generate(home)
    assert tokens == reference
    assert not list(disk.root.glob("*/*.tmp"))
    assert stats.uses["hub"] == 1 and stats.integrity_failures["disk"] == 0  # dropped before any read
    assert truncated.stat().st_size == disk.index.expert(int(truncated.parent.name), int(truncated.stem)).nbytes


def test_files_without_a_recorded_digest_are_not_trusted(home: Path, reference: list[int]) -> None:
    _, first, disk = _generate(home)
    cached = len(_cached_files(disk.root))
    lines = (disk.root / DIGESTS_FILENAME).read_text().splitlines()
    # as after a crash between the digest's write and the file's: the last line torn, one missing
    (disk.root / DIGESTS_FILENAME).write_text("\n".join(lines[1:-1]) + "\n" + lines[-1][:20])
    tokens, stats, disk = _generate(home)
    assert tokens == reference
    assert stats.uses["hub"] == 2 and stats.uses["disk"] == first.uses["hub"] - 2 + first.uses["disk"]
    assert len(_cached_files(disk.root)) == cached


def test_a_disk_budget_of_a_few_experts_is_kept(home: Path, reference: list[int]) -> None:
    _, _, disk = _generate(home)
    expert_bytes = next(iter(disk.index.experts.values())).nbytes
    budget = 5 * expert_bytes
    shutil.rmtree(disk.root)
    tokens, stats, disk = _generate(home, disk_budget=str(budget), ram_budget="1")
    assert tokens == reference
    assert disk.nbytes <= budget and sum(p.stat().st_size for p in _cached_files(disk.root)) <= budget
    assert disk.evictions > 0 and stats.uses["hub"] > 0
