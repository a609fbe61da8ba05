"""The one thread of the process that runs MLX, and the fair order of the work it is handed.

Why one thread: MLX's Metal backend crashes when two threads encode at once (command-encoder and
stream-map races), and since MLX 0.32 streams belong to the thread that made them: a lazy array
built on one thread cannot even be evaluated on another ("There is no Stream(cpu, 0) in current
thread"). So every MLX graph of the process is built and evaluated here — loading a core, each
generated token (speculation's drafts and verify passes included), peers' ComputeExperts, the
8-bit core quantisation — and other threads hand their work over with `call` and wait for it.
Threads that only move bytes (fetch workers, gRPC, the Hub pool) never evaluate: experts are
decoded into MLX arrays straight from buffers (node/model/codec.py), which encodes no GPU work.
It is one thread per process, not per node, so an in-process household (tests, benchmarks)
follows the same rule a Mac needs.

Fairness between this node's generation and peers' calls, two queues:
- between tasks, when both queues wait, the thread alternates (round robin): a local task (one
  generated token) then one peer call, then a local task...;
- inside a token's forward pass, each MoE layer that syncs gives one waiting peer call its turn
  after its sync (`between_layers`), so a peer waits for about one layer's work, never a whole
  generation (a pass whose layers all run resident, without a sync, lets it in after the token);
- while a token waits for experts to arrive or for peers to answer (`wait`), every waiting peer
  call runs: the thread is idle anyway, and two nodes waiting on each other's calls never lock.
A local token therefore waits for at most one peer call per MoE layer plus one, however many
are queued. benchmarks/bench_model_thread.py measures both waits side by side.

Everything runs on mlx-lm's `generation_stream` (a thread-local stream of the default device:
here, this thread's own), as `mlx_lm.generate` evaluates.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

T = TypeVar("T")
LOCAL, PEER = "local", "peer"
WAITS_KEPT = 10_000  # recent waits of each kind kept for benchmarks and tests
_STOP_JOIN_S = 30.0


class Waitable(Protocol):
    """A concurrent.futures.Future or a grpc.Future: what `ModelThread.wait` waits on."""

    def done(self) -> bool: ...

    def add_done_callback(self, fn: Callable[[Any], None]) -> None: ...


@dataclass
class _Task:
    fn: Callable[[], Any] | None  # dropped once run: what it captured is freed with the caller's references
    kind: str
    queued: float = field(default_factory=time.perf_counter)
    started: float = 0.0
    lent: float = 0.0  # seconds this (local) task spent running peer calls in its turns
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


@dataclass
class Waits:
    """Recent waits in seconds, per kind: a peer call's from hand-over to its start; a local
    task's from hand-over to its start plus the peer calls it let run inside it."""

    local: deque[float] = field(default_factory=lambda: deque(maxlen=WAITS_KEPT))
    peer: deque[float] = field(default_factory=lambda: deque(maxlen=WAITS_KEPT))
    peer_turns_in_local: deque[int] = field(default_factory=lambda: deque(maxlen=WAITS_KEPT))

    def clear(self) -> None:
        self.local.clear()
        self.peer.clear()
        self.peer_turns_in_local.clear()


