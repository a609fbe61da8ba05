"""A node's stable id, kept in its home so it survives restarts (peers and ownership rely on it)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

NODE_ID_FILENAME = "node_id"


def load_or_create_node_id(home: Path) -> str:
    path = home / NODE_ID_FILENAME
    try:
        node_id = path.read_text().strip()
        if node_id:
            return node_id
    except FileNotFoundError:
        pass
    home.mkdir(parents=True, exist_ok=True)
    node_id = uuid.uuid4().hex[:16]
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(node_id + "\n")
    os.replace(tmp, path)
    return node_id
