"""The MLX thread's hand-over and its fair order, with plain Python work (no MLX): which thread
runs what, and in which order the two queues are served. Orders are asserted, never durations."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future

import pytest

from expertmesh.node.engine.model_thread import LOCAL, PEER, ModelThread

PATIENCE_S = 30.0  # only how long a broken test may hang before failing


@pytest.fixture
def mlx():
    thread = ModelThread("test-mlx")
    yield thread
    thread.stop()


def _until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not condition():
        assert time.monotonic() < deadline, "the MLX thread never got there"
        time.sleep(0.001)


class _Gate:
    """Holds the MLX thread inside a local task until opened, so queues fill deterministically."""

    def __init__(self, mlx: ModelThread):
        self.mlx, self.inside, self.open = mlx, threading.Event(), threading.Event()
        self.caller = threading.Thread(target=lambda: mlx.call(self._hold))
        self.caller.start()
        assert self.inside.wait(PATIENCE_S)

    def _hold(self) -> None:
        self.inside.set()
        assert self.open.wait(PATIENCE_S)

    def release(self) -> None:
        self.open.set()
        self.caller.join(PATIENCE_S)


def _submit(mlx: ModelThread, kind: str, fn: Callable[[], object], expected_queued: int) -> threading.Thread:
    """Hand `fn` over from a thread of its own; returns once it is queued."""
    hand = mlx.call if kind == LOCAL else mlx.call_for_peer
    t = threading.Thread(target=lambda: hand(fn))
    t.start()
    _until(lambda: mlx.queued()[kind] == expected_queued)
    return t


def test_work_runs_on_the_thread_and_results_and_errors_come_back(mlx: ModelThread) -> None:
    assert mlx.call(threading.current_thread) is not threading.current_thread()
    assert mlx.call(lambda: threading.current_thread().name) == "test-mlx"
    assert mlx.call_for_peer(lambda x: x * 2, 21) == 42
    with pytest.raises(ZeroDivisionError):
        mlx.call(lambda: 1 / 0)
    # a call made on the thread runs at once instead of waiting for itself
    assert mlx.call(lambda: mlx.call(lambda: threading.current_thread().name)) == "test-mlx"


def test_a_generator_advances_and_closes_on_the_thread(mlx: ModelThread) -> None:
    seen: list[str] = []

    def steps():
        try:
            for i in range(5):
                seen.append(threading.current_thread().name)
                yield i
        finally:
            seen.append("closed on " + threading.current_thread().name)

    items = mlx.iterate(steps())
    assert [next(items), next(items)] == [0, 1]
    items.close()  # a caller that stops early
    assert seen == ["test-mlx", "test-mlx", "closed on test-mlx"]
    assert list(mlx.iterate(iter(range(3)))) == [0, 1, 2]


def test_the_queues_take_turns_when_both_wait(mlx: ModelThread) -> None:
    order: list[str] = []
    gate = _Gate(mlx)  # a local task runs: the peers' queue has the next turn
    threads = [_submit(mlx, LOCAL, lambda n=n: order.append(f"L{n}"), n) for n in (1, 2)]
    threads += [_submit(mlx, PEER, lambda n=n: order.append(f"P{n}"), n) for n in (1, 2, 3, 4)]
    gate.release()
    for t in threads:
        t.join(PATIENCE_S)
    assert order == ["P1", "L1", "P2", "L2", "P3", "P4"]


def test_a_flood_of_peer_calls_gets_one_turn_per_layer_of_a_local_token(mlx: ModelThread) -> None:
    order: list[str] = []
    gate = _Gate(mlx)
    peers = [_submit(mlx, PEER, lambda n=n: order.append(f"P{n}"), n) for n in range(1, 7)]

    def token() -> None:  # a forward pass of three MoE layers
        for layer in range(3):
            order.append(f"layer {layer}")
            mlx.between_layers()
        order.append("token")

    local = _submit(mlx, LOCAL, token, 1)
    gate.release()
    for t in [*peers, local]:
        t.join(PATIENCE_S)
    # after the gate the peers have a turn (P1); then the token, letting one peer in per layer
    assert order == ["P1", "layer 0", "P2", "layer 1", "P3", "layer 2", "P4", "token", "P5", "P6"]
    assert mlx.waits.peer_turns_in_local[-1] == 3  # the token waited for three peer calls, not five


def test_waiting_for_experts_or_peers_serves_waiting_peer_calls(mlx: ModelThread) -> None:
    """Two nodes computing for each other: the local task waits for a result that only a peer's
    call, queued on this same thread, produces. Waiting serves it instead of locking up."""
    answer: Future = Future()
    order: list[str] = []
    gate = _Gate(mlx)

    def token() -> str:
        order.append("token waits")
        mlx.wait([answer])
        order.append("token resumes")
        return answer.result()

    got: list[str] = []
    local = threading.Thread(target=lambda: got.append(mlx.call(token)))
    local.start()
    _until(lambda: mlx.queued()[LOCAL] == 1)
    gate.release()
    _until(lambda: "token waits" in order)
    peer = threading.Thread(
        target=lambda: mlx.call_for_peer(lambda: (order.append("peer call"), answer.set_result("done")))
    )
    peer.start()
    for t in (local, peer):
        t.join(PATIENCE_S)
    assert order == ["token waits", "peer call", "token resumes"] and got == ["done"]


def test_waiting_off_the_thread_just_waits(mlx: ModelThread) -> None:
    futures = [Future(), Future()]
    threading.Thread(target=lambda: [f.set_result(i) for i, f in enumerate(futures)]).start()
    mlx.wait(futures)
    assert [f.result() for f in futures] == [0, 1]
    mlx.between_layers()  # off the thread: nothing to do


class _Expert:
    """Stands in for a decoded expert: what must be freed as soon as nobody holds it."""


class _Awaited(Future):
    """A future that is set only once its waiter has hooked onto it (so the wait really waits)."""

    def __init__(self) -> None:
        super().__init__()
        self.hooked = threading.Event()

    def add_done_callback(self, fn) -> None:
        super().add_done_callback(fn)
        self.hooked.set()


def _set_when_hooked(futures: list[_Awaited]) -> None:
    for f in futures:
        assert f.hooked.wait(PATIENCE_S)
        f.set_result(_Expert())


@pytest.mark.parametrize("on_thread", [False, True])
def test_a_waited_result_is_freed_when_dropped_without_a_garbage_collection(mlx: ModelThread, on_thread: bool) -> None:
    # a result kept alive by a reference cycle lives until a full collection: for decoded experts
    # (MLX buffers the collector's thresholds never see) that was the whole stream, 2.8 GB at K3 size
    gc.collect()
    gc.disable()
    try:
        futures = [_Awaited(), _Awaited()]
        threading.Thread(target=_set_when_hooked, args=(futures,)).start()
        if on_thread:
            mlx.call(lambda waited=futures: mlx.wait(waited))
        else:
            mlx.wait(futures)
        freed = [weakref.ref(f.result()) for f in futures]
        del futures
        assert all(ref() is None for ref in freed), "a finished future outlived its last reference"
    finally:
        gc.enable()


def test_stop_finishes_what_is_queued_then_refuses(mlx: ModelThread) -> None:
    assert mlx.call(lambda: 1) == 1
    mlx.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        mlx.call(lambda: 2)
