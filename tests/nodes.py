"""Nodes for tests, built by the same composition root as `expertmesh serve` and `run`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from expertmesh.assembly import Node, build_node
from expertmesh.node.config import (
    HouseholdConfig,
    MetricsConfig,
    NodeConfig,
    RemoteConfig,
    RpcConfig,
    SpeculationConfig,
    StoreConfig,
)


def serving(
    repo_id: str,
    home: Path,
    secret: str,
    *,
    node_id: str,
    store: StoreConfig | None = None,
    peers: list[str] = (),
    cache_only: bool = False,
    speculation: SpeculationConfig | None = None,
    remote: RemoteConfig | None = None,
    rpc: RpcConfig | None = None,
    metrics: MetricsConfig | None = None,
    service_class=None,
    interceptors=(),
    max_batch: int = 1,
    prefix_disk_budget: str | None = None,
) -> Node:
    """A started node serving gRPC on a free loopback port (`node.rpc.address`), and /metrics if
    asked; `max_batch` > 1: Generate calls share batched steps, as `serve --max-batch`."""
    config = NodeConfig(
        repo_id,
        home=home,
        node_id=node_id,
        cache_only=cache_only,
        store=store or StoreConfig(prefetch=False),
        household=HouseholdConfig(secret=secret, peers=list(peers), remote=remote or RemoteConfig()),
        rpc=rpc or RpcConfig(host="127.0.0.1", port=0),
        metrics=metrics,
        speculation=speculation,
        max_batch=max_batch,
    )
    if prefix_disk_budget is not None:
        config.prefix_disk_budget = prefix_disk_budget
    return build_node(config, service_class=service_class, interceptors=interceptors).start()


def joined(
    repo_id: str,
    home: Path,
    secret: str,
    peers: list[str],
    *,
    node_id: str,
    store: StoreConfig | None = None,
    remote: RemoteConfig | None = None,
) -> Node:
    """A started node that asks `peers` before the Hub and serves nothing (as `run --peer` does);
    `remote` None: it always fetches experts, never runs them on peers."""
    config = NodeConfig(
        repo_id,
        home=home,
        node_id=node_id,
        store=store or StoreConfig(prefetch=False),
        household=HouseholdConfig(secret=secret, peers=list(peers), remote=remote),
    )
    return build_node(config).start()


def serve_command(repo_id: str, cluster: str | None, *extra: str, verbose: bool = False) -> list[str]:
    """`expertmesh serve` as a separate process on loopback (gRPC on a free port, zeroconf on
    127.0.0.1 in `cluster`, or no discovery), as the end-to-end tests start it."""
    import sys

    where = ["--interface", "127.0.0.1", "--cluster", cluster] if cluster else ["--no-discovery"]
    cli = [sys.executable, "-m", "expertmesh", *(["-v"] if verbose else [])]
    return [*cli, "serve", repo_id, "--host", "127.0.0.1", "--port", "0", *where, *extra]


def api_server(addresses: list[str], secret: str, models: list[str], max_waiting: int = 16):
    """A started OpenAI API on a free loopback port over the full nodes at `addresses`."""
    from expertmesh.coordinator.node_pool import NodePool
    from expertmesh.coordinator.openai_api import Coordinator, CoordinatorConfig, OpenAIServer

    config = CoordinatorConfig(secret=secret, models=lambda: list(models), max_waiting=max_waiting)
    return OpenAIServer(Coordinator(config, NodePool(addresses)), "127.0.0.1", 0).start()


@contextlib.contextmanager
def node_with_api(repo_id: str, home, secret: str, node_id: str, **serving_options) -> Iterator:
    """A full node serving `repo_id` from `home` and a started API over it alone (a module's
    usual pair); the API is stopped, then the node closed."""
    with serving(repo_id, home, secret, node_id=node_id, **serving_options) as node:
        server = api_server([node.rpc.address], secret, [repo_id])
        try:
            yield server
        finally:
            server.stop()
