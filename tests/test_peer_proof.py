"""Prove between real nodes on loopback: a member proves it knows the household secret (with its
own attributes) before anyone sends it the secret; a wrong secret, a forged answer and a relay
of a member's answer are refused; Prove itself tells a stranger nothing else."""

from __future__ import annotations

import secrets
from pathlib import Path

import grpc
import pytest
from fake_nodes import Forger, Relay, stranger
from nodes import serving
from repos import QWEN3_MOE

from expertmesh.devtools.local_hub import HubServer
from expertmesh.node import constants
from expertmesh.node.config import StoreConfig
from expertmesh.node.errors import ExpertmeshError
from expertmesh.node.household.membership import prove_peer
from expertmesh.node.rpc.client import NodeClient, ask_info
from expertmesh.node.rpc.proof import Identity, ProofError, check_proof, prove_key, sign
from expertmesh.v1 import node_pb2, node_pb2_grpc

SECRET = "proof-test-secret"


@pytest.fixture(scope="module")
def member(pulled_home, hub: HubServer, tmp_path_factory: pytest.TempPathFactory):
    """A real cache node (index only, no model): its address and its Info."""
    home = tmp_path_factory.mktemp("proof-member")
    pulled_home("qwen3_moe", home, index_only=True)
    node = serving(QWEN3_MOE, home, SECRET, node_id="member", cache_only=True, store=StoreConfig(disk_budget="100MB"))
    try:
        with NodeClient(node.rpc.address, SECRET) as client:
            yield node.rpc.address, client.info()
    finally:
        node.close()


def _stub(address: str):
    channel = grpc.insecure_channel(address)
    return channel, node_pb2_grpc.NodeStub(channel)


def test_a_member_proves_itself_with_its_own_attributes(member) -> None:
    address, info = member
    peer = prove_peer(address, SECRET)
    assert (peer.node_id, peer.address, peer.role, peer.compute) == ("member", address, "cache", False)
    assert peer.weight == info.disk_budget_bytes > 0


def test_another_secret_does_not_check(member) -> None:
    address, _ = member
    with pytest.raises(ProofError) as e:
        prove_peer(address, "not-the-household-secret")
    assert "not-the-household-secret" not in str(e.value) and SECRET not in str(e.value)


def test_prove_is_open_to_all_and_tells_nothing_else(member) -> None:
    address, _ = member
    port = int(address.rsplit(":", 1)[1])
    channel, stub = _stub(address)
    with channel:
        nonce = secrets.token_bytes(32)
        answer = stub.Prove(node_pb2.ProveRequest(nonce=nonce, dialed=address), timeout=5)  # no secret sent
        assert {f.name for f, _ in answer.ListFields()} <= {
            "node_id",
            "role",
            "disk_budget_bytes",
            "compute",
            "protocol_version",
            "mac",
        }
        assert check_proof(SECRET, nonce, address, answer).node_id == "member"
        with pytest.raises(grpc.RpcError) as e:
            stub.Info(node_pb2.InfoRequest(), timeout=5)  # every other call still needs the secret
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        refusals = [
            (node_pb2.ProveRequest(nonce=nonce[:31], dialed=address), grpc.StatusCode.INVALID_ARGUMENT),
            (node_pb2.ProveRequest(nonce=nonce, dialed=f"127.0.0.1:{port + 1}"), grpc.StatusCode.PERMISSION_DENIED),
            (node_pb2.ProveRequest(nonce=nonce, dialed=f"192.0.2.77:{port}"), grpc.StatusCode.PERMISSION_DENIED),
            (node_pb2.ProveRequest(nonce=nonce, dialed="no port"), grpc.StatusCode.PERMISSION_DENIED),
        ]
        for request, code in refusals:
            with pytest.raises(grpc.RpcError) as e:
                stub.Prove(request, timeout=5)
            assert e.value.code() == code, request


@pytest.mark.parametrize("rewrite", [False, True], ids=["as-dialed", "rewritten"])
def test_a_stranger_relaying_a_members_proof_is_refused(member, rewrite: bool) -> None:
    address, _ = member
    with stranger(Relay(address, rewrite=rewrite)) as (relay, recorder):
        # as dialed: the member refuses to sign for the relay's address; rewritten to the member's
        # own address: the member signs, but not for the address the caller dialed
        with pytest.raises(ProofError if rewrite else grpc.RpcError) as e:
            prove_peer(relay, SECRET)
        if not rewrite:
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert recorder.proved() and recorder.credentials() == []


def test_a_static_peer_that_cannot_prove_itself_gets_no_secret(pulled_home, hub: HubServer, tmp_path: Path) -> None:
    """A --peer address is proven too: a node that forges its answer is never sent the secret."""
    pulled_home("qwen3_moe", tmp_path, index_only=True)
    with stranger(Forger()) as (address, recorder):
        with pytest.raises(ExpertmeshError):
            serving(QWEN3_MOE, tmp_path, SECRET, node_id="joiner", cache_only=True, peers=[address])
        assert recorder.proved() and recorder.credentials() == []


@pytest.mark.parametrize("node_id", ["two words", "x" * 65, "line\nbreak", "ünïcode"])
def test_a_node_id_no_peer_would_accept_is_refused_at_start(
    pulled_home, hub: HubServer, tmp_path: Path, node_id: str
) -> None:
    """Peers refuse such an id in every proof (it could forge log lines): say so at start, not by
    a household that silently never forms."""
    pulled_home("qwen3_moe", tmp_path, index_only=True)
    with pytest.raises(ExpertmeshError, match="cannot join a household"):
        serving(QWEN3_MOE, tmp_path, SECRET, node_id=node_id, cache_only=True)


def test_the_cli_asks_info_only_of_nodes_that_prove_themselves(member) -> None:
    """`peers`, `status`, `warm` and `run` ask zeroconf's addresses for Info through ask_info: a
    stranger there is reported as refusing the secret, and never sent it."""
    address, _ = member
    with stranger(Forger()) as (forger, recorder):
        answers = {a.address: a for a in ask_info([address, forger], SECRET)}
        assert answers[address].info.node_id == "member"
        assert answers[forger].info is None and answers[forger].error == "unauthenticated"
        assert recorder.proved() and recorder.credentials() == []


def test_a_proof_binds_every_field() -> None:
    identity = Identity("node-a", "full", 10**9, True, constants.PROTOCOL_VERSION)
    nonce, dialed = bytes(range(32)), "127.0.0.1:7000"
    mac = sign(prove_key(SECRET), nonce, dialed, identity)

    def answer(**changes) -> node_pb2.ProveResponse:
        fields = {**identity.__dict__, **changes}
        return node_pb2.ProveResponse(mac=mac, **fields)

    assert check_proof(SECRET, nonce, dialed, answer()) == identity
    for changed in (
        {"node_id": "node-b"},
        {"role": "cache"},
        {"disk_budget_bytes": 2 * 10**9},
        {"compute": False},
        {"protocol_version": constants.PROTOCOL_VERSION + 1},
    ):
        with pytest.raises(ProofError):
            check_proof(SECRET, nonce, dialed, answer(**changed))
    with pytest.raises(ProofError):
        check_proof(SECRET, nonce, "127.0.0.1:7001", answer())
    with pytest.raises(ProofError):
        check_proof(SECRET, bytes(32), dialed, answer())
    forged = Identity("bad\nid", "full", 1, False, 1)  # signed with the secret, still not a usable id
    with pytest.raises(ProofError):
        check_proof(
            SECRET,
            nonce,
            dialed,
            node_pb2.ProveResponse(mac=sign(prove_key(SECRET), nonce, dialed, forged), **forged.__dict__),
        )
