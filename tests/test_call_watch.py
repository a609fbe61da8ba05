"""The call watch (node/rpc/call_watch.py) tells a node that stalls a moment from one that hangs.

A live node can miss one health check: a Mac that swaps under a model larger than its RAM, or a
loaded machine, stalls for seconds. Giving up its call on one missed check cut the user's answer
with a 502 although the node went on a moment later; a node that misses two checks in a row is
given up. And a watch that runs for weeks keeps nothing of nodes no call waits on any more.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from expertmesh.coordinator.generation import Coordinator, CoordinatorConfig, Finish, Usage
from expertmesh.coordinator.node_pool import NodePool
from expertmesh.coordinator.openai_request import Ask
from expertmesh.node.rpc.call_watch import HEALTH_DEADLINE_S, CallWatch
from expertmesh.v1 import node_pb2, node_pb2_grpc

WAIT_S = 30  # bounds every wait below; none is a threshold the test measures


class _Call:
    """Stands in for a gRPC call: only `cancel` is used by the watch."""

    def __init__(self) -> None:
        self.cancelled = 0

    def cancel(self) -> bool:
        self.cancelled += 1
        return True


def _stopped_watch(answers: list[bool], strikes: int | None = None) -> CallWatch:
    """A watch whose rounds the test runs itself (`check`), with every call quiet at once and the
    node's health answers taken from `answers` in turn."""
    replies = iter(answers)
    kwargs = {} if strikes is None else {"strikes": strikes}
    watch = CallWatch(lambda address, timeout_s: next(replies), quiet_s=0.0, **kwargs)
    watch.close()  # no thread of its own: the rounds below are the only ones
    return watch


def test_a_node_that_misses_one_health_check_keeps_its_call() -> None:
    watch = _stopped_watch([False, True, False, False])
    call = _Call()
    with watch.watching("node:1", call) as watched:
        watch.check()  # missed: a stall, perhaps
        assert not watched.hung and call.cancelled == 0
        watch.check()  # SERVING: it was a stall
        watch.check()  # missed again: the count starts afresh
        assert not watched.hung and call.cancelled == 0
        watch.check()  # twice in a row: hung
        assert watched.hung and call.cancelled == 1


def test_one_strike_gives_a_peer_up_at_the_first_missed_check() -> None:
    watch = _stopped_watch([False], strikes=1)  # the peers tier's watch
    call = _Call()
    with watch.watching("peer:1", call) as watched:
        watch.check()
        assert watched.hung and call.cancelled == 1


def test_nothing_is_kept_of_nodes_no_call_waits_on() -> None:
    watch = _stopped_watch([False] * 20)
    for n in range(10):  # nodes come and go on new addresses for weeks
        with watch.watching(f"10.0.0.{n}:1", _Call()):
            watch.check()
    watch.check()
    assert watch._asked == {} and watch._failed == {}


# -- through the coordinator, over real gRPC ---------------------------------------------------


class _SlowOnce(health.HealthServicer):
    """Health that answers its first check too late (a node stalled a moment), then at once."""

    def __init__(self) -> None:
        super().__init__()
        self.checks = 0
        self.answered_again = threading.Event()
        self.set("", health_pb2.HealthCheckResponse.SERVING)

    def Check(self, request, context):
        self.checks += 1
        if self.checks == 1:
            threading.Event().wait(HEALTH_DEADLINE_S + 1.0)  # past the caller's deadline
        else:
            self.answered_again.set()
        return super().Check(request, context)


class _Pausing(node_pb2_grpc.NodeServicer):
    """Two tokens, a silence until its health has been asked again (a long step), two more, done."""

    def __init__(self, hs: _SlowOnce) -> None:
        self.hs = hs

    def Info(self, request, context):
        return node_pb2.InfoResponse(node_id="pausing", role="full", generation_slots=1)

    def Generate(self, request, context):
        for i in range(2):
            yield node_pb2.GenerateEvent(token=node_pb2.TokenEvent(id=i, text=f"{i} ", prompt_tokens=3))
        while context.is_active() and not self.hs.answered_again.wait(0.05):
            if self.hs.checks > 5:  # bounded: the test fails, it never hangs
                break
        for i in range(2, 4):
            yield node_pb2.GenerateEvent(token=node_pb2.TokenEvent(id=i, text=f"{i} ", prompt_tokens=3))
        yield node_pb2.GenerateEvent(done=node_pb2.GenerationDone(prompt_tokens=3, stop_reason="length"))


@contextlib.contextmanager
def _stalling_node() -> Iterator[tuple[str, _SlowOnce]]:
    server = grpc.server(futures.ThreadPoolExecutor(4))
    hs = _SlowOnce()
    node_pb2_grpc.add_NodeServicer_to_server(_Pausing(hs), server)
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", hs
    finally:
        server.stop(0).wait()


def test_a_node_that_stalls_past_one_health_check_finishes_the_answer() -> None:
    with _stalling_node() as (address, hs):
        config = CoordinatorConfig(secret="s", models=lambda: ["m"], node_quiet_s=0.2)
        coordinator = Coordinator(config, NodePool([address]))
        try:
            ask = Ask(model="m", chat=False, prompt="p", max_tokens=4)
            pieces = list(coordinator.generate(ask, Usage()))
            assert "".join(p for p in pieces if isinstance(p, str)) == "0 1 2 3 "  # not a 502 after "0 1 "
            assert pieces[-1] == Finish("length")
            assert hs.checks >= 2
        finally:
            coordinator.close()


@pytest.mark.parametrize("moved", [False, True])
def test_a_call_is_cancelled_when_its_caller_stops_waiting(moved: bool) -> None:
    """The peers tier sets when it stops waiting on an owner, and moves it as the owner's progress
    comes (household/owner_wait.py): the watch cancels the call then, and only then."""
    watch = _stopped_watch([True] * 4)  # SERVING: only its end gives the call up
    call = _Call()
    with watch.watching("owner:1", call) as watched:
        watch.give_up_at(watched, 0.0)  # long past
        if moved:
            watch.give_up_at(watched, float("inf"))  # progress moved the end on
        watch.check()
        assert (watched.gave_up, call.cancelled) == ((False, 0) if moved else (True, 1))
        watch.check()
        assert call.cancelled == (0 if moved else 1)  # once
