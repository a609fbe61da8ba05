"""A node's gRPC server: the node service behind the household secret, plus the standard health
service (open to all) and server reflection, on the address asked for."""

from __future__ import annotations

from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from expertmesh.node.rpc.auth import SecretInterceptor
from expertmesh.v1 import node_pb2, node_pb2_grpc

SERVICE_NAME = node_pb2.DESCRIPTOR.services_by_name["Node"].full_name
MAX_MESSAGE_BYTES = 8 * 1024 * 1024  # chunks are 1 MiB; anything far larger is a bad client


@dataclass
class RunningServer:
    server: grpc.Server
    port: int
    health: health.HealthServicer
    executor: futures.ThreadPoolExecutor

    def stop(self, grace_s: float = 1.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()
        # grpc leaves its executor's threads alive; MLX aborts the process at exit if a thread
        # that ran a generation is still alive then, so join them here.
        self.executor.shutdown(wait=True, cancel_futures=True)


def start_node_server(
    servicer: node_pb2_grpc.NodeServicer,
    secret: str,
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = 16,
    tls: grpc.ServerCredentials | None = None,
) -> RunningServer:
    """Start serving; `port` 0 picks a free one (see `RunningServer.port`); `tls` from
    node/rpc/tls.py's `server_credentials`, or None for plain TCP."""
    options = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ]
    executor = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc")
    server = grpc.server(executor, interceptors=[SecretInterceptor(secret)], options=options)
    node_pb2_grpc.add_NodeServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, tls) if tls is not None else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server, bound, health_servicer, executor)
