"""A pool of threads that runs what it is given in priority order: the Hub's connections serve
demands' pieces first.

Without it a shared pool is first in, first out, and a demand that arrives after a burst of fills
waits behind every fill piece queued. The priority is the fetch's own (`FetchContext.priority`,
node/fetching.py), passed with each call.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from expertmesh.node.errors import without_locals


class PriorityPool:
    """A fixed set of threads running submitted calls, lowest priority number first, FIFO within one."""

    def __init__(self, workers: int, name: str):
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._name = name
        self._threads: list[threading.Thread] = []
        for _ in range(max(1, workers)):
            self._threads.append(self._thread())
        self._workers = len(self._threads)  # how many run (or will), retired ones not counted
        self._resize_lock = threading.Lock()
        self._started = False
        self._closed = False

    def _thread(self) -> threading.Thread:
        return threading.Thread(target=self._run, name=f"{self._name}-{len(self._threads)}", daemon=True)

    def start(self) -> None:
        if not self._started:
            self._started = True
            for t in self._threads:
                t.start()

    def resize(self, workers: int) -> None:
        """Run `workers` calls at once from now on: more threads start at once; fewer, as threads
        finish what they run (a retirement is taken before anything queued)."""
        with self._resize_lock:
            if self._closed:
                return
            workers = max(1, workers)
            while self._workers < workers:
                t = self._thread()
                self._threads.append(t)
                self._workers += 1
                if self._started:
                    t.start()
            while self._workers > workers:
                self._queue.put((-1, next(self._seq), None, (), None))
                self._workers -= 1

    @property
    def workers(self) -> int:
        return self._workers

    def submit(self, fn: Callable, *args, priority: int) -> Future:
        """Run `fn(*args)` once every call of a lower `priority` queued before it has started."""
        if not self._started or self._closed:
            raise RuntimeError("the pool is not running: nothing would run what is submitted")
        fut: Future = Future()
        self._queue.put((int(priority), next(self._seq), fn, args, fut))
        return fut

    def _run(self) -> None:
        while True:
            _, _, fn, args, fut = self._queue.get()
            if fn is None:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(without_locals(e))

    def shutdown(self) -> None:
        """Fail what is queued (its waiters wake with an error instead of waiting forever), let
        what runs finish, and join the threads (bounded)."""
        self._closed = True
        while True:
            try:
                _, _, fn, _, fut = self._queue.get_nowait()
            except queue.Empty:
                break
            if fut is not None and fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError("the pool was shut down"))
        if not self._started:
            return
        for _ in self._threads:
            self._queue.put((-1, -1, None, (), None))  # more than the threads left: a retired one took its own
        for t in self._threads:
            t.join(5.0)
