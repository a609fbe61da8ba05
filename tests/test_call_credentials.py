"""The household secret never crosses the network: every call carries a fresh credential made
with it (node/rpc/auth.py), which a node checks, and which is worthless after its time window."""

from __future__ import annotations

import time

import grpc
import pytest

from expertmesh.node.rpc import auth
from expertmesh.node.rpc.auth import AUTH_METADATA_KEY, CALL_CREDENTIAL_WINDOW_S, call_metadata
from expertmesh.node.rpc.client import NodeClient
from expertmesh.node.rpc.server import NodeServer
from expertmesh.v1 import node_pb2, node_pb2_grpc

SECRET = "credentials-test-secret"


class _Node(node_pb2_grpc.NodeServicer):
    def Info(self, request, context):
        return node_pb2.InfoResponse(node_id="node-c", role="full")


@pytest.fixture(scope="module")
def node():
    """A node service behind the household secret, as `serve` runs it (rpc/server.py)."""
    server = NodeServer(_Node(), SECRET, host="127.0.0.1", port=0, max_workers=4)
    server.start()
    try:
        yield server
    finally:
        server.stop(0)


def _info(address: str, metadata) -> node_pb2.InfoResponse:
    with grpc.insecure_channel(address) as channel:
        return node_pb2_grpc.NodeStub(channel).Info(node_pb2.InfoRequest(), metadata=metadata, timeout=10)


def test_calls_carry_a_fresh_credential_never_the_secret(node, monkeypatch) -> None:
    sent = []
    real = auth.call_metadata
    monkeypatch.setattr("expertmesh.node.rpc.client.call_metadata", lambda s: sent.append(real(s)) or sent[-1])
    with NodeClient(node.address, SECRET) as client:
        client.info()
        client.info()
    assert len(sent) == 2 and sent[0] != sent[1]  # a new nonce each call
    assert all(SECRET not in value for md in sent for _, value in md)
    assert all(key == AUTH_METADATA_KEY for md in sent for key, _ in md)


def test_a_wrong_secret_or_the_bare_secret_is_refused(node) -> None:
    for metadata in (call_metadata("another-secret"), ((AUTH_METADATA_KEY, SECRET),)):
        with pytest.raises(grpc.RpcError) as e:
            _info(node.address, metadata)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert e.value.details() == "a valid household secret is required"


def test_a_node_of_the_previous_protocol_is_told_to_upgrade_not_that_its_secret_is_wrong(node) -> None:
    with pytest.raises(grpc.RpcError) as e:
        _info(node.address, (("x-expertmesh-secret", SECRET),))  # what protocol 1 sent
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "same expertmesh release" in e.value.details() and SECRET not in e.value.details()


def test_a_member_of_another_protocol_is_not_joined_and_says_why() -> None:
    from fake_nodes import member

    from expertmesh.node.household.membership import prove_peer
    from expertmesh.node.rpc.proof import ProofError

    with member(SECRET, "old-mac", protocol_version=1) as old:
        with pytest.raises(ProofError, match="speaks protocol 1 and this one 2"):
            prove_peer(old.address, SECRET)


def test_a_copied_credential_is_refused_once_its_window_is_over_and_says_the_clocks_differ(node, monkeypatch) -> None:
    assert _info(node.address, call_metadata(SECRET)).node_id == "node-c"
    now = time.time()
    monkeypatch.setattr(auth.time, "time", lambda: now - CALL_CREDENTIAL_WINDOW_S - 60)
    old = call_metadata(SECRET)  # made (or recorded off the LAN) six minutes ago
    monkeypatch.undo()
    with pytest.raises(grpc.RpcError) as e:
        _info(node.address, old)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "clock" in e.value.details() and "behind" in e.value.details()
