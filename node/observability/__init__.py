"""Watching nodes: Prometheus metrics (metrics.py), Prometheus' targets kept from zeroconf
(prometheus_targets.py), and routing traces for replaying RAM policies (routing_trace.py)."""
