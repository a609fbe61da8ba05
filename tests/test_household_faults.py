"""Faults in the middle of a user's generation: a full node that dies (SIGKILL), hangs (SIGSTOP) or
cuts its stream while the official `openai` client reads an answer through the coordinator; a
cache peer that hangs while it serves every expert; a disk that fills while experts are written.
The standard: a retry or a clear error, never an answer cut short that claims to be whole, the
queue slot freed, the next request on a live node, the tokens of a healthy run, one warning and
nothing half-written on a full disk.

Full nodes here are small real gRPC servers (tests/fake_nodes.py) in processes of their own, so
they can be killed and stopped; they speak the real Generate protocol and stream numbered tokens.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from fake_nodes import fake_node
from lazy_import import lazy_import
from nodes import joined
from repos import KIMI_K3

from expertmesh.assembly import open_model
from expertmesh.coordinator.node_pool import NodePool
from expertmesh.coordinator.openai_api import Coordinator, CoordinatorConfig, OpenAIServer
from expertmesh.devtools.local_hub import HubServer
from expertmesh.node.config import StoreConfig
from expertmesh.node.engine.generation import Generator, SamplingSettings
from expertmesh.node.hub.pull import pull
from expertmesh.node.store.integrity import DIGESTS_FILENAME, parse_record
from expertmesh.v1 import node_pb2, node_pb2_grpc

SECRET = "faults-test-secret"
TESTS = Path(__file__).parent
openai = lazy_import("openai")  # on first use, not at collection (tests/lazy_import.py)

# A full node in a process of its own: one token every `pause` seconds, then GenerationDone.
_FULL_NODE = """
import sys, threading, time
sys.path.insert(0, {tests!r})
from fake_nodes import fake_node
from expertmesh.v1 import node_pb2, node_pb2_grpc

class Slow(node_pb2_grpc.NodeServicer):
    def Generate(self, request, context):
        for i in range(request.max_tokens):
            time.sleep({pause})
            yield node_pb2.GenerateEvent(token=node_pb2.TokenEvent(id=i, text=f"{{i}} ", prompt_tokens=3))
        yield node_pb2.GenerateEvent(done=node_pb2.GenerationDone(prompt_tokens=3, stop_reason="length"))

with fake_node(Slow(), workers=8) as (address, _):
    print(address, flush=True)
    threading.Event().wait()
"""


class _Quick(node_pb2_grpc.NodeServicer):
    """A healthy full node: `max_tokens` numbered tokens at once, then GenerationDone."""

    def __init__(self) -> None:
        self.calls = 0

    def Generate(self, request, context):
        self.calls += 1
        for i in range(request.max_tokens):
            yield node_pb2.GenerateEvent(token=node_pb2.TokenEvent(id=i, text=f"{i} ", prompt_tokens=3))
        yield node_pb2.GenerateEvent(done=node_pb2.GenerationDone(prompt_tokens=3, stop_reason="length"))


class _Cut(node_pb2_grpc.NodeServicer):
    """Three tokens, then a stream that is not a whole answer, in one of several ways."""

    def __init__(self, how: str) -> None:
        self.how = how

    def Generate(self, request, context):
        for i in range(3):
            yield node_pb2.GenerateEvent(token=node_pb2.TokenEvent(id=i, text=f"{i} ", prompt_tokens=3))
        if self.how == "cancelled":
            context.abort(grpc.StatusCode.CANCELLED, "the node is shutting down")
        if self.how == "interrupted":
            yield node_pb2.GenerateEvent(done=node_pb2.GenerationDone(prompt_tokens=3, stop_reason="interrupted"))
        # "ends": an OK status with no GenerationDone at all


def _end(proc: subprocess.Popen) -> None:
    """Kill a test's process, stopped (SIGSTOP) or not, and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGCONT)
    proc.kill()
    proc.wait(timeout=30)


@contextlib.contextmanager
def _node_process(pause_s: float = 0.2) -> Iterator[tuple[subprocess.Popen, str]]:
    """A slow full node in its own process: (the process, its address); killed whatever happens."""
    code = _FULL_NODE.format(tests=str(TESTS), pause=pause_s)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        address = proc.stdout.readline().strip()  # bounded by the test's timeout; empty if it died
        assert address, "the full node process did not start"
        yield proc, address
    finally:
        _end(proc)


