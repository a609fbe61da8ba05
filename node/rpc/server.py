"""A node's gRPC server: the node service behind the household secret, plus the standard health
service (open to all) and server reflection, on the address asked for.

The port is bound when the server is made, so a taken port fails while the node is being built
and the port is known (port 0 picks a free one) before anything advertises it; `start` serves.

Every call runs on one of `max_workers` threads, and a streaming Generate keeps its thread to the
end. The service's generation slots (node/service.py) are fitted to leave RESERVED_WORKERS threads
to everything else, and its peer-call slots (FetchExpert and ComputeExperts, rpc/admission.py) get
what Generate's generations and token counts and the reserve leave, so health checks, Info and
GetInventory are answered however many generations, counts, expert fetches and computations are
asked for.
"""

from __future__ import annotations

from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from expertmesh.node import constants
from expertmesh.node.rpc.auth import SecretInterceptor
from expertmesh.v1 import node_pb2, node_pb2_grpc

SERVICE_NAME = node_pb2.DESCRIPTOR.services_by_name["Node"].full_name
RESERVED_WORKERS = 4  # threads neither Generate nor peers' fetches and computations hold: health, Info, inventory


class NodeServer:
    """`servicer` on `host:port` (0: a free port, see `port`); `tls` from rpc/tls.py's
    `server_credentials`, or None for plain TCP; `interceptors` run after the secret check."""

    def __init__(
        self,
        servicer: node_pb2_grpc.NodeServicer,
        secret: str,
        host: str = "127.0.0.1",
        port: int = 0,
        max_workers: int = 18,
        tls: grpc.ServerCredentials | None = None,
        interceptors=(),
    ):
        options = [
            ("grpc.max_receive_message_length", constants.RPC_MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", constants.RPC_MAX_MESSAGE_BYTES),
        ]
        slots = getattr(servicer, "generation_slots", None)
        if slots is not None:
            slots.fit(max_workers - RESERVED_WORKERS)
        peer_calls = getattr(servicer, "peer_call_slots", None)
        if peer_calls is not None:
            # a cache peer (no model) refuses Generate at once: no thread goes to it
            full = getattr(servicer, "sm", None) is not None
            generating = slots.capacity if slots is not None and full else 0
            counts = getattr(servicer, "count_slots", None)
            counting = counts.capacity if counts is not None and full else 0
            peer_calls.fit(max_workers - RESERVED_WORKERS - generating - counting)
        self.executor = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc")
        self.server = grpc.server(
            self.executor, interceptors=[SecretInterceptor(secret), *interceptors], options=options
        )
        node_pb2_grpc.add_NodeServicer_to_server(servicer, self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        address = f"{host}:{port}"
        try:
            bound = (
                self.server.add_secure_port(address, tls) if tls is not None else self.server.add_insecure_port(address)
            )
        except RuntimeError:  # grpc's "Failed to bind": no such host, an address not of this machine
            bound = 0
        if bound == 0:
            raise OSError(f"cannot listen on {address}: is it an address of this machine, and is the port free?")
        self.host, self.port = host, bound

    @property
    def address(self) -> str:
        """host:port to reach this server from this machine."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"{host}:{self.port}"

    def start(self) -> NodeServer:
        self.server.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self

    def stop(self, grace_s: float = 1.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()
        # grpc leaves its executor's threads alive; join them, so no thread that ran a
        # generation outlives the node (MLX aborts the process at exit if one is still running).
        self.executor.shutdown(wait=True, cancel_futures=True)
