"""Zeroconf on loopback: nodes of one cluster find each other by advertisement and proof, leave
when they stop, ignore other clusters, report a duplicate id — and a generation takes experts from a
node found that way. An advertisement is only a hint: a stranger that advertises in the cluster, a
relay of a member's proof, another name claiming a member's id and hostile TXT values never get a
stranger into the table (nor the secret sent to it), and a flood of names costs no threads."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from fake_nodes import Forger, Relay, member, stranger
from loopback import SERVICE_TYPE
from nodes import serve_command
from repos import KIMI_K3
from waiting import wait_until
from zeroconf import DNSIncoming, DNSOutgoing, DNSPointer, DNSQuestion, ServiceInfo, Zeroconf
from zeroconf.const import _CLASS_IN, _FLAGS_AA, _FLAGS_QR_RESPONSE, _TYPE_PTR

from expertmesh.coordinator.node_pool import NodePool
from expertmesh.devtools.local_hub import HubServer
from expertmesh.node.household.discovery import (
    RESOLVE_WORKERS,
    Advertisement,
    Browser,
    Discovery,
    parse_service,
)
from expertmesh.node.household.membership import PeerTable
from expertmesh.node.hub.local_models import find_pulled
from expertmesh.node.model.expert_index import ExpertIndex
from expertmesh.node.rpc.auth import call_metadata, node_method
from expertmesh.v1 import node_pb2, node_pb2_grpc

LOOPBACK = ["127.0.0.1"]
# cluster names unique to this test run: two runs on one machine (a CI clone beside a checkout)
# must not see each other's nodes on the shared loopback multicast
RUN = f"{os.getpid()}"
CLUSTER, E2E_CLUSTER = f"test-cluster-{RUN}", f"zc-e2e-{RUN}"
SECRET = "discovery-test-secret"
# every in-process test advertises and browses a service type of this run's own (tests/loopback.py):
# the names below are every run's names, and the flood's names never resolve
pytestmark = pytest.mark.usefixtures("own_service_type")


def _discovery(
    node_id: str, cluster: str = CLUSTER, port: int = 1000, compute: bool = True, disk: int = 10**9
) -> Discovery:
    table = PeerTable(self_id=node_id, self_weight=1.0)
    return Discovery(
        table,
        Advertisement(node_id, cluster, "full", port, disk, compute=compute),
        "127.0.0.1",
        LOOPBACK,
        secret=SECRET,
    )


@contextmanager
def _advertised(name: str, port: int, properties: dict):
    """An advertisement of SERVICE_TYPE under `name` on loopback, as anyone on the LAN can make one."""
    zc = Zeroconf(interfaces=LOOPBACK)
    info = ServiceInfo(
        SERVICE_TYPE,
        f"{name}.{SERVICE_TYPE}",
        port=port,
        addresses=[socket.inet_aton("127.0.0.1")],
        properties=properties,
        server=f"{name}.local.",
    )
    zc.register_service(info, cooperating_responders=True)  # no probing first: nobody else takes the name
    try:
        yield
    finally:
        zc.unregister_service(info)
        zc.close()


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _handled_what_came_before(d: Discovery) -> None:
    """Until `d` has handled every advertisement and goodbye sent so far: one more advertisement, of
    its own id under another name, reaches its browser after them (zeroconf delivers in order) and
    is counted as a duplicate; then the resolutions still under way finish. A check that something
    did not happen is made after this, never after a sleep."""
    before = d.duplicates
    with _advertised(f"behind-{d.ad.node_id}", d.ad.port, d.ad.properties()):
        assert wait_until(lambda: d.duplicates > before), "the advertisement behind the others never arrived"
    d.wait_resolved()


def test_nodes_of_a_cluster_find_each_other_and_notice_leaving() -> None:
    # the members' proofs differ from what they advertise: the table believes the proofs
    with (
        member(SECRET, "node-a", disk_budget_bytes=3 * 10**9, compute=True) as node_a,
        contextlib.ExitStack() as node_b_server,
    ):
        node_b = node_b_server.enter_context(member(SECRET, "node-b", disk_budget_bytes=2 * 10**9, compute=False))
        a = _discovery("node-a", port=node_a.port, compute=False, disk=10)
        b = _discovery("node-b", port=node_b.port, compute=True, disk=10)
        other = _discovery("node-x", f"elsewhere-{RUN}", 1002)
        try:
            assert wait_until(lambda: "node-b" in a.table.peers and "node-a" in b.table.peers)
            assert a.table.peers["node-b"].address == node_b.address and a.table.peers["node-b"].weight == 2 * 10**9
            # whether a node computes experts for others comes from its proof
            assert b.table.peers["node-a"].compute and not a.table.peers["node-b"].compute
            assert b.table.peers["node-a"].weight == 3 * 10**9
            _handled_what_came_before(a)  # the other cluster's advertisement among them
            _handled_what_came_before(other)
            assert "node-x" not in a.table.peers and "node-a" not in other.table.peers
            assert a.unproven == 0  # not even asked to prove itself
            b.close()  # node-b leaves as a node does: its goodbye, then its gRPC server stops
            node_b_server.close()
            assert wait_until(lambda: "node-b" not in a.table.peers)
            assert a.forged_goodbyes == 0
        finally:
            for d in (a, other):
                d.close()


def _goodbye(name: str) -> None:
    """An mDNS goodbye (a PTR record with TTL 0) for `name`, as anyone on the LAN can send."""
    sender = Zeroconf(interfaces=LOOPBACK)
    try:
        out = DNSOutgoing(_FLAGS_QR_RESPONSE | _FLAGS_AA)
        out.add_answer_at_time(DNSPointer(SERVICE_TYPE, _TYPE_PTR, _CLASS_IN, 0, name), 0)
        sender.send(out)
    finally:
        sender.close()


def test_a_forged_goodbye_does_not_remove_a_member_that_is_still_there(monkeypatch) -> None:
    import expertmesh.node.household.discovery as discovery

    monkeypatch.setattr(discovery, "GOODBYE_CHECKS_S", (0.1, 0.2, 0.4, 0.8))  # as many checks, sooner
    observer = _discovery("observer")
    try:
        with member(SECRET, "node-a") as node_a:
            a = _discovery("node-a", port=node_a.port)
            try:
                assert wait_until(lambda: "node-a" in observer.table.peers)
                _goodbye(f"node-a.{SERVICE_TYPE}")  # node-a's advertisement goes on, and so does node-a
                assert wait_until(lambda: observer.forged_goodbyes == 1)
                assert observer.table.peers["node-a"].address == node_a.address
            finally:
                a.close()
        assert wait_until(lambda: "node-a" not in observer.table.peers), observer.forged_goodbyes  # its leaving is seen
    finally:
        observer.close()


def test_a_duplicate_node_id_is_reported_not_joined() -> None:
    a = _discovery("same-id")
    try:  # a second advertiser of the same id under another name, as a copied home folder makes
        with _advertised("copied-home", 2000, Advertisement("same-id", CLUSTER, "full", 2000, 1).properties()):
            assert wait_until(lambda: a.duplicates > 0)
            assert "same-id" not in a.table.peers
    finally:
        a.close()


def test_a_duplicate_of_this_nodes_id_is_logged_once_however_often_it_is_announced(caplog) -> None:
    """Anyone on the LAN may advertise this node's id, and re-announce it (a changed TXT record) as
    often as it likes: each announcement is resolved again and counted, but the error is logged
    once per name and address, as every other refusal of an advertisement is."""
    caplog.set_level(logging.WARNING, logger="expertmesh.node.household.discovery")
    a = _discovery("same-id")
    zc = Zeroconf(interfaces=LOOPBACK)

    def copy(disk: int) -> ServiceInfo:
        props = Advertisement("same-id", CLUSTER, "full", 2000, disk).properties()
        address = [socket.inet_aton("127.0.0.1")]
        return ServiceInfo(
            SERVICE_TYPE,
            f"copied.{SERVICE_TYPE}",
            port=2000,
            addresses=address,
            properties=props,
            server="copied.local.",
        )

    try:
        zc.register_service(copy(1), cooperating_responders=True)
        assert wait_until(lambda: a.duplicates > 0)
        for disk in range(2, 7):
            before = a.duplicates
            zc.update_service(copy(disk))
            assert wait_until(lambda before=before: a.duplicates > before)
        logged = [r for r in caplog.records if "advertises this node's id" in r.getMessage()]
        assert a.duplicates >= 6 and len(logged) == 1 and logged[0].levelno == logging.ERROR
    finally:
        zc.close()
        a.close()


@pytest.mark.parametrize("servicer", [None, Forger()], ids=["silent", "forger"])
def test_a_stranger_advertising_in_the_cluster_is_not_joined_and_never_sent_the_secret(servicer) -> None:
    """An advertisement claiming the most disk and compute: the stranger is asked to prove itself
    (with no secret in the call), cannot, and stays out of the table and the API's node pool."""
    observer = _discovery("observer")
    try:
        with stranger(servicer) as (address, recorder):
            claims = Advertisement("stranger", CLUSTER, "full", _port(address), 2**62 - 1, compute=True)
            with _advertised("stranger", _port(address), claims.properties()):
                assert wait_until(recorder.proved), "the stranger was never asked to prove itself"
                assert wait_until(lambda: observer.unproven > 0)
                observer.wait_resolved()
                assert observer.table.all() == []
                assert NodePool.following([], observer.table).addresses() == []
            assert recorder.credentials() == []
    finally:
        observer.close()


