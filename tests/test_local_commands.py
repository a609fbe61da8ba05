"""`expertmesh ls`, `rm`, `cache` and `doctor` on a real home: tiny models pulled from a local Hub and
generated with, so experts are on disk as a user's would be. The CLI runs in-process (`main`)."""

from __future__ import annotations

import io
import os
import shutil
import socket
from pathlib import Path

import pytest
from repos import KIMI_K3, QWEN3_MOE

from expertmesh.assembly import open_model
from expertmesh.cli import main
from expertmesh.devtools.local_hub import HubServer
from expertmesh.node.config import StoreConfig
from expertmesh.node.doctor import plan_model
from expertmesh.node.engine.generation import Generator, SamplingSettings
from expertmesh.node.engine.memory import DeviceMemory
from expertmesh.node.household.discovery import Advertisement, Discovery
from expertmesh.node.household.membership import PeerTable
from expertmesh.node.hub import client as hub_client
from expertmesh.node.hub import local_models
from expertmesh.node.model.expert_index import INDEX_FILENAME, ExpertIndex
from expertmesh.node.sizes import format_size
from expertmesh.node.store.integrity import DIGESTS_FILENAME, DigestBook, sha256
from expertmesh.node.store.tiers.disk import cache_dir

CLUSTER = f"doctor-{os.getpid()}"  # unique: another test run on this machine shares loopback multicast
# the doctor reports every node it sees, of any cluster: only this run's, under its own service type
pytestmark = pytest.mark.usefixtures("own_service_type")


def _generate(home: Path, prompt: str = "The cache keeps what the router asks for") -> list[int]:
    # no guesses and no idle-link fill: only the experts the router asked for land on disk
    sm = open_model(KIMI_K3, home=home, store=StoreConfig(prefetch=False, fill=False))
    try:
        return [t.id for t in Generator(sm).generate(sm.tokenizer.encode(prompt), SamplingSettings(max_tokens=12))]
    finally:
        sm.close()


@pytest.fixture(scope="module")
def used_home(pulled_home, hub: HubServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two models pulled; one generated with, so some of its experts are cached on disk."""
    home = tmp_path_factory.mktemp("used")
    pulled_home("kimi_k3", home)
    pulled_home("qwen3_moe", home)
    _generate(home)
    return home


@pytest.fixture
def home(used_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the used home for one test, as EXPERTMESH_HOME."""
    home = tmp_path / "home"
    shutil.copytree(used_home, home)
    monkeypatch.setenv("EXPERTMESH_HOME", str(home))
    monkeypatch.delenv("EXPERTMESH_SECRET", raising=False)
    return home


def _commit(home: Path, repo_id: str = KIMI_K3) -> str:
    return local_models.find_pulled(home, repo_id).name


def _root(home: Path, repo_id: str = KIMI_K3) -> Path:
    return cache_dir(home, repo_id, _commit(home, repo_id))


def _files(home: Path) -> dict[tuple[int, int], Path]:
    return {(int(p.parent.name), int(p.stem)): p for p in _root(home).glob("*/*.bin")}


class _Terminal(io.StringIO):
    """stdin as a person at a terminal: isatty, with their answer queued."""

    def isatty(self) -> bool:
        return True


# -- ls ---------------------------------------------------------------------------------------


def test_ls_lists_each_pulled_model_with_its_core_and_expert_fill(home: Path, capsys) -> None:
    assert main(["ls"]) == 0
    out = capsys.readouterr().out
    lines = {ln.split()[0]: ln for ln in out.splitlines()[1:-1]}
    assert set(lines) == {KIMI_K3, QWEN3_MOE}, out
    index = ExpertIndex.load(local_models.find_pulled(home, KIMI_K3) / INDEX_FILENAME)
    files = _files(home)
    held = sum(p.stat().st_size for p in files.values())
    marker = local_models.read_marker(local_models.find_pulled(home, KIMI_K3))
    line = lines[KIMI_K3]
    assert " main " in line and _commit(home)[:12] in line
    assert format_size(marker["core_bytes"]) in line
    share = f"{100 * held / index.expert_bytes:.1f}%"
    assert f"{format_size(held)}, {len(files)} of {len(index.experts)} ({share})" in line, line
    assert line.endswith("ago") or line.endswith("just now")
    assert "0 B, 0 of " in lines[QWEN3_MOE] and "(0.0%)" in lines[QWEN3_MOE]
    assert main(["ls", QWEN3_MOE]) == 0
    assert KIMI_K3 not in capsys.readouterr().out


def test_run_stamps_last_used(home: Path, capsys) -> None:
    path = local_models.find_pulled(home, QWEN3_MOE)
    old = path.stat().st_mtime - 3 * 86400
    for f in path.iterdir():
        os.utime(f, (old, old))
    assert main(["ls", QWEN3_MOE]) == 0
    assert capsys.readouterr().out.splitlines()[1].endswith("3 days ago")
    local_models.mark_used(path)  # what run, chat and demo do once the node is built
    assert main(["ls", QWEN3_MOE]) == 0
    assert capsys.readouterr().out.splitlines()[1].endswith("just now")


# -- rm ---------------------------------------------------------------------------------------


def test_rm_refuses_without_a_terminal_or_yes_and_deletes_nothing(home: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))  # a pipe: even a "y" is no consent
    assert main(["rm", KIMI_K3]) == 1
    err = capsys.readouterr().err
    assert "stdin is not a terminal" in err and "--yes" in err and "Traceback" not in err
    assert local_models.find_pulled(home, KIMI_K3).is_dir() and _files(home)


