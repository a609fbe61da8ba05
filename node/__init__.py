"""A node of the household (installed as `expertmesh.node`).

    model/          what a model's experts are: expert index, sanitize trace, safetensors, codec
    hub/            the Hugging Face Hub: strict range reads, pull, where pulled models live
    store/          the expert store; store/tiers/: ram, disk, hub
    config.py       NodeConfig and its parts
    engine/         mlx-lm's model with streaming expert blocks; generation, speculation, core bits
    rpc/            the gRPC wire: server, client, credentials, proof, TLS, activations
    household/      discovery, membership and ownership, the peers tier, warm, remote execution
    observability/  Prometheus metrics and targets, routing traces
    service.py      the gRPC node service over the engine, store and household
    fetching.py     what a fetch is for (FetchContext), passed down from the store to the Hub

expertmesh/assembly.py builds a node from these; docs/architecture.md lists the layers (imports
run down them) and follows a token and an expert through them.
"""