@pytest.mark.parametrize("rewrite", [False, True], ids=["as-dialed", "rewritten"])
def test_a_stranger_relaying_a_members_proof_is_not_joined(rewrite: bool) -> None:
    """A stranger advertises a member's id at its own address and passes the Prove it is asked on
    to the member: the member refuses to sign for the stranger's address, or signs for its own
    address, which is not the one the observer dialed."""
    observer = _discovery("observer")
    try:
        with member(SECRET, "node-m") as node_m, stranger(Relay(node_m.address, rewrite)) as (address, recorder):
            claims = Advertisement("node-m", CLUSTER, "full", _port(address), 10**9, compute=True)
            with _advertised("relay", _port(address), claims.properties()):
                assert wait_until(recorder.proved) and wait_until(lambda: observer.unproven > 0)
                observer.wait_resolved()
                assert observer.table.all() == []
            assert recorder.credentials() == []
    finally:
        observer.close()


def test_another_name_can_neither_take_over_nor_remove_a_peer() -> None:
    observer = _discovery("observer")
    try:
        with member(SECRET, "node-a") as node_a, stranger() as (elsewhere, recorder):
            a = _discovery("node-a", port=node_a.port)
            try:
                assert wait_until(lambda: "node-a" in observer.table.peers)
                # another name claims node-a's id: at another address, then at node-a's own address
                # (where the proof would even check): both are ignored
                for name, port in (("hijack", _port(elsewhere)), ("hijack-same", node_a.port)):
                    claims = Advertisement("node-a", CLUSTER, "full", port, 2**62 - 1, compute=True).properties()
                    before = observer.claims
                    with _advertised(name, port, claims):
                        assert wait_until(lambda before=before: observer.claims > before)
                        assert observer.table.peers["node-a"].address == node_a.address
                    _handled_what_came_before(observer)  # the claim's removal among them: it removes nothing
                    assert observer.table.peers["node-a"].address == node_a.address
                assert recorder.calls == []  # nobody even asked the hijacker
            finally:
                a.close()
        assert wait_until(lambda: "node-a" not in observer.table.peers)  # its own leaving does
    finally:
        observer.close()