def test_rm_asks_and_a_no_keeps_everything(home: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr("sys.stdin", _Terminal("n\n"))
    assert main(["rm", KIMI_K3]) == 1
    captured = capsys.readouterr()
    assert "[y/N]" in captured.err and "nothing deleted" in captured.out
    assert local_models.find_pulled(home, KIMI_K3).is_dir() and _files(home)


def test_rm_with_a_yes_deletes_the_core_and_the_expert_cache_only(home: Path, capsys, monkeypatch) -> None:
    core, cache = local_models.find_pulled(home, KIMI_K3), _root(home)
    monkeypatch.setattr("sys.stdin", _Terminal("y\n"))
    assert main(["rm", KIMI_K3]) == 0
    out = capsys.readouterr().out
    assert str(core) in out and str(cache) in out and f"removed {KIMI_K3}" in out
    assert not core.exists() and not cache.exists()
    assert not local_models.model_root(home, KIMI_K3).exists()  # refs too
    assert local_models.find_pulled(home, QWEN3_MOE).is_dir()  # the other model stays
    assert main(["ls"]) == 0
    assert KIMI_K3 not in capsys.readouterr().out
    assert main(["rm", KIMI_K3, "--yes"]) == 1
    assert "nothing of" in capsys.readouterr().err


def test_rm_refuses_while_a_node_keeps_the_cache(home: Path, capsys) -> None:
    sm = open_model(KIMI_K3, home=home)  # a running node holds the cache's lock
    try:
        assert main(["rm", KIMI_K3, "--yes"]) == 1
        assert "in use by a running expertmesh process" in capsys.readouterr().err
        assert local_models.find_pulled(home, KIMI_K3).is_dir() and _files(home)
    finally:
        sm.close()
    assert main(["rm", KIMI_K3, "--yes"]) == 0


# -- cache ------------------------------------------------------------------------------------


def test_cache_shows_usage_by_model(home: Path, capsys) -> None:
    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    files = _files(home)
    line = next(ln for ln in out.splitlines() if ln.startswith(KIMI_K3))
    assert line.split()[2] == str(len(files))
    assert format_size(sum(p.stat().st_size for p in files.values())) in line
    assert out.splitlines()[-1].startswith("total ")


def test_cache_verify_finds_and_deletes_a_corrupt_expert(home: Path, capsys) -> None:
    files = _files(home)
    (bad_key, bad), (short_key, short), *good = sorted(files.items())
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte wrong: only the digest can tell
    bad.write_bytes(bytes(data))
    short.write_bytes(short.read_bytes()[:-3])
    times = {k: (p.stat().st_atime_ns, p.stat().st_mtime_ns) for k, p in good}
    assert main(["cache", "--verify"]) == 1
    out = capsys.readouterr().out
    assert f"deleted expert {bad_key[1]} of layer {bad_key[0]}: sha256" in out, out
    assert "1 bad deleted, 1 unverifiable deleted" in out and f"{len(good) + 1} experts checked" in out
    assert not bad.exists() and not short.exists()
    book = DigestBook(_root(home) / DIGESTS_FILENAME)
    for key, path in good:
        assert sha256(path.read_bytes()) == book.get(key)
        assert path.stat().st_mtime_ns == times[key][1]  # checked, not used: its LRU place is kept
    assert main(["cache", "--verify"]) == 0  # nothing bad is left
    assert "0 bad deleted, 0 unverifiable deleted" in capsys.readouterr().out
    assert _generate(home)  # the deleted experts are fetched again when asked for


def test_cache_prune_keeps_the_budget_and_the_digest_book(home: Path, capsys) -> None:
    files = sorted(_files(home).items())
    sizes = {k: p.stat().st_size for k, p in files}
    for n, (_, path) in enumerate(files):  # a known least-recently-used order: files[0] is the oldest
        t = 1_700_000_000 + 60 * n
        os.utime(path, (t, t))
    budget = sum(sizes.values()) * 2 // 5
    assert main(["cache", "--prune", str(budget)]) == 0
    out = capsys.readouterr().out
    assert "least recently used first" in out
    left = _files(home)
    assert sum(p.stat().st_size for p in left.values()) <= budget
    kept = [k for k, _ in files if k in left]
    assert kept == [k for k, _ in files][len(files) - len(kept) :]  # the newest kept, the oldest gone
    assert sum(sizes[k] for k in kept) + sizes[files[-len(kept) - 1][0]] > budget  # no more deleted than needed
    book = DigestBook(_root(home) / DIGESTS_FILENAME)
    for key, path in left.items():  # every file left has its record, and it matches
        assert sha256(path.read_bytes()) == book.get(key)
    assert not list(_root(home).glob("*/*.tmp"))
    assert main(["cache", "--prune", "0%"]) == 0  # a share of what is held now
    assert not _files(home)
    capsys.readouterr()
    assert main(["cache", "--verify"]) == 0  # records of deleted files are harmless


def test_cache_prune_refuses_while_a_node_keeps_the_cache(home: Path, capsys) -> None:
    before = set(_files(home))
    sm = open_model(KIMI_K3, home=home)
    try:
        assert main(["cache", "--prune", "0"]) == 1
        assert "kept by another expertmesh process" in capsys.readouterr().err
        assert main(["cache", "--verify"]) == 1
    finally:
        sm.close()
    assert set(_files(home)) == before
    assert main(["cache", "--prune", "1kB"]) == 0


def test_cache_rejects_a_bad_size(home: Path, capsys) -> None:
    assert main(["cache", "--prune", "lots"]) == 1
    assert "--prune" in capsys.readouterr().err


# -- doctor -----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _doctor(*extra: str) -> list[str]:
    ports = ["--host", "127.0.0.1", "--port", str(_free_port()), "--http-port", str(_free_port())]
    where = ["--interface", "127.0.0.1", "--cluster", CLUSTER, "--wait", "1"]
    return ["doctor", *ports, *where, *extra]


def _lines(out: str) -> dict[str, str]:
    """check name -> its line; every line but the summary is one check."""
    *checks, summary = out.strip().splitlines()
    assert all(ln.split()[0] in ("ok", "warn", "fail") for ln in checks), out
    assert summary.endswith("fail")
    return {" ".join(ln.split()[1:3]) if ln.split()[1] == "port" else ln.split()[1]: ln for ln in checks}


def test_doctor_on_a_ready_home_exits_zero(home: Path, hub: HubServer, capsys, monkeypatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_not-a-real-token-but-secret")
    assert main(_doctor()) == 0
    out = capsys.readouterr().out
    lines = _lines(out)
    expected = {"metal", "memory", "disk", "port gRPC", "port API", "port metrics", "hub", "token", "models", "quota"}
    assert expected | {"clock", "household", "secret"} == set(lines), out
    assert lines["hub"].startswith("ok") and hub.url in lines["hub"]
    assert lines["models"].startswith("ok") and "(2)" in lines["models"]
    assert lines["quota"].startswith("ok") and "announces no rate limits" in lines["quota"]
    assert lines["clock"].startswith("ok") and lines["memory"].startswith("ok")
    assert lines["token"].startswith("ok") and "HF_TOKEN" in lines["token"]
    assert "not-a-real-token" not in out  # where the token came from, never the token
    assert lines["household"].startswith("ok") and "runs alone" in lines["household"]
    assert "fail" not in out.replace(" 0 fail", "")


def test_doctor_fails_on_a_taken_port_and_an_unreachable_hub(home: Path, hub: HubServer, capsys) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        argv = _doctor()
        argv[argv.index("--port") + 1] = str(taken.getsockname()[1])
        assert main(argv) == 1
    line = _lines(capsys.readouterr().out)["port gRPC"]
    assert line.startswith("fail") and "taken by another program" in line and "fix: " in line and "--port" in line
    with hub_client.using_endpoint(f"http://127.0.0.1:{_free_port()}"):
        assert main(_doctor()) == 1
    lines = _lines(capsys.readouterr().out)
    assert lines["hub"].startswith("fail") and "cannot reach" in lines["hub"]
    assert lines["clock"].startswith("warn")


def test_doctor_warns_of_a_streamed_core_and_fails_one_that_cannot_stream(
    home: Path, hub: HubServer, capsys, monkeypatch
) -> None:
    big = max((m for m in local_models.pulled_models(home) if m.state == "complete"), key=lambda m: m.core_bytes)
    plan = plan_model(home, big.repo_id).planner.plan()  # this machine: the core fits whole
    assert plan.fits
    fixed = plan.context_bytes + plan.prefix_cache_bytes + plan.prompt_bytes + plan.buffer_bytes  # before the core
    for room, status, words in ((plan.core_bytes // 2, "warn", "streamed"), (1000, "fail", "even streamed")):
        machine = DeviceMemory(10 * (fixed + room), fixed + room)
        monkeypatch.setattr("expertmesh.node.engine.memory.device_memory", lambda m=machine: m)
        assert main(_doctor("--no-discovery")) == (1 if status == "fail" else 0)
        line = _lines(capsys.readouterr().out)["memory"]
        assert line.startswith(status) and big.repo_id in line and words in line, line
    assert "to hold the core whole" in line and "--max-context" in line  # the change that makes it fit


def test_doctor_sees_the_household(home: Path, hub: HubServer, capsys, monkeypatch) -> None:
    monkeypatch.setenv("EXPERTMESH_SECRET", "a-household-secret")
    ad = Advertisement("doctor-peer", CLUSTER, "full", 7999, 10**9, compute=True)
    other = Advertisement("elsewhere", CLUSTER + "-other", "cache", 7998, 10**9)
    nodes = [Discovery(PeerTable(a.node_id, 1.0), a, "127.0.0.1", ["127.0.0.1"]) for a in (ad, other)]
    try:
        assert main(_doctor("--wait", "3")) == 0
        line = _lines(capsys.readouterr().out)["household"]
        assert line.startswith("ok") and "1 node(s)" in line and "doctor-peer at 127.0.0.1:7999" in line
        assert main([*_doctor(), "--cluster", CLUSTER + "-none"]) == 0  # nothing to find there: the short listen
        line = _lines(capsys.readouterr().out)["household"]
        assert line.startswith("warn") and "fix: " in line
    finally:
        for d in nodes:
            d.close()
    assert "a-household-secret" not in capsys.readouterr().out
