"""Optional TLS between nodes: a household certificate for the name `expertmesh`; clients that
trust it get experts, a plain-TCP client and a client trusting another CA get nothing."""

from __future__ import annotations

import datetime
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from nodes import serving
from repos import QWEN3_MOE

from expertmesh.cli import main
from expertmesh.devtools.local_hub import HubServer
from expertmesh.node.config import RpcConfig, StoreConfig
from expertmesh.node.household.membership import PeerTable, describe_peer
from expertmesh.node.household.peers_tier import PeerSource
from expertmesh.node.rpc.client import NodeClient
from expertmesh.node.rpc.tls import TLS_NAME
from expertmesh.v1 import node_pb2

SECRET = "tls-test-secret"


def _household_cert(folder: Path, name: str = TLS_NAME) -> tuple[Path, Path]:
    """A self-signed certificate as the module docstring of node/rpc/tls.py tells users to make."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    folder.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


@pytest.fixture(scope="module")
def tls_node(pulled_home, hub: HubServer, tmp_path_factory: pytest.TempPathFactory):
    home = tmp_path_factory.mktemp("tls-node")
    cert, key = _household_cert(home / "tls")
    pulled_home("qwen3_moe", home, index_only=True)
    rpc = RpcConfig(host="127.0.0.1", port=0, tls_cert=str(cert), tls_key=str(key))
    node = serving(
        QWEN3_MOE, home, SECRET, node_id="tls-node", cache_only=True, store=StoreConfig(disk_budget="100MB"), rpc=rpc
    )
    try:
        yield node.rpc.address, cert.read_bytes(), node.experts, home
    finally:
        node.close()


def _info(address: str, ca: bytes | None) -> node_pb2.InfoResponse:
    with NodeClient(address, SECRET, ca) as client:
        return client.info(timeout=5)


def test_a_client_trusting_the_household_cert_gets_verified_experts(tls_node) -> None:
    address, ca, experts, _ = tls_node
    assert _info(address, ca).node_id == "tls-node"
    peer = describe_peer(address, SECRET, ca)
    table = PeerTable("client", 0.0)
    table.add(peer)
    source = PeerSource(experts.index, table, SECRET, tls_ca=ca)
    try:
        loc = experts.index.expert(*sorted(experts.index.experts)[0])
        blob = source.fetch(loc)  # the owner fetches it from the Hub and serves it over TLS
        assert blob is not None and len(blob) == loc.nbytes
        assert not table.errors
    finally:
        source.close()


def test_plain_tcp_and_another_ca_get_nothing(tls_node, tmp_path: Path) -> None:
    address, _, _, _ = tls_node
    with pytest.raises(grpc.RpcError) as plain:
        _info(address, None)
    assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
    other_ca, _ = _household_cert(tmp_path / "other")
    with pytest.raises(grpc.RpcError) as other:
        _info(address, other_ca.read_bytes())
    assert other.value.code() == grpc.StatusCode.UNAVAILABLE


def test_cli_tls_errors_are_one_line(tls_node, tmp_path: Path, monkeypatch, capsys) -> None:
    address, _, _, home = tls_node
    monkeypatch.setenv("EXPERTMESH_HOME", str(home))
    monkeypatch.setenv("EXPERTMESH_SECRET", SECRET)
    assert (
        main(
            [
                "serve",
                "--cache-only",
                QWEN3_MOE,
                "--port",
                "0",
                "--no-discovery",
                "--no-metrics",
                "--no-http",
                "--tls-cert",
                str(home / "tls" / "cert.pem"),
            ]
        )
        != 0
    )
    assert "both --tls-cert and --tls-key" in capsys.readouterr().err
    (tmp_path / "junk.pem").write_text("not a certificate")
    assert main(["peers", "--no-discovery", "--peer", address, "--tls-ca", str(tmp_path / "junk.pem")]) != 0
    assert "is not a PEM file" in capsys.readouterr().err
    assert main(["peers", "--no-discovery", "--peer", address, "--tls-ca", str(home / "tls" / "cert.pem")]) == 0
    assert "tls-node" in capsys.readouterr().out
