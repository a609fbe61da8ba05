"""expertmesh node: engine, expert store, index, Hub access and the CLI."""