def test_only_the_owning_name_updates_or_removes_a_peer(monkeypatch) -> None:
    """The bookkeeping alone, every proof made to succeed: a claim by another name changes nothing,
    and a member's own name (`<id>.` + SERVICE_TYPE) takes its id back from a name that got it first."""
    import expertmesh.node.household.discovery as discovery
    from expertmesh.node.household.discovery import Sighting
    from expertmesh.node.household.membership import Peer

    monkeypatch.setattr(discovery, "prove_peer", lambda address, secret, tls_ca=None: Peer("peer-a", address, 5.0))
    d = Discovery(PeerTable("me", 1.0), Advertisement("me", CLUSTER, "full", 1, 1), None, LOOPBACK, secret=SECRET)
    try:
        ad = Advertisement("peer-a", CLUSTER, "full", 7000, 1)
        d._changed(f"first.{SERVICE_TYPE}", Sighting("192.0.2.20", ad))
        d._changed(f"other.{SERVICE_TYPE}", Sighting("192.0.2.66", ad))
        assert d.table.peers["peer-a"].address == "192.0.2.20:7000" and d.claims == 1
        d._changed(f"other.{SERVICE_TYPE}", None)
        assert "peer-a" in d.table.peers
        d._changed(f"peer-a.{SERVICE_TYPE}", Sighting("192.0.2.21", ad))  # its own name
        assert d.table.peers["peer-a"].address == "192.0.2.21:7000"
        d._changed(f"first.{SERVICE_TYPE}", None)
        assert "peer-a" in d.table.peers
        d._changed(f"peer-a.{SERVICE_TYPE}", None)  # and its goodbye removes it once it is gone
        assert wait_until(lambda: "peer-a" not in d.table.peers)
    finally:
        d.close()


