"""The household's front door (installed as `expertmesh.coordinator`): the OpenAI-compatible API
over the full nodes' Generate (openai_api.py), the pool of nodes it routes to (node_pool.py), its
bounded queue and metrics, and `expertmesh status` (status.py)."""