class ModelThread:
    """The MLX thread: `call` runs a function on it and returns its result (or raises its error).

    A call made on the thread itself runs at once (work that hands over more work never waits
    for itself).
    """

    def __init__(self, name: str = "expertmesh-mlx"):
        self.name = name
        self.waits = Waits()
        self._cond = threading.Condition()
        self._queues: dict[str, deque[_Task]] = {LOCAL: deque(), PEER: deque()}
        self._peer_turn = False  # round robin: whose turn when both queues wait
        self._current: _Task | None = None  # the local task running, for its `lent` time
        self._turns = 0  # peer calls run inside the current local task
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._ident: int | None = None

    # -- handing work over --------------------------------------------------------------------

    def is_current(self) -> bool:
        """Whether the caller is this thread."""
        return threading.get_ident() == self._ident

    def queued(self) -> dict[str, int]:
        """Tasks waiting now, by kind."""
        with self._cond:
            return {kind: len(q) for kind, q in self._queues.items()}

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on this thread as local work (this node's own)."""
        return self._call(LOCAL, fn, args, kwargs)

    def call_for_peer(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on this thread as a peer's work, in the peers' queue."""
        return self._call(PEER, fn, args, kwargs)

    def iterate(self, items: Iterator[T]) -> Iterator[T]:
        """`items` advanced on this thread, one item per turn: a generation is handed over token
        by token, so peers' calls get their turns between tokens. Closing the result (a caller
        that stops early) closes `items` on this thread too, so its `finally` blocks run here."""
        if self.is_current():
            yield from items
            return
        done = object()
        try:
            while True:
                item = self.call(next, items, done)
                if item is done:
                    return
                yield item
        finally:
            close = getattr(items, "close", None)  # a generator's: its `finally` blocks run here
            if close is not None:
                self.call(close)

    def _call(self, kind: str, fn: Callable[..., T], args: tuple, kwargs: dict) -> T:
        if self.is_current():
            return fn(*args, **kwargs)
        task = _Task(lambda: fn(*args, **kwargs), kind)
        with self._cond:
            if self._stopping:
                raise RuntimeError("the MLX thread has stopped (the process is exiting)")
            self._ensure_started()
            self._queues[kind].append(task)
            self._cond.notify_all()
        task.done.wait()
        if task.error is not None:
            raise task.error
        return task.result

    # -- turns inside a local task ------------------------------------------------------------

    def between_layers(self) -> None:
        """At a layer boundary of a local forward pass: one waiting peer call runs. A no-op on
        any other thread, or when no peer waits."""
        if not self.is_current():
            return
        task = self._pop(PEER)
        if task is not None:
            self._lend(task)

    def wait(self, futures: Iterable[Waitable]) -> None:
        """Return once every future is done. On this thread, run waiting peer calls meanwhile (the
        thread would idle, and a peer waiting on our own call to it must not wait on us)."""
        pending = [f for f in futures if not f.done()]
        if not pending:
            return
        if not self.is_current():
            _wait_all(pending)
            return

        def arrived(_f: Any) -> None:
            with self._cond:
                self._cond.notify_all()

        for f in pending:
            f.add_done_callback(arrived)
        while True:
            with self._cond:
                while not self._queues[PEER] and not all(f.done() for f in pending):
                    self._cond.wait()
                if all(f.done() for f in pending):
                    return
                task = self._queues[PEER].popleft()
            self._lend(task)

    def _lend(self, task: _Task) -> None:
        """Run a peer call inside the current local task, charging its time to that task's wait."""
        t0 = time.perf_counter()
        self._execute(task)
        if self._current is not None:
            self._current.lent += time.perf_counter() - t0
            self._turns += 1

    # -- the thread ---------------------------------------------------------------------------

    def _ensure_started(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()

    def _pop(self, kind: str) -> _Task | None:
        with self._cond:
            return self._queues[kind].popleft() if self._queues[kind] else None

    def _next(self) -> _Task | None:
        """The next task by the round robin; None once stopping with nothing left."""
        with self._cond:
            local, peer = self._queues[LOCAL], self._queues[PEER]
            while not local and not peer:
                if self._stopping:
                    return None
                self._cond.wait()
            if peer and (self._peer_turn or not local):
                self._peer_turn = False
                return peer.popleft()
            self._peer_turn = True
            return local.popleft()

    def _loop(self) -> None:
        import mlx.core as mx
        from mlx_lm.generate import generation_stream

        self._ident = threading.get_ident()
        try:
            with mx.stream(generation_stream):  # thread-local: this thread's own
                while (task := self._next()) is not None:
                    if task.kind == LOCAL:
                        self._current, self._turns = task, 0
                    self._execute(task)
                    if task.kind == LOCAL:
                        self.waits.local.append(task.started - task.queued + task.lent)
                        self.waits.peer_turns_in_local.append(self._turns)
                        self._current = None
                    task = None  # its result (logits, experts) is the caller's now, not kept until the next task
        finally:
            # This thread's streams go now, while `stop` waits for it. Left to the thread's C++
            # exit they were torn down while the interpreter finalised, and MLX 0.32 aborted the
            # process now and then ("terminate called without an active exception").
            mx.synchronize()
            mx.clear_streams()

    def _execute(self, task: _Task) -> None:
        task.started = time.perf_counter()
        if task.kind == PEER:
            self.waits.peer.append(task.started - task.queued)
        fn, task.fn = task.fn, None
        try:
            if fn is None:
                raise RuntimeError("a task of the MLX thread runs once")
            task.result = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller, who raises it
            task.error = e
        finally:
            del fn
            task.done.set()

    def stop(self) -> None:
        """Finish what is queued, then end the thread (at exit: MLX must be idle by then)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(_STOP_JOIN_S)


_instance: ModelThread | None = None
_instance_lock = threading.Lock()


def model_thread() -> ModelThread:
    """This process's MLX thread (made on first use, stopped at exit)."""
    global _instance
    with _instance_lock:
        if _instance is None:
            _instance = ModelThread()
            atexit.register(_instance.stop)
        return _instance


def _wait_all(pending: list[Waitable]) -> None:
    """Block until every future in `pending` is done.

    The callbacks hold a countdown, never the futures: a callback that referred to the list of
    futures would make each future part of a reference cycle, and a finished fetch's decoded
    expert (megabytes of MLX buffers, invisible to the garbage collector's thresholds) would
    stay alive until a full collection happened to run.
    """
    left = [len(pending)]
    lock, event = threading.Lock(), threading.Event()

    def one_done(_f: Any) -> None:
        with lock:
            left[0] -= 1
            if left[0] == 0:
                event.set()

    for f in pending:
        f.add_done_callback(one_done)
    event.wait()
