"""Small real gRPC servers on loopback that play household members and strangers in the peer-proof
tests: a member that proves itself and nothing more, a stranger that records every call (and the
secret it was sent, if any), and a relay that passes a caller's Prove on to a real member."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from expertmesh.node import constants
from expertmesh.node.rpc.auth import AUTH_METADATA_KEY
from expertmesh.node.rpc.proof import Identity, ProofRefused, Prover
from expertmesh.node.rpc.server import NodeServer
from expertmesh.v1 import node_pb2, node_pb2_grpc


@dataclass
class Recorder(grpc.ServerInterceptor):
    """Every call a server got, before any handler: (method, the credential it carried or "")."""

    calls: list[tuple[str, str]] = field(default_factory=list)

    def intercept_service(self, continuation, handler_call_details):
        md = dict(handler_call_details.invocation_metadata or ())
        self.calls.append((handler_call_details.method, md.get(AUTH_METADATA_KEY, "")))
        return continuation(handler_call_details)

    def credentials(self) -> list[str]:
        """What each call carried in the auth metadata (nothing, for a caller that keeps to the rules)."""
        return [s for _, s in self.calls if s]

    def proved(self) -> bool:
        return any(m.endswith("/Prove") for m, _ in self.calls)


class _Member(node_pb2_grpc.NodeServicer):
    def __init__(self, identity: Identity):
        self.identity = identity
        self.prover: Prover | None = None

    def Prove(self, request, context):
        try:
            return self.prover.answer(request, self.identity)
        except ProofRefused as e:
            context.abort(e.code, str(e))


@contextlib.contextmanager
def member(
    secret: str,
    node_id: str,
    role: str = "full",
    disk_budget_bytes: int = 10**9,
    compute: bool = True,
    protocol_version: int = constants.PROTOCOL_VERSION,
) -> Iterator[NodeServer]:
    """A member of the household: behind the secret, it answers Prove with `node_id` and these attributes."""
    servicer = _Member(Identity(node_id, role, disk_budget_bytes, compute, protocol_version))
    server = NodeServer(servicer, secret, host="127.0.0.1", port=0, max_workers=8)
    servicer.prover = Prover(secret, server.port)
    server.start()
    try:
        yield server
    finally:
        server.stop(0)


class Relay(node_pb2_grpc.NodeServicer):
    """Passes Prove on to the member at `target` and hands back its answer; with `rewrite`, first
    sets `dialed` to the member's own address (so the member signs, for the wrong address)."""

    def __init__(self, target: str, rewrite: bool = False):
        self.target, self.rewrite = target, rewrite

    def Prove(self, request, context):
        dialed = self.target if self.rewrite else request.dialed
        with grpc.insecure_channel(self.target) as channel:
            try:
                return node_pb2_grpc.NodeStub(channel).Prove(
                    node_pb2.ProveRequest(nonce=request.nonce, dialed=dialed), timeout=5
                )
            except grpc.RpcError as e:
                context.abort(e.code(), e.details())


class Forger(node_pb2_grpc.NodeServicer):
    """Answers Prove with whatever it likes and a made-up MAC, and Info with the same claims."""

    def Prove(self, request, context):
        return node_pb2.ProveResponse(
            node_id="forger", role="full", disk_budget_bytes=2**62, compute=True, mac=bytes(32)
        )

    def Info(self, request, context):
        return node_pb2.InfoResponse(node_id="forger", role="full", disk_budget_bytes=2**62, compute=True)


@contextlib.contextmanager
def fake_node(
    servicer: node_pb2_grpc.NodeServicer, interceptors: list = (), workers: int = 4
) -> Iterator[tuple[str, health.HealthServicer]]:
    """A gRPC server on loopback with `servicer` as its Node service and a health service that
    says SERVING: (address, the health servicer, to change what it says)."""
    server = grpc.server(futures.ThreadPoolExecutor(workers), interceptors=list(interceptors))
    node_pb2_grpc.add_NodeServicer_to_server(servicer, server)
    hs = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    hs.set("", health_pb2.HealthCheckResponse.SERVING)
    try:
        yield f"127.0.0.1:{port}", hs
    finally:
        server.stop(0).wait()


@contextlib.contextmanager
def stranger(servicer: node_pb2_grpc.NodeServicer | None = None) -> Iterator[tuple[str, Recorder]]:
    """A server that knows no secret and records what it is sent: (address, recorder). Without a
    servicer every node call is UNIMPLEMENTED (after the recorder saw it); health says SERVING."""
    recorder = Recorder()
    with fake_node(servicer or node_pb2_grpc.NodeServicer(), [recorder]) as (address, _):
        yield address, recorder
