"""The household's front door (installed as `expertmesh.coordinator`): the OpenAI-compatible API
over the full nodes' Generate — its HTTP server (http_server.py), access rules (api_access.py),
request checks (openai_request.py), routing and failover (generation.py, node_pool.py), the
threads that run generations (generation_threads.py), its bounded queue and metrics — and
`expertmesh status` (status.py)."""