def test_hostile_txt_values_are_refused_without_raising() -> None:
    def parsed(**props):
        info = ServiceInfo(
            SERVICE_TYPE,
            f"odd.{SERVICE_TYPE}",
            port=5000,
            addresses=[socket.inet_aton("127.0.0.1")],
            properties={"node_id": "odd", "cluster": CLUSTER, **props},
        )
        return parse_service(info)

    assert parsed().ad.node_id == "odd"
    for digits in ("²", "١٢٣", "9" * 200, "-1", "+7", " 7", "7 "):  # only ASCII digits are numbers
        assert parsed(disk=digits, proto=digits, metrics=digits).ad.disk_budget_bytes == 0
    assert parsed(disk="123").ad.disk_budget_bytes == 123
    for node_id in ("", "x\npeer y joined", "a b", "é", "x" * 65, "a/b"):
        assert parsed(node_id=node_id) is None  # cannot forge a log line
    assert parsed(node_id="A-z_0.9").ad.node_id == "A-z_0.9"
    assert parsed(role="admin") is None and parsed(role="cache").ad.role == "cache"
    assert parsed(node_id=b"\xff\xfe") is None


def test_a_failing_advertisement_does_not_stop_the_resolvers() -> None:
    """Hostile advertisements first (a TXT value that used to raise in parsing, more failing
    callbacks than there are workers): an advertisement after them is still resolved."""
    seen: list[str] = []

    def on_change(name: str, sighting) -> None:
        if sighting is not None and sighting.ad.cluster == CLUSTER:
            seen.append(sighting.ad.node_id)
            if sighting.ad.node_id.startswith("raiser"):
                raise RuntimeError("a callback that fails")

    browser = Browser(on_change, LOOPBACK)
    try:
        bad = {"node_id": "odd", "cluster": CLUSTER, "disk": "²"}
        raisers = [
            Advertisement(f"raiser{i}", CLUSTER, "full", 3000, 1).properties() for i in range(RESOLVE_WORKERS + 1)
        ]
        with _advertised("odd", 3000, bad):
            for i, props in enumerate(raisers):
                with _advertised(f"raiser{i}", 3000, props):
                    assert wait_until(lambda i=i: f"raiser{i}" in seen)
            with _advertised("later", 3001, Advertisement("later", CLUSTER, "full", 3001, 1).properties()):
                assert wait_until(lambda: "later" in seen)
        assert "odd" in seen  # "²" is read as no disk, not as an exception
    finally:
        browser.close()


