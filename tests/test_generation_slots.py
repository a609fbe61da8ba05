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
from repos import KIMI_K3

from expertmesh.coordinator.generation import Coordinator, CoordinatorConfig, Finish, Usage
from expertmesh.coordinator.node_pool import MAX_NODE_SLOTS, NodePool
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
    pieces = list(coordinator.generate(ask, Usage()))
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


class _SilentAboutSlots(_OneAtATime):
    """A one-slot node whose Info never comes in time, as a node under load (a swapping Mac)."""

    def Info(self, request, context):
        context.abort(grpc.StatusCode.UNAVAILABLE, "too busy to answer")


def test_a_node_whose_info_is_not_heard_still_gets_one_at_a_time_and_no_429() -> None:
    """The API takes an unheard node for its own batch (4) and sends it 4 requests; the node
    refuses 3 as full. Those were admitted to the queue, so they wait in it again for the slot the
    node really has, instead of the client getting a 429 while the household is merely busy."""
    node = _SilentAboutSlots(slots=1)
    with fake_node(node, workers=8) as (address, _):
        config = CoordinatorConfig(secret="s", models=lambda: ["m"], generations_per_node=4)
        coordinator = Coordinator(config, NodePool([address]))
        try:
            with ThreadPoolExecutor(4) as pool:
                answers = list(pool.map(lambda _: _answer(coordinator), range(4)))
            assert answers == ["one at a time"] * 4
            assert node.refused >= 1  # the refusal happened, and was waited out
            assert coordinator.pool.slots() < 4  # fewer, learnt from the refusals: Info never came
        finally:
            coordinator.close()


def test_an_older_node_that_says_nothing_counts_for_the_configured_batch() -> None:
    pool = NodePool(["a:1", "b:2"], default_slots=3)
    pool.learn_slots("a:1", 0)  # an older node's Info has no generation_slots
    assert pool.slots() == 6
    pool.learn_slots("b:2", 1)
    assert pool.slots() == 4
    pool.learn_slots("a:1", 2**32 - 1)  # a node's Info is its word, held to what any node could run
    assert pool.slots() == MAX_NODE_SLOTS + 1
    pool.learn_slots("a:1", 3)
    with pool.using("b:2"):  # b is full: a, with room, comes first although it was listed first anyway
        assert pool.ranked()[0] == "a:1"
    with pool.using("a:1"), pool.using("a:1"):
        assert pool.ranked() == ["b:2", "a:1"]  # b has its one slot free, a has one of three left
    with pool.using("a:1"), pool.using("b:2"):
        assert pool.ranked() == ["a:1", "b:2"]  # b is full: a's free slots first despite equal load


def test_a_node_says_only_the_generations_its_threads_let_it_run(pulled_home, hub, tmp_path) -> None:
    """A `--max-batch` beyond the gRPC threads Generate may hold (16 workers less the reserve: 12)
    runs no more than those at once; an Info that said the batch had the API send it more, and
    the extra requests were refused (429) instead of waiting in the API's queue."""
    from expertmesh.assembly import build_node
    from expertmesh.node.config import HouseholdConfig, NodeConfig, RpcConfig, StoreConfig
    from expertmesh.node.rpc.client import NodeClient

    repo_id = KIMI_K3
    pulled_home("kimi_k3", tmp_path)
    config = NodeConfig(
        repo_id,
        home=tmp_path,
        node_id="wide",
        store=StoreConfig(prefetch=False, fill=False),
        household=HouseholdConfig(secret="s"),
        rpc=RpcConfig(host="127.0.0.1", port=0, max_workers=16),
        max_batch=16,
    )
    with build_node(config).start() as served, NodeClient(served.rpc.address, "s") as client:
        slots = served.service.generation_slots
        assert slots.capacity < 16  # the threads bound it
        assert client.info(IO_TIMEOUT_S).generation_slots == min(slots.running, slots.capacity)


class _Hung(node_pb2_grpc.NodeServicer):
    """A node that never answers Info (stopped, frozen), held until the test ends (its caller's
    deadline ends each call on the caller's side). `others_waiting`: at the start of each of its
    Info calls, whether an Info call to the other hung node was still waiting then."""

    def __init__(self, released: threading.Event, calls: list[grpc.ServicerContext]) -> None:
        self.released, self.calls = released, calls  # `calls`: every hung node's Info calls
        self.infos: list[grpc.ServicerContext] = []
        self.others_waiting: list[bool] = []
        self.asked = threading.Event()

    def Info(self, request, context):
        self.others_waiting.append(any(c.is_active() for c in self.calls if c not in self.infos))
        self.infos.append(context)
        self.calls.append(context)
        self.asked.set()
        self.released.wait(IO_TIMEOUT_S)
        return node_pb2.InfoResponse()

    def Generate(self, request, context):
        context.abort(grpc.StatusCode.UNAVAILABLE, "hung")


def test_hung_nodes_hold_a_request_for_one_info_deadline_once_not_each_and_every_time(monkeypatch) -> None:
    """Two nodes that never answer Info: the API asked one after the other (the first requests
    waited 3 s per hung node) and asked again every SLOTS_ASKED_S, holding every request meanwhile."""
    from expertmesh.coordinator import node_pool

    monkeypatch.setattr(node_pool, "SLOTS_ASKED_S", 0.0)  # every request finds them due again
    released, calls = threading.Event(), []
    first, second = _Hung(released, calls), _Hung(released, calls)
    try:
        with (
            fake_node(_OneAtATime(slots=2), workers=8) as (good, _),
            fake_node(first, workers=4) as (hung_1, _),
            fake_node(second, workers=4) as (hung_2, _),
        ):
            pool = NodePool([good, hung_1, hung_2])
            coordinator = Coordinator(CoordinatorConfig(secret="s", models=lambda: ["m"]), pool)
            try:
                assert _answer(coordinator) == "one at a time"  # after the first Info answers
                assert len(first.infos) == len(second.infos) == 1
                # asked at once: the one asked second found the other still waiting
                assert (first.others_waiting + second.others_waiting).count(True) == 1
                first.asked.clear()
                assert _answer(coordinator) == "one at a time"
                assert first.asked.wait(IO_TIMEOUT_S)  # asked again, in the background:
                assert first.infos[-1].is_active()  # the answer came while that Info still waited
            finally:
                coordinator.close()
    finally:
        released.set()
