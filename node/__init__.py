"""A node of the household (installed as `expertmesh.node`).

    config.py, assembly.py   NodeConfig, and build_node: the one place a node is assembled
    engine/                  mlx-lm's model with streaming expert blocks; generation, speculation
    store/                   the expert store; store/tiers/: ram, disk, peers, hub
    hub/                     the Hugging Face Hub: client, pull, safetensors headers, expert index
    household/               discovery, membership and ownership, warm, remote expert execution
    rpc/                     the gRPC service, server and client; secret, TLS, activations
    observability/           Prometheus metrics and targets, routing traces
    devtools/                for tests and benchmarks only: local Hub, link emulation, bench, tiny models

docs/architecture.md follows a token and an expert through these.
"""
