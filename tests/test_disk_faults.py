"""A cache that outlives its disk's troubles: a digest book with a wrong record, a torn tail or a
record appended onto a torn tail, a read-only cache folder and a full file system all leave the
generation equal to the clean one; the book is repaired, and the fault shows as one warning and
in the metrics."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from repos import KIMI_K3

from expertmesh.assembly import open_model
from expertmesh.devtools.local_hub import HubServer
from expertmesh.node.config import StoreConfig
from expertmesh.node.engine.generation import Generator, SamplingSettings
from expertmesh.node.observability.metrics import MetricsSources, NodeMetrics
from expertmesh.node.store.integrity import DIGESTS_FILENAME, DigestBook, format_record, parse_record, sha256

PROMPT = "A cache that outlives its disk"


def _generate(home: Path, **budgets):
    """(tokens, stats, disk, /metrics text) of one generation with a fresh node on `home`."""
    sm = open_model(KIMI_K3, home=home, store=StoreConfig(**budgets, prefetch=False, fill=False))
    try:
        ids = sm.tokenizer.encode(PROMPT)
        tokens = [t.id for t in Generator(sm).generate(ids, SamplingSettings(max_tokens=12))]
        sm.disk.flush()
        metrics = NodeMetrics(MetricsSources(sm.store.stats, sm.store.ram, sm.disk, None, []))
        return tokens, sm.store.stats.snapshot(), sm.disk, generate_latest(metrics.registry).decode()
    finally:
        sm.close()


@pytest.fixture(scope="module")
def reference(module_home: Path) -> list[int]:
    return _generate(module_home)[0]


def _book_lines(disk_root: Path) -> list[str]:
    return (disk_root / DIGESTS_FILENAME).read_text().splitlines()


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_a_wrong_record_is_replaced_by_what_the_hub_agrees_on(home: Path, reference: list[int]) -> None:
    _, _, disk, _ = _generate(home)
    path = disk.root / DIGESTS_FILENAME
    lines = _book_lines(disk.root)
    first = parse_record(lines[0])
    key, good = first.key, first.digest
    # a well-formed record with a wrong digest (as a damaged first fetch would have left it)
    lines[0] = format_record(key, sha256(b"not the expert")).strip()
    path.write_text("\n".join(lines) + "\n")
    tokens, stats, disk, text = _generate(home)
    assert tokens == reference
    assert stats.integrity_failures["disk"] == 1  # the good file on disk was doubted once...
    assert stats.uses["hub"] == 1  # ...fetched twice from the Hub (the second agreed), used once
    assert DigestBook(path).get(key) == good and _metric(text, "expertmesh_digests_replaced_total") == 1
    assert sha256((disk.root / str(key[0]) / f"{key[1]}.bin").read_bytes()) == good
    tokens, stats, _, _ = _generate(home)  # repaired for good: all from disk
    assert tokens == reference and stats.uses["hub"] == 0 and not any(stats.integrity_failures.values())


@pytest.mark.parametrize("damage", ["torn_tail", "appended_after_torn_tail", "cut_inside_layer_number"])
def test_a_torn_book_loses_only_the_torn_record_and_is_compacted(home: Path, reference: list[int], damage: str) -> None:
    _, first, disk, _ = _generate(home)
    path = disk.root / DIGESTS_FILENAME
    lines = _book_lines(disk.root)
    records = [parse_record(line) for line in lines]
    if damage == "torn_tail":  # a full disk cut the last record short
        text = "\n".join(lines[:-1]) + "\n" + lines[-1][:30]
        lost = {records[-1].key}
    elif damage == "appended_after_torn_tail":  # what an older version then appended onto it
        text = "\n".join(lines[:-2]) + "\n" + lines[-2][:-9] + lines[-1] + "\n"
        lost = {records[-2].key, records[-1].key}
    else:  # cut inside the layer number, then a record appended: "1" + "3 4 <digest>" reads as layer 13
        (layer, expert), digest = records[-1].key, records[-1].digest
        text = "\n".join(lines[:-1]) + "\n" + str(layer)[:1] + format_record((3, expert), digest)
        lost = {records[-1].key}
    path.write_text(text)
    tokens, stats, disk, out = _generate(home)
    assert tokens == reference
    assert stats.uses["hub"] == len(lost)  # their files were unverifiable: fetched again, nothing else
    assert _metric(out, "expertmesh_digest_records_skipped_total") >= 1
    book = [parse_record(line) for line in _book_lines(disk.root)]
    assert all(r is not None and not r.old_format for r in book)  # every line whole, in the checked format
    assert len({r.key for r in book}) == len(book) == len(records)  # one record per expert, none lost
    assert {r.key: r.digest for r in book} == {r.key: r.digest for r in records}


@contextlib.contextmanager
def _mounted(kind: str, target: Path):
    """`target` read-only (a bind mount) or a tiny tmpfs; needs root, unmounted whatever happens."""
    if os.geteuid() != 0:
        pytest.skip(f"mounting a {kind} file system needs root (this process is uid {os.geteuid()})")
    target.mkdir(parents=True, exist_ok=True)
    if kind == "read-only":
        cmds = [["mount", "--bind", str(target), str(target)], ["mount", "-o", "remount,ro,bind", str(target)]]
    else:
        cmds = [["mount", "-t", "tmpfs", "-o", "size=24k", "tmpfs", str(target)]]
    mounted = False
    try:
        for cmd in cmds:
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                pytest.skip(f"{' '.join(cmd)} failed here: {done.stderr.strip()}")
            mounted = True
        yield
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(target)], check=False)


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["read-only", "full"])
def test_a_cache_on_a_read_only_or_full_disk_degrades_to_the_other_tiers(
    home: Path, reference: list[int], kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    experts = home / "experts"
    if kind == "read-only":
        _generate(home)  # some experts on disk first: they are still read
    caplog.set_level(logging.WARNING)
    with _mounted(kind, experts):
        tokens, stats, disk, text = _generate(home, disk_budget="1GB")
    assert tokens == reference
    assert disk.refused and _metric(text, "expertmesh_disk_cache_writing") == 0
    refusals = [r for r in caplog.records if "refused a write" in r.getMessage()]
    assert len(refusals) == 1, [r.getMessage() for r in refusals]  # one warning, not one per expert
    assert _metric(text, 'expertmesh_disk_cache_errors_total{kind="refused"}') >= 1
    if kind == "read-only":
        assert stats.uses["disk"] > 0 and stats.uses["hub"] == 0  # what it held still served
    else:
        assert stats.uses["hub"] > 0


def test_a_damaged_first_fetch_is_found_by_verify_and_corrected(
    home: Path, reference: list[int], hub: HubServer, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """Wrong bytes of the right length on an expert's first fetch become its recorded digest;
    `expertmesh verify` asks the Hub again, two fresh copies agree against the record, and the
    record and the file are replaced: the output is the clean one from then on."""
    from expertmesh.cli import main
    from expertmesh.devtools.local_hub import Fault

    hub.knobs.faults = [Fault("wrong_bytes", count=1)]  # the first expert response after the pull
    try:
        damaged, _, disk, text = _generate(home)
    finally:
        hub.knobs.faults = []
    assert hub.stats()["faults"].get("wrong_bytes") == 1 and damaged != reference  # garbage, and kept
    assert _generate(home)[0] == damaged  # the damaged copy matches its own record: it stays
    assert _metric(text, 'expertmesh_disk_expert_bytes{state="verified"}') == 0
    monkeypatch.setenv("EXPERTMESH_HOME", str(home))
    assert main(["verify", KIMI_K3, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "corrected expert" in out and " 0 undecided" in out, out
    tokens, stats, disk, text = _generate(home)
    assert tokens == reference and not any(stats.integrity_failures.values())
    assert _metric(text, 'expertmesh_disk_expert_bytes{state="verified"}') > 0
    assert main(["verify", KIMI_K3, "--no-progress"]) == 0  # what this run fetched: all confirmed
    assert " 0 corrected" in capsys.readouterr().out
