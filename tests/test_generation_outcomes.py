"""The classifier of a node attempt's gRPC outcome (coordinator/generation.py): a table of what
each status means for the request, before and after text went to the client."""

from __future__ import annotations

import grpc
import pytest

from expertmesh.coordinator.generation import Fate, classify

S = grpc.StatusCode


@pytest.mark.parametrize(
    ("code", "cancelled", "hung", "started", "fate", "node_failed", "full"),
    [
        (S.CANCELLED, True, False, False, Fate.OURS, False, False),  # the client left
        (S.CANCELLED, True, True, False, Fate.RETRY, True, False),  # the watch cut a hung node
        (S.CANCELLED, False, False, False, Fate.RETRY, True, False),  # the node stopped by itself
        (S.UNAVAILABLE, False, False, False, Fate.RETRY, True, False),
        (S.UNAVAILABLE, False, False, True, Fate.BROKEN, True, False),  # text went out: a 502
        (S.RESOURCE_EXHAUSTED, False, False, False, Fate.RETRY, False, True),  # full, not failed
        (S.INVALID_ARGUMENT, False, False, False, Fate.REFUSED, False, False),
        (S.NOT_FOUND, False, False, False, Fate.REFUSED, False, False),
        (S.INTERNAL, False, False, False, Fate.BROKEN, True, False),
        (None, False, False, False, Fate.RETRY, True, False),  # a cut stream
        (None, False, False, True, Fate.BROKEN, True, False),
    ],
)
def test_each_grpc_outcome_has_one_meaning(code, cancelled, hung, started, fate, node_failed, full):
    outcome = classify(code, cancelled=cancelled, hung=hung, started=started)
    assert (outcome.fate, outcome.node_failed, outcome.full) == (fate, node_failed, full)
