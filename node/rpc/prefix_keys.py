"""Keys that name a conversation's prompt prefixes, the same on a coordinator and on a full node, so
a coordinator can send a request to the node that holds the longest prefix of its prompt
(coordinator/node_pool.py) without a tokenizer and without any node telling it a token or a word.

A coordinator has no tokenizer (it never loads a model), so it cannot hash the prompt's tokens. It
has the request it sends, though, and the node renders exactly that request: the key of a
request's first k messages hashes its prefix space (already a hash of the API key), its model, the
tools its template is given, and those k messages as the wire carries them (deterministic protobuf
bytes). A node labels each stored state (node/engine/prefix_cache.py) with the keys of the message
prefixes whose tokens it holds exactly, i.e. whose ends it checkpointed, or all of them for a state
that trims; a later request with the same first k messages renders the same tokens up to there,
so the node that reports that key holds that many tokens of it. The node's own token comparison
still decides what it reuses: a key only routes.

A key is 16 bytes of SHA-256: nothing of the messages or the key can be read from it, and one
key's space cannot be tested for a conversation without that space's hash.
"""

from __future__ import annotations

import hashlib
import struct

from expertmesh.v1 import node_pb2

KEY_BYTES = 16
MAX_HELD = 64  # prefixes a node reports; a coordinator believes no more of one node
_DOMAIN = b"expertmesh prefix key v1\0"


def _field(h, data: bytes) -> None:
    h.update(struct.pack("<Q", len(data)))
    h.update(data)


def message_prefix_keys(request: node_pb2.GenerateRequest) -> list[bytes]:
    """The keys of `request`'s first 1, 2, ... messages (index k-1 names the first k); none for a
    raw prompt or an approximate one (`prompt_experts` other than exact: its states are kept
    apart, node/service.py)."""
    if not request.messages or request.prompt_experts not in ("", "exact"):
        return []
    h = hashlib.sha256(_DOMAIN)
    _field(h, request.prefix_space.encode())
    _field(h, request.model.repo_id.encode())
    rendered_tools = request.tools if request.tools and request.tool_choice != "none" else ""
    _field(h, rendered_tools.encode())
    keys = []
    for m in request.messages:
        _field(h, m.SerializeToString(deterministic=True))
        keys.append(h.copy().digest()[:KEY_BYTES])
    return keys


def held_table(held) -> dict[bytes, int]:
    """A node's report (`PrefixHeld`s) as key -> tokens held, bounded (MAX_HELD, keys of the
    right length): what a node says is believed only as far as routing needs it."""
    table: dict[bytes, int] = {}
    for p in list(held)[:MAX_HELD]:
        if len(p.key) == KEY_BYTES:
            table[bytes(p.key)] = max(table.get(bytes(p.key), 0), int(p.tokens))
    return table
