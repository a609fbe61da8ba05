"""The API sends each full node as many generations as that node says it runs at once.

A node's `--max-batch`, and whether mlx-lm can batch its model at all, set how many Generate calls
it runs together (`InfoResponse.generation_slots`); beyond that it answers RESOURCE_EXHAUSTED. An
API that assumed its own batch for every node sent a one-at-a-time node several requests, and when
no other node had room the extra ones got a 429 instead of a place in the queue.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
from fake_nodes import fake_node

from expertmesh.coordinator.generation import Coordinator, CoordinatorConfig, Finish
from expertmesh.coordinator.node_pool import NodePool
from expertmesh.coordinator.openai_request import Ask
from expertmesh.v1 import node_pb2, node_pb2_grpc

IO_TIMEOUT_S = 20


class _OneAtATime(node_pb2_grpc.NodeServicer):
    """A full node that runs `slots` generations at once and refuses more, as a real one does."""

    def __init__(self, slots: int):
        self.slots = slots
        self._free = threading.BoundedSemaphore(slots)
        self.refused = 0
        self.running_most = 0
        self._running = 0
        self._lock = threading.Lock()

    def Info(self, request, context):
        return node_pb2.InfoResponse(node_id="one", role="full", generation_slots=self.slots)

    def Generate(self, request, context):
        if not self._free.acquire(blocking=False):
            with self._lock:
                self.refused += 1
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "every generation slot is taken")
        try:
            with self._lock:
                self._running += 1
                self.running_most = max(self.running_most, self._running)
            for word in ("one", " at", " a", " time"):
                threading.Event().wait(0.05)
                yield node_pb2.GenerateEvent(token=node_pb2.TokenEvent(id=1, text=word, prompt_tokens=3))
            yield node_pb2.GenerateEvent(done=node_pb2.GenerationDone(stop_reason="eos", generated_tokens=4))
        finally:
            with self._lock:
                self._running -= 1
            self._free.release()


def _answer(coordinator: Coordinator) -> str:
    ask = Ask(model="m", chat=False, prompt="hi", max_tokens=8)
    pieces = list(coordinator.generate(ask, {"prompt_tokens": 0, "completion_tokens": 0}))
    assert isinstance(pieces[-1], Finish) and pieces[-1].reason == "stop"
    return "".join(p for p in pieces if isinstance(p, str))


def test_a_node_that_runs_one_at_a_time_gets_one_and_the_others_wait_instead_of_a_429() -> None:
    node = _OneAtATime(slots=1)
    with fake_node(node, workers=8) as (address, _):
        # the API's own node batches 4: until a node says otherwise it is taken to run 4 as well
        config = CoordinatorConfig(secret="s", models=lambda: ["m"], generations_per_node=4)
        coordinator = Coordinator(config, NodePool([address]))
        try:
            assert coordinator.queue.depth() == (0, 0)
            with ThreadPoolExecutor(4) as pool:
                answers = list(pool.map(lambda _: _answer(coordinator), range(4)))
            assert answers == ["one at a time"] * 4  # every request answered, none refused with a 429
            assert node.running_most == 1
            assert coordinator.pool.slots() == 1  # what the node's Info said, not the API's own batch
        finally:
            coordinator.close()


def test_an_older_node_that_says_nothing_counts_for_the_configured_batch() -> None:
    pool = NodePool(["a:1", "b:2"], default_slots=3)
    pool.learn_slots("a:1", 0)  # an older node's Info has no generation_slots
    assert pool.slots() == 6
    pool.learn_slots("b:2", 1)
    assert pool.slots() == 4
    with pool.using("b:2"):  # b is full: a, with room, comes first although it was listed first anyway
        assert pool.ranked()[0] == "a:1"
    with pool.using("a:1"), pool.using("a:1"):
        assert pool.ranked() == ["b:2", "a:1"]  # b has its one slot free, a has one of three left
    with pool.using("a:1"), pool.using("b:2"):
        assert pool.ranked() == ["a:1", "b:2"]  # b is full: a's free slots first despite equal load
