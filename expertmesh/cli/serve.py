"""`serve`: a node of the household, until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from expertmesh.cli import arguments
from expertmesh.node import constants
from expertmesh.node.config import ApiConfig, HouseholdConfig, MetricsConfig, NodeConfig, RemoteConfig, RpcConfig


def add_commands(sub) -> None:
    p = sub.add_parser("serve", help="run a node: the gRPC node service for a pulled model")
    p.add_argument("repo", type=arguments.repo_id, help="Hugging Face repo id of a pulled model")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default all interfaces)")
    p.add_argument(
        "--port",
        type=arguments.port,
        default=constants.DEFAULT_NODE_PORT,
        help="0 picks a free port (default %(default)s)",
    )
    p.add_argument("--cluster", default="home", help="zeroconf cluster name: nodes join their own cluster only")
    p.add_argument("--interface", metavar="IP", help="advertise and browse on this address only")
    p.add_argument(
        "--no-discovery",
        dest="discover",
        action="store_false",
        help="no zeroconf: peers only from --peer (where multicast does not work)",
    )
    p.add_argument(
        "--cache-only",
        action="store_true",
        help="a cache peer: no core and no compute, only expert bytes (needs `pull --index-only`)",
    )
    p.add_argument(
        "--tls-cert", metavar="PEM", help="serve over TLS with the household certificate (see node/rpc/tls.py)"
    )
    p.add_argument("--tls-key", metavar="PEM", help="the key of --tls-cert")
    p.add_argument("--http-host", default="127.0.0.1", help="the OpenAI-compatible API's address (default %(default)s)")
    p.add_argument(
        "--http-port",
        type=arguments.port,
        default=8000,
        metavar="N",
        help="the OpenAI-compatible API's port (default %(default)s; 0 picks a free one)",
    )
    p.add_argument("--no-http", dest="http_port", action="store_const", const=None, help="no HTTP API")
    p.add_argument(
        "--max-waiting",
        type=arguments.whole_number,
        default=16,
        metavar="N",
        help="requests that may wait for a generation slot before the API answers 429 (default %(default)s)",
    )
    p.add_argument(
        "--http-allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="another name clients use for this machine in the API's Host header (its addresses, its host "
        "name and HOSTNAME.local are allowed already; other names are refused against DNS rebinding)",
    )
    p.add_argument(
        "--http-max-connections",
        type=arguments.positive_int,
        default=4096,
        metavar="N",
        help="API connections open at once, at most half the open-file limit; beyond, the one idle longest "
        "is closed (default %(default)s)",
    )
    arguments.add_metrics_arguments(p, default=0)
    arguments.add_store_arguments(p)
    arguments.add_memory_arguments(p)
    arguments.add_peer_arguments(p)
    arguments.add_prompt_experts_argument(p)
    arguments.add_speculation_arguments(p)
    arguments.add_batch_arguments(p)
    p.set_defaults(func=serve)


def node_config(args: argparse.Namespace, secret: str) -> NodeConfig:
    """`serve`'s flags as the node they describe."""
    household = HouseholdConfig(
        secret=secret,
        peers=list(args.peer),
        discover=args.discover,
        cluster=args.cluster,
        interface=args.interface,
        tls_ca=arguments.tls_ca(args),
        remote=RemoteConfig() if args.remote_compute != "off" else None,
    )
    metrics = None
    if args.metrics_port is not None:
        metrics = MetricsConfig(host=args.metrics_host or args.host, port=args.metrics_port)
    api = None
    if args.http_port is not None:
        api = ApiConfig(
            host=args.http_host,
            port=args.http_port,
            max_waiting=args.max_waiting,
            max_connections=args.http_max_connections,
            allowed_hosts=list(args.http_allow_host),
        )
    return NodeConfig(
        args.repo,
        revision=args.revision,
        cache_only=args.cache_only,
        store=arguments.store_config(args),
        household=household,
        rpc=RpcConfig(host=args.host, port=args.port, tls_cert=args.tls_cert, tls_key=args.tls_key),
        metrics=metrics,
        api=api,
        speculation=arguments.speculation(args) if not args.cache_only else None,
        max_batch=arguments.max_batch(args),
        max_context=args.max_context,
        core_budget=args.core_budget,
        prefix_cache=args.prefix_cache,
        prefix_disk_budget=args.prefix_disk_budget,
        prompt_experts=str(args.prompt_experts),
    )


def _loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only (then plain TCP shows nothing to the LAN)."""
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _tell_how_to_join(secret: str, repo: str) -> None:
    """After creating a secret: the join command on a terminal only. Anywhere else stdout is
    probably a log (launchd's, a file), and a secret in a log is a secret anyone who reads it has."""
    where = arguments.home_secret_path()
    if sys.stdout.isatty():
        print(f"created a household secret in {where}; to join another Mac, run there:")
        print(f"  EXPERTMESH_SECRET={secret} expertmesh serve {repo}")
    else:
        print(f"created a household secret in {where}; `expertmesh secret` shows it and how another Mac joins")


def serve(args: argparse.Namespace) -> int:
    from expertmesh.assembly import build_node

    secret, created = arguments.secret(args)
    node = build_node(node_config(args, secret))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with node:
        port = node.rpc.port if node.rpc is not None else args.port  # serve always makes its gRPC server
        print(f"{node.role} node {node.node_id} serving {node.repo_id} @ {node.commit[:12]} on {args.host}:{port}")
        if node.metrics_server is not None:
            print(f"metrics on {node.metrics_server.url}", file=sys.stderr)
        if node.discovery is not None:
            print(f"advertising in cluster {args.cluster!r} as {node.discovery.address}; peers join as they appear")
        if node.api is not None:
            print(f"OpenAI-compatible API on {node.api.url} (model {node.repo_id!r}); {node.api.access.describe()}")
        print(node.describe())
        if not args.tls_cert and not _loopback(args.host):
            print(
                f"gRPC on {args.host} is plain TCP: prompts, answers and experts cross the LAN in clear; "
                "beyond a trusted home network serve with --tls-cert/--tls-key (README: Security)",
                file=sys.stderr,
            )
        if created:
            _tell_how_to_join(secret, args.repo)
        sys.stdout.flush()
        try:
            while not stop.wait(1.0):
                pass
        except KeyboardInterrupt:
            pass
        print("stopping", file=sys.stderr)
    return 0
