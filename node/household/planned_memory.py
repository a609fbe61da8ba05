"""What a household node holds for its peers beside its own work, for the memory plan
(node/engine/memory.py's `household_bytes`).

Peers are found as they come (zeroconf), so the plan assumes PLANNED_PEERS of them unless more are
listed: a household of four Macs, the lab's. Per peer:

- remote execution's calls: at most CALLS_ENCODED_PER_PEER encoded at once (in flight or answered
  and not yet taken, household/remote_experts.py), each at most `max_call_bytes` of rows one way
  and as many of outputs the other;
- the check of its first copy (store/tier_chain.py): up to two Hub copies of one expert.

And once for the node: the idle-link audit's two Hub copies (store/peer_audit.py).
"""

from __future__ import annotations

from expertmesh.node.config import HouseholdConfig
from expertmesh.node.household.remote_experts import CALLS_ENCODED_PER_PEER

PLANNED_PEERS = 3


def household_buffer_bytes(household: HouseholdConfig, expert_bytes: int) -> int:
    """The bytes a node of `household` holds for its peers at most, its experts `expert_bytes` each."""
    peers = max(len(household.peers), PLANNED_PEERS)
    calls = 0 if household.remote is None else CALLS_ENCODED_PER_PEER * 2 * household.remote.max_call_bytes
    return peers * (calls + 2 * expert_bytes) + 2 * expert_bytes
