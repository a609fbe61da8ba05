"""The gRPC contract's two ends: the node service (service.py) behind its server (server.py), and
NodeClient (client.py) for calls to other nodes; the household secret (auth.py), TLS (tls.py) and
activation tensors on the wire (activations.py)."""
