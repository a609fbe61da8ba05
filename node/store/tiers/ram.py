"""The RAM tier: decoded experts within a byte budget, kept by a replacement policy (store/policies.py).

The budget becomes a number of slots of one decoded expert's size (a model's experts share one
size). The experts a layer is using stay alive through the caller's references even when the
budget is smaller than one layer, so a tiny budget costs refetches, never wrong answers.
"""

from __future__ import annotations

import threading

from expertmesh.node.model.codec import ExpertWeights
from expertmesh.node.store.policies import DEFAULT_POLICY, make_policy
from expertmesh.node.store.stats import ExpertKey


class RamCache:
    def __init__(self, budget_bytes: int, policy: str = DEFAULT_POLICY):
        self.budget_bytes = budget_bytes
        self.policy_name = policy
        make_policy(policy, 0)  # an unknown name fails here, not at the first expert
        self._policy = None  # made at the first put, once an expert's size is known
        self._items: dict[ExpertKey, ExpertWeights] = {}
        self._lock = threading.Lock()
        self.nbytes = 0
        self.evictions = 0

    def get(self, key: ExpertKey) -> ExpertWeights | None:
        with self._lock:
            weights = self._items.get(key)
            if weights is not None:
                self._policy.access(key)
            return weights

    def put(self, key: ExpertKey, weights: ExpertWeights) -> None:
        with self._lock:
            if key in self._items:
                return
            if self._policy is None:
                self._policy = make_policy(self.policy_name, self.budget_bytes // max(1, weights.nbytes))
            _, evicted = self._policy.access(key)
            self._items[key] = weights
            self.nbytes += weights.nbytes
            for old in evicted:
                gone = self._items.pop(old, None)
                if gone is not None:
                    self.nbytes -= gone.nbytes
                    self.evictions += 1

    def slots(self, expert_bytes: int) -> int:
        """How many experts of about `expert_bytes` the budget holds."""
        return self.budget_bytes // max(1, expert_bytes)

    def keys(self) -> list[ExpertKey]:
        with self._lock:
            return list(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: ExpertKey) -> bool:
        return key in self._items
