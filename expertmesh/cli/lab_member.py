"""A lab node on loopback: `expertmesh serve` with its LAN port emulated in its own process.

Where the lab cannot make network namespaces (not root, no iproute2) every node listens on
127.0.0.1, where the kernel does not shape anything. This runs the same node `serve` builds, from
the same flags, with devtools/link_emulation.py's `LanInterceptor` in front of its gRPC service: a
token bucket of `LAN_BYTES_PER_S` each way and a round trip per call, in the node's process. It is
an emulation, and the lab says so; the namespaces are the real thing.

    python -m expertmesh.cli.lab_member LAN_BYTES_PER_S RTT_S SERVE_ARGS...
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def main(argv: list[str]) -> int:
    from expertmesh.assembly import build_node
    from expertmesh.cli import arguments, serve
    from expertmesh.devtools.link_emulation import LanEmulation, LanInterceptor

    lan = LanEmulation(bandwidth=float(argv[0]), rtt_s=float(argv[1]))
    parser = argparse.ArgumentParser(prog="expertmesh-lab-member")
    serve.add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", *argv[2:]])
    secret, _ = arguments.secret(args)
    node = build_node(serve.node_config(args, secret), interceptors=[LanInterceptor(lan)])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with node:
        # the line `serve` prints, which the lab waits for
        port = node.rpc.port if node.rpc is not None else args.port  # serve always makes its gRPC server
        print(f"{node.role} node {node.node_id} serving {node.repo_id} @ {node.commit[:12]} on {args.host}:{port}")
        print(f"LAN emulated in this process: {lan.bandwidth:.0f} B/s each way, {lan.rtt_s * 1000:.1f} ms a call")
        sys.stdout.flush()
        while not stop.wait(1.0):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
