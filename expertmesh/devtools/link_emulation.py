"""A slower link than loopback, for benchmarks: bytes per second shared by everyone using it, and a
round-trip delay. The local Hub (expertmesh/devtools/local_hub.py) and a node's gRPC service (`LanInterceptor`
in front of it) use it, so a bench on one machine sees the household's network, not the kernel's memcpy."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc

from expertmesh.node.constants import K3_EXPERT_BYTES, K3_HIDDEN


class TokenBucket:
    """Bytes per second shared by whoever takes from it; sleeping happens outside the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next_free = time.monotonic()

    def take(self, nbytes: int, rate: float) -> None:
        if rate <= 0:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next_free)
            self._next_free = start + nbytes / rate
            wait = self._next_free - now
        time.sleep(max(0.0, wait))


def take_together(nbytes: int, *limits: tuple[TokenBucket, float]) -> None:
    """Send `nbytes` under several limits at once, e.g. the shared link's and one connection's.

    The bytes start when every bucket is free and last as long as the slowest rate makes them;
    each bucket is busy for its own rate's share. Taking the buckets one after another instead
    would charge a connection the link's time on top of its own, so 8 connections of an eighth
    of the link each could never fill it (docs/benchmarks.md, bench_time_scale).
    """
    time.sleep(reserve_together(nbytes, None, *limits))


def reserve_together(nbytes: int, now: float | None, *limits: tuple[TokenBucket, float]) -> float:
    """The bookkeeping of `take_together` at the instant `now`: returns how long to wait.

    Apart from the sleep so that the arithmetic can be checked at chosen instants, free of
    how the scheduler happened to delay the caller. `now=None` reads the clock once the locks
    are held, so time spent waiting for a busy bucket's lock is not slept again.
    """
    limits = tuple((b, r) for b, r in limits if r > 0)
    if not limits:
        return 0.0
    for bucket, _ in limits:  # always in the caller's order (the link's, then a connection's)
        bucket._lock.acquire()
    try:
        if now is None:
            now = time.monotonic()
        start = max(now, *(bucket._next_free for bucket, _ in limits))
        for bucket, rate in limits:
            bucket._next_free = start + nbytes / rate
        return max(0.0, start + max(nbytes / rate for _, rate in limits) - now)
    finally:
        for bucket, _ in reversed(limits):
            bucket._lock.release()


@dataclass
class LanEmulation:
    """A node's LAN port: `bandwidth` bytes/s each way, `rtt_s` per call.

    `activation_scale` charges activation bytes (ComputeExperts) at that multiple of their size:
    a bench model's experts are far smaller than K3's relative to its activations, so keeping K3's
    ratio of expert bytes to activation bytes on the wire means counting activations for less.
    """

    bandwidth: float
    rtt_s: float
    activation_scale: float = 1.0
    _inbound: TokenBucket = field(default_factory=TokenBucket, repr=False)
    _outbound: TokenBucket = field(default_factory=TokenBucket, repr=False)

    def round_trip(self) -> None:
        time.sleep(self.rtt_s)

    def receive(self, nbytes: int, activations: bool = False) -> None:
        self._inbound.take(int(nbytes * (self.activation_scale if activations else 1.0)), self.bandwidth)

    def send(self, nbytes: int, activations: bool = False) -> None:
        self._outbound.take(int(nbytes * (self.activation_scale if activations else 1.0)), self.bandwidth)


# Kimi K3 on gigabit Ethernet: a 17.5 MB expert, a 7168-wide BF16 activation row, 118 MB/s, 1 ms.
K3_ROW_BYTES = K3_HIDDEN * 2
GIGABIT = {"bandwidth": 118e6, "rtt_s": 1e-3}


def k3_lan(expert_bytes: int, row_bytes: int, time_scale: float) -> LanEmulation:
    """Gigabit Ethernet as it looks to K3, for a model with `expert_bytes` experts and `row_bytes`
    activation rows: an expert takes as long to cross as a K3 expert does (times `time_scale`), and
    an activation row as long relative to it as a K3 row does."""
    b = expert_bytes / K3_EXPERT_BYTES
    activation_scale = (K3_ROW_BYTES / K3_EXPERT_BYTES) / (row_bytes / expert_bytes)
    return LanEmulation(GIGABIT["bandwidth"] * b / time_scale, GIGABIT["rtt_s"] * time_scale, activation_scale)


NODE_METHODS = "/expertmesh.v1.Node/"


def _payload_bytes(message) -> int:
    """What a message puts on the wire (its serialized size)."""
    return message.ByteSize()


class LanInterceptor(grpc.ServerInterceptor):
    """Slows a node's gRPC service to `lan`, as a household link would: every call of the node
    service pays a round trip and its messages' bytes each way (ComputeExperts' at the
    activation scale). Only benchmarks and tests put it in front of a node (`build_node(...,
    interceptors=[LanInterceptor(lan)])`); the health service is never slowed."""

    def __init__(self, lan: LanEmulation):
        self.lan = lan

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(NODE_METHODS):
            return handler
        lan, activations = self.lan, method.endswith("/ComputeExperts")

        def arrive(request) -> None:
            lan.round_trip()
            lan.receive(_payload_bytes(request), activations)

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            def unary(request, context):
                arrive(request)
                response = inner(request, context)
                lan.send(_payload_bytes(response), activations)
                return response

            return grpc.unary_unary_rpc_method_handler(
                unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            def stream(request, context):
                arrive(request)
                for response in inner_stream(request, context):
                    lan.send(_payload_bytes(response), activations)
                    yield response

            return grpc.unary_stream_rpc_method_handler(
                stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler
