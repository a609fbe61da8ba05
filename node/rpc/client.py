"""Talking to another node: one `NodeClient` per address, the household secret on every call.

The peers tier, remote execution, `warm`, `status`, `peers` and the coordinator all reach nodes
through this class, so the channel options, TLS, the secret and the deadlines live in one place.
Calls raise `grpc.RpcError`: what a failure means (skip a peer, fall back, report) is the
caller's to decide.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from expertmesh.node.rpc.auth import call_metadata, node_method
from expertmesh.node.rpc.inventory import inventory_keys
from expertmesh.node.rpc.proof import PROVE_DEADLINE_S, ProofError, prove
from expertmesh.node.rpc.tls import open_channel
from expertmesh.v1 import node_pb2, node_pb2_grpc

INFO_DEADLINE_S = 5.0
HEALTH_DEADLINE_S = 2.0


def model_key(repo_id: str, commit: str) -> node_pb2.ModelKey:
    return node_pb2.ModelKey(repo_id=repo_id, commit=commit)


class ChunkStream(Protocol):
    """A server-streaming call as grpc returns it: its messages as they arrive, and `cancel()`,
    which frees the node when the caller gives up early (a no-op once the stream ended)."""

    def __iter__(self) -> Iterator[node_pb2.ExpertChunk]: ...

    def __next__(self) -> node_pb2.ExpertChunk: ...

    def cancel(self) -> bool: ...


class NodeClient:
    """A channel to the node at `address` (kept open: calls cost no connection set-up)."""

    def __init__(self, address: str, secret: str, tls_ca: bytes | None = None):
        self.address = address
        self.channel = open_channel(address, tls_ca)
        self._stub = node_pb2_grpc.NodeStub(self.channel)
        self._secret = secret

    def _credential(self, method: str) -> tuple[tuple[str, str], ...]:
        """A fresh credential for one call of `method` (a node accepts each credential once)."""
        return call_metadata(self._secret, node_method(method))

    def info(self, timeout: float = INFO_DEADLINE_S) -> node_pb2.InfoResponse:
        return self._stub.Info(node_pb2.InfoRequest(), metadata=self._credential("Info"), timeout=timeout)

    def inventory(
        self, model: node_pb2.ModelKey, sizes: Mapping[int, int], timeout: float = INFO_DEADLINE_S
    ) -> set[tuple[int, int]]:
        """The experts of `model` the node's disk holds, read against `sizes` (experts per MoE
        layer, rpc/inventory.py's `layer_sizes` of the model's index): bitmaps that do not fit
        the model are dropped, so a peer cannot make this node hold more keys than the model has,
        and an answer for another model than `model` holds nothing."""
        request = node_pb2.InventoryRequest(model=model)
        answer = self._stub.GetInventory(request, metadata=self._credential("GetInventory"), timeout=timeout)
        return inventory_keys(answer, sizes, source=f"node {self.address}", model=model)

    def fetch_expert(
        self,
        model: node_pb2.ModelKey,
        layer: int,
        expert: int,
        timeout: float,
        fetch_on_miss: bool = False,
        keep_only: bool = False,
        progress: bool = False,
    ) -> ChunkStream:
        """The expert's chunks as they stream (`keep_only`: the node keeps it, one empty chunk;
        `progress`: progress messages come first while it fetches on a miss)."""
        request = node_pb2.FetchExpertRequest(
            key=node_pb2.ExpertKey(model=model, layer=layer, expert=expert),
            fetch_on_miss=fetch_on_miss,
            keep_only=keep_only,
            progress=progress,
        )
        return self._stub.FetchExpert(request, metadata=self._credential("FetchExpert"), timeout=timeout)

    def compute_experts(self, request: node_pb2.ComputeExpertsRequest, timeout: float) -> grpc.Future:
        """ComputeExperts in flight: remote execution sends a layer's calls to all peers at once."""
        return self._stub.ComputeExperts.future(request, metadata=self._credential("ComputeExperts"), timeout=timeout)

    def generate(self, request: node_pb2.GenerateRequest, timeout: float):
        """Generate's stream of events; `cancel()` on it stops the node's generation."""
        return self._stub.Generate(request, metadata=self._credential("Generate"), timeout=timeout)

    def prove(self, nonce: bytes, dialed: str, timeout: float = PROVE_DEADLINE_S) -> node_pb2.ProveResponse:
        """The node's proof that it knows the household secret (rpc/proof.py). This call carries no
        secret: it is how a caller finds out whether the node may be sent it."""
        return self._stub.Prove(node_pb2.ProveRequest(nonce=nonce, dialed=dialed), timeout=timeout)

    def health(self, timeout: float = HEALTH_DEADLINE_S, wait_for_ready: bool = False) -> int:
        """The node's standard gRPC health status (open to all: no secret needed).

        `wait_for_ready`: while the channel waits to reconnect to a node that was down (tls.py's
        backoff), wait for it within `timeout` instead of failing at once, so a node that was
        just restarted is seen as back by the first check, not a later one."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout, wait_for_ready=wait_for_ready).status

    def serving(self, timeout: float = HEALTH_DEADLINE_S, wait_for_ready: bool = False) -> bool:
        try:
            return self.health(timeout, wait_for_ready) == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> NodeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class NodeAnswer:
    """A node's Info, or why it could not be had."""

    address: str
    info: node_pb2.InfoResponse | None = None
    error: str = ""  # the gRPC status, lower case, when Info failed


def ask_info(addresses: Iterable[str], secret: str, tls_ca: bytes | None = None) -> list[NodeAnswer]:
    """Info of every node at `addresses`, one at a time (`status`, `peers`, `warm`, `run`), asked
    only once the node has proven it knows the secret (rpc/proof.py): zeroconf's addresses may be
    anyone's. A node without a valid proof is answered as one that refused the secret."""
    out = []
    for address in addresses:
        with NodeClient(address, secret, tls_ca) as client:
            try:
                prove(client, secret)
                out.append(NodeAnswer(address, client.info()))
            except ProofError:
                out.append(NodeAnswer(address, error=grpc.StatusCode.UNAUTHENTICATED.name.lower()))
            except grpc.RpcError as e:
                out.append(NodeAnswer(address, error=e.code().name.lower()))
    return out