def _api(addresses: list[str]) -> OpenAIServer:
    """The API over `addresses`, in that order, with a node watch that asks a quiet node's health soon."""
    config = CoordinatorConfig(secret=SECRET, models=lambda: [KIMI_K3], node_quiet_s=0.5)
    return OpenAIServer(Coordinator(config, NodePool(addresses)), "127.0.0.1", 0).start()


def _client(api: OpenAIServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=60)


def _stream(client: openai.OpenAI, max_tokens: int, after_chunks=None) -> tuple[str, str | None]:
    """(text, finish_reason) of a streamed completion; `after_chunks(n)` is called after each chunk."""
    text, finish, n = "", None, 0
    for chunk in client.completions.create(model=KIMI_K3, prompt="p", max_tokens=max_tokens, stream=True):
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
        n += 1
        if after_chunks is not None:
            after_chunks(n)
    return text, finish


def _expected(n: int) -> str:
    return "".join(f"{i} " for i in range(n))


def _idle(api: OpenAIServer) -> bool:
    """Whether every queue slot and node slot is free again (bounded wait: threads end their calls)."""
    c = api.coordinator
    for _ in range(100):
        if c.queue.depth() == (0, 0) and not any(c.pool.busy().values()):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("how", ["ends", "cancelled", "interrupted"])
def test_a_cut_stream_is_an_error_never_a_finished_answer(how: str) -> None:
    with fake_node(_Cut(how)) as (address, _):
        api = _api([address])
        try:
            client = _client(api)
            with pytest.raises(openai.APIError):  # not a stream that ends with finish_reason "length"/"stop"
                _stream(client, 10)
            with pytest.raises(openai.InternalServerError, match="502"):
                client.completions.create(model=KIMI_K3, prompt="p", max_tokens=10)
            assert _idle(api)
        finally:
            api.stop()


def test_a_cut_before_any_text_moves_to_another_node() -> None:
    class _Empty(node_pb2_grpc.NodeServicer):
        def Generate(self, request, context):
            return iter(())  # OK status, no token, no GenerationDone

    healthy = _Quick()
    with fake_node(_Empty()) as (empty, _), fake_node(healthy) as (good, _):
        api = _api([empty, good])
        try:
            assert _stream(_client(api), 5) == (_expected(5), "length")
            assert healthy.calls == 1
        finally:
            api.stop()


@pytest.mark.e2e
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_full_node_that_dies_mid_stream_gives_an_error_and_the_next_request_a_live_node(sig) -> None:
    healthy = _Quick()
    with _node_process() as (proc, dying), fake_node(healthy) as (good, _):
        api = _api([dying, good])  # the dying node first: the first request goes to it
        try:
            client = _client(api)

            def fault(n: int) -> None:
                if n == 2:
                    os.kill(proc.pid, sig)

            with pytest.raises(openai.APIError, match="mid-generation"):
                _stream(client, 1000, fault)  # an error, not a stream that ends as if complete
            assert healthy.calls == 0
            assert _idle(api)  # the queue slot and the node slot are free again
            assert _stream(client, 5) == (_expected(5), "length")  # the next request: the live node
            assert healthy.calls == 1
        finally:
            api.stop()


@pytest.mark.e2e
def test_a_full_node_that_hangs_before_its_first_token_is_passed_over() -> None:
    healthy = _Quick()
    with _node_process() as (proc, hung), fake_node(healthy) as (good, _):
        api = _api([hung, good])
        try:
            client = _client(api)
            assert _stream(client, 2) == (_expected(2), "length")  # from the first node: connected
            assert healthy.calls == 0
            os.kill(proc.pid, signal.SIGSTOP)  # its connection stays open; it answers nothing
            assert _stream(client, 5) == (_expected(5), "length")  # retried on the live node
            assert healthy.calls == 1 and _idle(api)
        finally:
            api.stop()


# -- a cache peer that hangs mid-generation --------------------------------------------------------

PROMPT = "Ask the household first"


