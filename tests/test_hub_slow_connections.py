"""A Hub behind a proxy that drips bytes: a connection slower than the floor is given up and the
fetch goes on over another; when every connection drips, a fetch ends in one clear error after a
bounded number of attempts or at its deadline, the experts of a failed run are not asked for again
one by one, and nothing partial is cached.

The proxy is a real TCP relay on loopback; the speed window and deadline are scaled down so each
test takes seconds (the floor is the default one, 64 kB/s, and the drip is 1/20 of it)."""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from repos import KIMI_K3

from expertmesh.assembly import open_model
from expertmesh.devtools.local_hub import HubServer
from expertmesh.node.config import StoreConfig
from expertmesh.node.errors import DownloadError
from expertmesh.node.hub import client as hub_client
from expertmesh.node.model.expert_index import run_ranges
from expertmesh.node.store.tier_chain import Fetched
from expertmesh.node.store.tiers.hub import split_ranges

WINDOW_S = 0.3  # the speed window of these tests (the default is 10 s)
DRIP_STEP, DRIP_INTERVAL_S = 64, 0.02  # 3.2 kB/s: 1/20 of the floor
FAST = dict(speed_window_s=WINDOW_S, timeout_s=5.0, backoff_base_s=0.005, backoff_max_s=0.05)
TEST_TIMEOUT_S = 120.0  # only so that a hang fails the test instead of holding the suite


