"""expertmesh coordinator: discovery, membership, ownership and the HTTP API."""