@contextlib.contextmanager
def _cache_peer(home: Path, hub: HubServer, port: int = 0) -> Iterator[tuple[subprocess.Popen, str]]:
    """`expertmesh serve --cache-only` in its own process: (the process, its address)."""
    pull(KIMI_K3, home=home, progress=False, index_only=True)
    env = {**os.environ, "EXPERTMESH_HOME": str(home), "EXPERTMESH_SECRET": SECRET, "HF_ENDPOINT": hub.url}
    cli = [sys.executable, "-m", "expertmesh", "serve", "--cache-only", KIMI_K3, "--host", "127.0.0.1"]
    cli += ["--port", str(port), "--no-discovery", "--no-metrics", "--no-http"]
    proc = subprocess.Popen(cli, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        address = None
        for _ in range(200):  # bounded in lines; the test's timeout bounds the time
            line = proc.stdout.readline()
            assert line, "the cache peer exited before serving"
            m = re.search(r"on (127\.0\.0\.1:\d+)", line)
            if m:
                address = m.group(1)
                break
        assert address is not None, "the cache peer never said where it serves"
        yield proc, address
    finally:
        _end(proc)


@pytest.mark.e2e
@pytest.mark.timeout(150, method="thread")  # a hang guard: the old code waited the fetch deadline set below
def test_a_peer_that_hangs_mid_generation_is_given_up_and_comes_back(
    pulled_home, hub: HubServer, oracle, tmp_path: Path
) -> None:
    """SIGSTOP of the peer that serves every expert, after 4 tokens: its connections stay open and
    it answers nothing. The generation goes on from the Hub with the single-node tokens, long before
    the fetch deadline (an hour here); after SIGCONT its health brings it back."""

    expected = oracle.tokens("kimi_k3", PROMPT, 16)
    with _cache_peer(tmp_path / "peer", hub) as (proc, address):
        pulled_home("kimi_k3", tmp_path / "client")
        # no disk and a 1-byte RAM tier: every use is a fetch, so the sources after the hang show
        store = StoreConfig(prefetch=False, disk_budget="0", ram_budget="1")
        client = joined(KIMI_K3, tmp_path / "client", SECRET, [address], node_id="client", store=store)
        try:
            client.peer_tier.deadline_s = 3600.0  # only noticing the hang can end the wait
            sm = client.model
            gen = Generator(sm).generate(sm.tokenizer.encode(PROMPT), SamplingSettings(max_tokens=16))
            tokens = [next(gen).id for _ in range(4)]
            assert client.store.stats.uses["peer"] > 0 and client.store.stats.uses["hub"] == 0
            os.kill(proc.pid, signal.SIGSTOP)
            at_hang = client.store.stats.snapshot()
            tokens += [t.id for t in gen]
            assert tokens == expected  # the single-node output
            after = client.store.stats.since(at_hang)
            assert after.uses["hub"] > 0 and after.uses["peer"] == 0
            peer = client.peers.all()[0]
            assert not peer.live
            os.kill(proc.pid, signal.SIGCONT)
            client.peer_tier.check_health()  # what the background prober does every HEALTH_EVERY_S
            assert peer.live  # it answers again: back in the table
            before = client.store.stats.snapshot()
            gen = Generator(sm).generate(sm.tokenizer.encode(PROMPT), SamplingSettings(max_tokens=2))
            assert [t.id for t in gen] == expected[:2]
            assert client.store.stats.since(before).uses["peer"] > 0
        finally:
            client.close()


@pytest.mark.e2e
def test_a_killed_peer_is_back_as_soon_as_it_is_restarted(pulled_home, hub: HubServer, oracle, tmp_path: Path) -> None:
    """SIGKILL of the peer that serves every expert, twice while it is down (two misses): the
    generation goes on from the Hub; once it is restarted on its address its health brings it back,
    rather than a skip that doubled with every miss while it was down."""
    expected = oracle.tokens("kimi_k3", PROMPT, 16)
    pulled_home("kimi_k3", tmp_path / "client")
    store = StoreConfig(prefetch=False, disk_budget="0", ram_budget="1")
    with _cache_peer(tmp_path / "peer", hub) as (proc, address):
        client = joined(KIMI_K3, tmp_path / "client", SECRET, [address], node_id="client", store=store)
        sm = client.model
        try:
            gen = Generator(sm).generate(sm.tokenizer.encode(PROMPT), SamplingSettings(max_tokens=16))
            tokens = [next(gen).id for _ in range(4)]
            proc.kill()
            proc.wait(timeout=30)
            tokens += [t.id for t in gen]
            assert tokens == expected
            peer = client.peers.all()[0]
            assert not peer.live and client.peers.errors["unavailable"] >= 1
            peer.skip_until = 0.0  # its first skip ran out while it was still down: the next miss fails too
            assert [
                t.id for t in Generator(sm).generate(sm.tokenizer.encode(PROMPT), SamplingSettings(max_tokens=2))
            ] == expected[:2]
            assert not peer.live
        except BaseException:
            client.close()
            raise
    port = int(address.rsplit(":", 1)[1])
    with _cache_peer(tmp_path / "peer", hub, port) as (proc, again):
        try:
            assert again == address
            client.peer_tier.check_health()  # what the background prober does every HEALTH_EVERY_S
            assert peer.live  # back at once, not after a skip of minutes
            before = client.store.stats.snapshot()
            gen = Generator(sm).generate(sm.tokenizer.encode(PROMPT), SamplingSettings(max_tokens=2))
            assert [t.id for t in gen] == expected[:2]
            assert client.store.stats.since(before).uses["peer"] > 0
        finally:
            client.close()


# -- a disk that fills during a generation ---------------------------------------------------------


@contextlib.contextmanager
def _small_tmpfs(target: Path, size: str):
    """A tmpfs of `size` mounted at `target` (needs root), unmounted whatever happens."""
    if os.geteuid() != 0:
        pytest.skip(f"mounting a tmpfs needs root (this process is uid {os.geteuid()})")
    target.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(target)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs failed here: {done.stderr.decode().strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


def _generate_on(home: Path) -> tuple[list[int], object, object]:
    """(tokens, stats, disk tier) of one generation on `home` with writes flushed."""
    sm = open_model(KIMI_K3, home=home, store=StoreConfig(prefetch=False, fill=False, disk_budget="1GB"))
    try:
        tokens = [t.id for t in Generator(sm).generate(sm.tokenizer.encode(PROMPT), SamplingSettings(max_tokens=12))]
        sm.disk.flush()
        return tokens, sm.store.stats.snapshot(), sm.disk
    finally:
        sm.close()


@pytest.mark.e2e
def test_a_disk_that_fills_mid_generation_warns_once_and_leaves_nothing_half_written(
    pulled_home, hub: HubServer, oracle, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    expected = oracle.tokens("kimi_k3", PROMPT, 12)
    home = pulled_home("kimi_k3", tmp_path / "home")
    with _small_tmpfs(home / "experts", "160k"):  # room for about a third of the experts it uses
        caplog.set_level(logging.WARNING, logger="expertmesh")
        tokens, stats, disk = _generate_on(home)
        assert tokens == expected
        assert disk.refused and len(disk) > 0  # the disk filled part-way, as this test means it to
        ours = [r.getMessage() for r in caplog.records if r.name.startswith("expertmesh")]
        assert len(ours) == 1 and "refused a write" in ours[0], ours  # one warning, not one per part
        lines = (disk.root / DIGESTS_FILENAME).read_bytes().split(b"\n")
        assert lines.pop() == b"" and all(parse_record(x.decode()) for x in lines)  # no half-written record
        book = {r.key: r.digest for r in map(parse_record, (x.decode() for x in lines))}
        assert not list(disk.root.glob("*/*.tmp"))
        files = list(disk.root.glob("*/*.bin"))
        assert files and all(
            hashlib.sha256(f.read_bytes()).hexdigest() == book[(int(f.parent.name), int(f.stem))] for f in files
        )
        caplog.clear()
        tokens, stats, disk = _generate_on(home)  # the next run on the full disk: same tokens, same one warning
        assert tokens == expected and stats.uses["disk"] == len(files) and not any(stats.integrity_failures.values())
        ours = [r.getMessage() for r in caplog.records if r.name.startswith("expertmesh")]
        assert len(ours) == 1 and "refused a write" in ours[0], ours