class DripProxy:
    """A TCP relay in front of the Hub. Connection `i` (numbered from 0 as accepted) drips while
    `drips(i)` says so: every byte towards the client, headers too, goes `DRIP_STEP` at a time with
    `DRIP_INTERVAL_S` between, as from a degraded CDN edge."""

    def __init__(self, upstream_port: int, drips: Callable[[int], bool]):
        self.upstream_port = upstream_port
        self.drips = drips
        self.connections = 0
        self.given_up = 0  # dripping connections the client closed itself
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        threading.Thread(target=self._accept, name="drip-proxy", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            with self._lock:
                i, self.connections = self.connections, self.connections + 1
                self._sockets += [client, upstream]
            threading.Thread(target=self._to_upstream, args=(client, upstream, i), daemon=True).start()
            threading.Thread(target=self._to_client, args=(upstream, client, i), daemon=True).start()

    def _to_upstream(self, client: socket.socket, upstream: socket.socket, i: int) -> None:
        try:
            while data := client.recv(65536):
                upstream.sendall(data)
            if self.drips(i):  # the client hung up on a dripping connection
                with self._lock:
                    self.given_up += 1
        except OSError:
            pass
        finally:
            _close(client, upstream)

    def _to_client(self, upstream: socket.socket, client: socket.socket, i: int) -> None:
        try:
            while data := upstream.recv(65536):
                if not self.drips(i):
                    client.sendall(data)
                    continue
                for k in range(0, len(data), DRIP_STEP):
                    client.sendall(data[k : k + DRIP_STEP])
                    time.sleep(DRIP_INTERVAL_S)
        except OSError:
            pass
        finally:
            _close(client, upstream)

    def close(self) -> None:
        self._server.close()
        with self._lock:
            _close(*self._sockets)


def _close(*socks: socket.socket) -> None:
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()


@pytest.fixture
def proxied(hub_root: Path) -> Iterator[tuple[HubServer, DripProxy]]:
    """A Hub whose CDN is reachable only through a new proxy (which drips nothing until a test says
    so): the signed locations the Hub hands out point at the proxy."""
    with HubServer(hub_root) as hub:
        proxy = DripProxy(hub.cdn_port, lambda i: False)
        hub.cdn_url_base = proxy.url  # the CDN's public address
        try:
            with hub_client.using_endpoint(hub.url):
                yield hub, proxy
        finally:
            proxy.close()


def _open(home: Path, reader: hub_client.RangeReader):
    # pieces of 16 kB: a layer's run (104 kB) goes as 4 pieces on separate connections
    store = StoreConfig(prefetch=False, fill=False, hub_min_piece_bytes=16 * 1024)
    return open_model(KIMI_K3, home=home, store=store, hub_reader=reader)


def _layer_run(sm) -> list[tuple[int, int]]:
    """Every expert of the first MoE layer: back to back in their shard, fetched as one run."""
    layer = min(k[0] for k in sm.index.experts)
    keys = sorted(k for k in sm.index.experts if k[0] == layer)
    assert run_ranges([sm.index.expert(*k) for k in keys]) is not None
    return keys


def _pieces(sm, keys: list[tuple[int, int]]) -> list:
    source = sm.store.chain.runs
    pieces = split_ranges(
        run_ranges([sm.index.expert(*k) for k in keys]), source.pieces_per_expert, source.min_piece_bytes
    )
    # each piece outlasts two speed windows at the drip's rate: no dripping answer can complete
    assert len(pieces) > 1 and min(p.nbytes for p in pieces) > 2 * DRIP_STEP / DRIP_INTERVAL_S * WINDOW_S
    return pieces


def _one_error(keys: list[tuple[int, int]], results: list) -> str:
    """The run's error, which every expert of it reports as the same exception: none was asked
    for again on its own."""
    assert all(isinstance(r, DownloadError) for r in results), results
    assert len({id(r) for r in results}) == 1, results
    return str(results[0])


def _upstream_bytes(repo: Path, sm, key: tuple[int, int]) -> bytes:
    data = b""
    for r in sm.index.expert(*key).ranges:
        with open(repo / r.file, "rb") as fh:
            fh.seek(r.start)
            data += fh.read(r.nbytes)
    return data


def _assert_nothing_cached(sm, keys: list[tuple[int, int]]) -> None:
    assert not any(k in sm.disk for k in keys)
    assert not list(sm.disk.root.rglob("*.tmp")) and not list(sm.disk.root.rglob("*.bin"))


def _in_thread(fn: Callable, timeout_s: float = TEST_TIMEOUT_S):
    """`fn()`, but a hang fails the test (after a generous time) instead of holding the suite."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result(timeout=timeout_s)


def test_a_dripping_connection_is_given_up_and_the_fetch_finishes_on_another(
    proxied, home: Path, tiny_repos: dict[str, Path]
) -> None:
    hub, proxy = proxied
    reader = hub_client.RangeReader(**FAST)
    sm = _open(home, reader)
    try:
        keys = _layer_run(sm)
        _pieces(sm, keys)
        first = proxy.connections  # from here on, every third new connection drips, the first one too
        proxy.drips = lambda i: i >= first and (i - first) % 3 == 0
        results = _in_thread(lambda: sm.store.chain.fetch_run(keys, keep_now=True, decode=False))
        single = (keys[0][0] + 1, 0)  # and an expert on its own, from another layer
        results.append(_in_thread(lambda: sm.store.chain.fetch(single, keep_now=True, decode=False)))
        assert all(isinstance(r, Fetched) and r.source == "hub" for r in results), results
        for key, r in zip([*keys, single], results):
            assert bytes(r.blob) == _upstream_bytes(tiny_repos["kimi_k3"], sm, key)
            assert key in sm.disk
        assert reader.slow_responses >= 1  # a dripping answer was given up ...
        assert reader.retries >= reader.slow_responses  # ... each one retried ...
        assert proxy.given_up >= 1  # ... by closing its connection, and asking on another
    finally:
        sm.close()


def test_when_every_connection_drips_a_run_fails_once_after_its_attempts(proxied, home: Path) -> None:
    hub, proxy = proxied
    reader = hub_client.RangeReader(max_retries=2, fetch_deadline_s=TEST_TIMEOUT_S, **FAST)
    sm = _open(home, reader)
    try:
        keys = _layer_run(sm)
        pieces = _pieces(sm, keys)
        proxy.drips = lambda i: True
        results = _in_thread(lambda: sm.store.chain.fetch_run(keys, keep_now=True, decode=False))
        error = _one_error(keys, results)
        assert error.startswith(f"experts {keys[0][1]}-{keys[-1][1]} of layer {keys[0][0]} from the Hub at {hub.url}: ")
        assert "failed 3 times" in error and "below the floor of 64 kB/s" in error, error
        assert reader.retries == 2 * len(pieces)  # each piece's 3 attempts, and not one more
        assert reader.slow_responses >= len(pieces) and proxy.given_up >= len(pieces)
        _assert_nothing_cached(sm, keys)
    finally:
        sm.close()


def test_when_every_connection_drips_a_fetch_ends_at_its_deadline(proxied, home: Path) -> None:
    hub, proxy = proxied
    deadline_s = 1.5
    reader = hub_client.RangeReader(max_retries=10_000, fetch_deadline_s=deadline_s, **FAST)
    sm = _open(home, reader)
    try:
        keys = _layer_run(sm)
        pieces = _pieces(sm, keys)
        proxy.drips = lambda i: True
        assert (
            reader.fetch_bound_s() == deadline_s + WINDOW_S
        )  # the documented bound of a stall: the budget and one read
        generous = 10 * reader.fetch_bound_s()  # only so that a hang fails; the error and attempts are the test
        results = _in_thread(lambda: sm.store.chain.fetch_run(keys, keep_now=True, decode=False), generous)
        error = _one_error(keys, results)  # the run's deadline held for its experts too
        m = re.search(rf"no complete answer within {deadline_s:g} s \((\d+) attempts\), last: ", error)
        assert m, error
        assert 2 <= int(m.group(1)) < 10_000  # the budget ended it, not the retry count, after several connections
        assert reader.retries >= len(pieces) and reader.slow_responses >= len(pieces)
        assert "HF_TOKEN" not in error and "Bearer" not in error and "_cdn" not in error  # no secret, no signed URL
        _assert_nothing_cached(sm, keys)

        # an expert alone, later: a budget of its own, and again one error; a budget shorter than
        # the drip takes for its bytes, since each attempt goes on from the bytes the one before had
        retries, reader.fetch_deadline_s = reader.retries, deadline_s / 3
        with pytest.raises(DownloadError, match=rf"expert {keys[0][1]} of layer .* within {deadline_s / 3:g} s") as e:
            _in_thread(lambda: sm.store.chain.fetch(keys[0], keep_now=True, decode=False), generous)
        assert "not asked for again alone" not in str(e.value)
        assert reader.retries > retries
        _assert_nothing_cached(sm, keys)
    finally:
        sm.close()