@contextmanager
def _questions_heard() -> Iterator[list[DNSQuestion]]:
    """Every mDNS question multicast on loopback while the block runs, heard as every mDNS stack
    hears them: a socket on port 5353 in the group 224.0.0.251."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("", 5353))
    sock.setsockopt(
        socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, socket.inet_aton("224.0.0.251") + socket.inet_aton("127.0.0.1")
    )
    sock.settimeout(0.1)
    heard: list[DNSQuestion] = []
    stop = threading.Event()

    def listen() -> None:
        while not stop.is_set():
            try:
                data, _ = sock.recvfrom(9000)
            except TimeoutError:
                continue
            message = DNSIncoming(data)
            if message.is_query():
                heard.extend(message.questions)

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    try:
        yield heard
    finally:
        stop.set()
        listener.join()
        sock.close()


def test_a_browser_asks_for_answers_that_every_socket_on_the_machine_hears() -> None:
    # RFC 6762 section 15.1: a unicast answer (to a QU question) reaches only one of the sockets
    # bound to port 5353 on the asking machine (mDNSResponder's on a Mac, or a `serve` beside
    # `run`); a browse that asked QU first found, under load, a node only after its second question
    name = f"qm-{RUN}"
    seen: list[str] = []
    with _advertised(name, 1003, {"node_id": name, "cluster": CLUSTER}), _questions_heard() as heard:
        browser = Browser(lambda found, sighting: seen.append(found), LOOPBACK)
        try:
            assert wait_until(lambda: any(found.startswith(name) for found in seen))
        finally:
            browser.close()
    ours = [q for q in heard if q.name.lower().endswith(SERVICE_TYPE.lower())]
    assert any(q.type == _TYPE_PTR for q in ours), "the browser's question was not heard"
    assert not [q for q in ours if q.unique], "a question asked for a unicast (QU) answer"


def test_a_flood_of_advertised_names_starts_no_thread_per_name() -> None:
    earlier = {t for t in threading.enumerate() if t.name == "zeroconf-resolve"}  # other browsers'
    browser = Browser(lambda name, sighting: None, LOOPBACK)
    flooder = Zeroconf(interfaces=LOOPBACK)
    peak = 0

    def flooded() -> bool:
        nonlocal peak
        peak = max(peak, sum(t.name == "zeroconf-resolve" and t not in earlier for t in threading.enumerate()))
        return browser.dropped > 0

    try:
        for rounds in range(10):  # again with new names if the browser was not listening yet
            for batch in range(0, 300, 100):  # names that never resolve, 100 to a packet
                out = DNSOutgoing(_FLAGS_QR_RESPONSE | _FLAGS_AA)
                for i in range(batch, batch + 100):
                    name = f"flood{rounds}-{i}.{SERVICE_TYPE}"
                    out.add_answer_at_time(DNSPointer(SERVICE_TYPE, _TYPE_PTR, _CLASS_IN, 4500, name), 0)
                flooder.send(out)
            if wait_until(flooded, timeout_s=2.0, interval_s=0.02):
                break
    finally:
        flooder.close()
        browser.close()
    assert peak <= RESOLVE_WORKERS
    assert getattr(browser, "dropped", 0) > 0  # the flood did arrive: beyond the queue's bound, names were dropped


def _serve(home: Path, hub: HubServer, *extra: str) -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "EXPERTMESH_HOME": str(home), "EXPERTMESH_SECRET": "zc-secret", "HF_ENDPOINT": hub.url}
    proc = subprocess.Popen(
        serve_command(KIMI_K3, E2E_CLUSTER, "--no-prefetch", "--http-port", "0", *extra),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    out = ""
    while "advertising" not in out and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(proc.stderr.read())
        out += line
    return proc, int(re.search(r"on 127\.0\.0\.1:(\d+)", out).group(1))


def _md(method: str):
    """A fresh credential for one call of `method`: a node accepts each credential once."""
    return call_metadata("zc-secret", node_method(method))


def _wait_for_peers(port: int, n: int) -> None:
    """Until the node on `port` knows `n` live peers (advertisements cross in their own time)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = node_pb2_grpc.NodeStub(channel)
        assert wait_until(
            lambda: stub.Info(node_pb2.InfoRequest(), metadata=_md("Info"), timeout=10).live_peers >= n,
            timeout_s=60,
        ), "the nodes did not find each other"


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every node, then each must exit cleanly (and is killed regardless)."""
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            assert proc.wait(timeout=60) == 0
        finally:
            proc.kill()
            proc.stdout.close()
            proc.stderr.close()


@pytest.mark.e2e
def test_a_node_found_by_zeroconf_serves_experts_to_another(
    pulled_home, hub: HubServer, oracle, tmp_path: Path
) -> None:
    for name in ("owner", "client"):
        pulled_home("kimi_k3", tmp_path / name)
    owner, _ = _serve(tmp_path / "owner", hub)
    client, port = _serve(tmp_path / "client", hub, "--disk-budget", "0")  # owns nothing: peers first
    try:
        _wait_for_peers(port, 1)
        prompt = "Found by zeroconf"
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            events = list(
                node_pb2_grpc.NodeStub(channel).Generate(
                    node_pb2.GenerateRequest(model=node_pb2.ModelKey(repo_id=KIMI_K3), prompt=prompt, max_tokens=12),
                    metadata=_md("Generate"),
                    timeout=120,
                )
            )
        tokens = [e.token.id for e in events if e.HasField("token")]
        assert tokens == oracle.tokens("kimi_k3", prompt, 12)
        done = events[-1].done
        assert done.expert_uses["peer"] > 0 and done.expert_uses["hub"] == 0
    finally:
        _stop([client, owner])


@pytest.mark.e2e
def test_a_full_node_and_two_cache_peers_fetch_each_expert_once(
    pulled_home, hub: HubServer, oracle, tmp_path: Path
) -> None:
    """The issue's household: cache peers found by zeroconf alone own the experts between them."""
    repo_id = KIMI_K3
    pulled_home("kimi_k3", tmp_path / "full")
    for name in ("cache-a", "cache-b"):
        pulled_home("kimi_k3", tmp_path / name, index_only=True)
    peers = [_serve(tmp_path / name, hub, "--cache-only", "--disk-budget", "100MB") for name in ("cache-a", "cache-b")]
    full, port = _serve(tmp_path / "full", hub, "--disk-budget", "0")
    procs = [full] + [p for p, _ in peers]
    try:
        _wait_for_peers(port, 2)
        with hub.stats_.lock:
            hub.stats_.reset()  # count only this household's requests
        prompt = "A household of three"
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = node_pb2_grpc.NodeStub(channel)
            events = list(
                stub.Generate(
                    node_pb2.GenerateRequest(model=node_pb2.ModelKey(repo_id=repo_id), prompt=prompt, max_tokens=12),
                    metadata=_md("Generate"),
                    timeout=120,
                )
            )
        tokens = [e.token.id for e in events if e.HasField("token")]
        assert tokens == oracle.tokens("kimi_k3", prompt, 12)
        assert events[-1].done.expert_uses["peer"] > 0 and events[-1].done.expert_uses["hub"] == 0
        assert events[-1].done.expert_uses["remote"] == 0  # cache peers only serve bytes
        held = 0
        for _, peer_port in peers:  # what the two owners keep, between them
            with grpc.insecure_channel(f"127.0.0.1:{peer_port}") as channel:
                stub = node_pb2_grpc.NodeStub(channel)
                info = stub.Info(node_pb2.InfoRequest(), metadata=_md("Info"), timeout=10)
                assert info.role == "cache" and info.mlx_version == "" and not info.compute
                inventory = stub.GetInventory(
                    node_pb2.InventoryRequest(model=info.models[0]), metadata=_md("GetInventory"), timeout=10
                )
                held += sum(bin(b).count("1") for layer in inventory.layers for b in layer.bits)
                with pytest.raises(grpc.RpcError) as e:
                    list(
                        stub.Generate(
                            node_pb2.GenerateRequest(model=info.models[0], prompt="x"),
                            metadata=_md("Generate"),
                            timeout=10,
                        )
                    )
                assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        index = ExpertIndex.load(find_pulled(tmp_path / "full", repo_id) / "expert_index.json")
        expert_bytes = next(iter(index.experts.values())).nbytes  # one size for all: the tiny K3's experts
        env = {**os.environ, "EXPERTMESH_SECRET": "zc-secret", "EXPERTMESH_HOME": str(tmp_path / "cli")}
        listing = subprocess.run(
            [
                sys.executable,
                "-m",
                "expertmesh",
                "peers",
                "--interface",
                "127.0.0.1",
                "--cluster",
                E2E_CLUSTER,
                "--wait",
                "4",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert listing.returncode == 0, listing.stderr
        roles = sorted(ln.split()[2] for ln in listing.stdout.splitlines()[1:])
        assert roles == ["cache", "cache", "full"], listing.stdout  # `expertmesh peers` sees the whole household
        expert_ranges = {
            (f, a, b): n
            for f, entry in hub.stats()["files"].items()
            for a, b, n in entry["ranges"]
            if b - a + 1 == expert_bytes
        }
        assert held > 0 and len(expert_ranges) >= held
        # each expert crossed the Hub once, but the first copy each cache peer sent the full node,
        # which the full node checked against one more from the Hub (node/store/tier_chain.py)
        checked = [r for r, n in expert_ranges.items() if n == 2]
        assert all(n in (1, 2) for n in expert_ranges.values()) and len(checked) == 2, expert_ranges
    finally:
        _stop(procs)


def test_prometheus_targets_given_the_secret_list_only_nodes_that_prove_it(tmp_path: Path) -> None:
    """An advertisement is anyone's to make: with the household secret, `prometheus-targets` lists
    a member (with the id and role it proves) and not a stranger advertising in the cluster."""
    import json

    from expertmesh.node.observability.prometheus_targets import TargetsWatcher

    path = tmp_path / "nodes.json"
    watcher = TargetsWatcher(path, CLUSTER, LOOPBACK, secret=SECRET)
    try:
        with member(SECRET, "node-m", role="cache") as node_m, stranger() as (elsewhere, recorder):
            ads = {
                "node-m": Advertisement("node-m", CLUSTER, "full", node_m.port, 1, metrics_port=9101),
                "posing": Advertisement("posing", CLUSTER, "full", _port(elsewhere), 1, metrics_port=9102),
            }
            with _advertised("node-m", node_m.port, ads["node-m"].properties()):
                with _advertised("posing", _port(elsewhere), ads["posing"].properties()):
                    # both handled: the poser refused (counted), the member listed (written under the same lock)
                    assert wait_until(lambda: watcher.unproven >= 1 and watcher.targets())
                    groups = json.loads(path.read_text())
        assert [g["labels"]["node_id"] for g in groups] == ["node-m"]
        assert groups[0]["labels"]["node_role"] == "cache"  # the proof's role, not the advertisement's
        assert groups[0]["targets"] == ["127.0.0.1:9101"]
        assert recorder.proved() and recorder.credentials() == []  # asked to prove, never sent the secret
    finally:
        watcher.close()


def test_prometheus_targets_warns_when_it_has_no_secret_to_check_nodes_with(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    from expertmesh.cli import main

    monkeypatch.setenv("EXPERTMESH_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("EXPERTMESH_SECRET", raising=False)
    args = ["prometheus-targets", str(tmp_path / "nodes.json"), "--once", "--wait", "0.2", "--cluster", CLUSTER]
    assert main(args) == 0
    assert "unproven" in capsys.readouterr().err
    monkeypatch.setenv("EXPERTMESH_SECRET", SECRET)
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "unproven" not in err and SECRET not in err
