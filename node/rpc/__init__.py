"""The gRPC wire between nodes: the server (server.py) and NodeClient (client.py) for calls to other
nodes; call credentials made with the household secret (auth.py, replay_cache.py), peer proof
(proof.py), TLS (tls.py), activation tensors (activations.py) and inventories (inventory.py). The
node service behind the server is node/service.py, a layer above, since it calls the engine."""
