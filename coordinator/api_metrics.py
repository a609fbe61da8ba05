"""The coordinator's own metrics: API responses by endpoint and status, and the generation queue.
Nodes export the expert and token metrics (node/observability/metrics.py); these say how the
front door is doing — how often people are turned away (429) or failed (5xx).

They are on the API's `/metrics`, and a node that serves both the API and `/metrics` registers
them on its node registry too (expertmesh/assembly.py): that is the port the node advertises and
`expertmesh prometheus-targets` lists, so Prometheus finds them without a target of their own."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

ENDPOINTS = (
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/healthz",
    "/metrics",
)
# Every label name used here; none may be a target label (node/observability/prometheus_targets.py).
LABELS = ("endpoint", "code", "state")


class ApiMetrics(Collector):
    def __init__(self, queue_depth: Callable[[], tuple[int, int]]):
        self._queue_depth = queue_depth
        self._responses: Counter = Counter()  # (endpoint, status) -> count
        self._lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def record(self, path: str, status: int) -> None:
        endpoint = path.split("?")[0].rstrip("/")
        with self._lock:
            self._responses[(endpoint if endpoint in ENDPOINTS else "other", str(status))] += 1

    def collect(self) -> Iterator:
        responses = CounterMetricFamily(
            "expertmesh_api_responses", "HTTP API responses by endpoint and status code.", labels=["endpoint", "code"]
        )
        with self._lock:
            for (endpoint, code), n in sorted(self._responses.items()):
                responses.add_metric([endpoint, code], n)
        yield responses
        running, waiting = self._queue_depth()
        queue = GaugeMetricFamily(
            "expertmesh_api_generations", "Generations running and waiting for a slot.", labels=["state"]
        )
        queue.add_metric(["running"], running)
        queue.add_metric(["waiting"], waiting)
        yield queue
