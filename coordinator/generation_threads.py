"""A Coordinator generation on a thread of its own, consumed from the HTTP server's event loop.

The node client is blocking gRPC, so each generation gets a thread while the loop keeps serving
every connection; pieces cross to the loop through an asyncio queue. Threads are few by
construction: a request beyond the generation queue ends at once with QueueFull, so at most the
running and waiting generations hold one. `GenerationThreads.limit` is a backstop above that (a
flood answered 429 before a thread is even made), not the queue itself.

Leaving early — the client went away, the server stops — is `ThreadedGeneration.cancel()`,
which cancels the node's call (generation.py's Cancellation) so the node stops within a token.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus

from expertmesh.coordinator.generation import Cancellation, Coordinator, Piece, Usage
from expertmesh.coordinator.openai_request import ApiError, Ask
from expertmesh.coordinator.request_queue import QueueFull

logger = logging.getLogger(__name__)

_END = object()


@dataclass
class _Raised:
    error: BaseException


class ThreadedGeneration:
    """`async for piece in generation`: the pieces of `Coordinator.generate`, or its exception."""

    def __init__(self, coordinator: Coordinator, ask: Ask, usage: Usage, done: Callable[[], None]):
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._cancel = Cancellation()
        self._done = done
        self._ended = False
        self._thread = threading.Thread(
            target=self._run, args=(coordinator, ask, usage), name="api-generation", daemon=True
        )
        self._thread.start()

    def _post(self, item: object) -> bool:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
            return True
        except RuntimeError:  # the loop is closed: the server stopped, nobody reads any more
            return False

    def _run(self, coordinator: Coordinator, ask: Ask, usage: Usage) -> None:
        pieces = coordinator.generate(ask, usage, self._cancel)
        try:
            for piece in pieces:
                if not self._post(piece):
                    self._cancel.cancel()
                    break
        except (ApiError, QueueFull) as e:
            self._post(_Raised(e))
        except Exception as e:  # a bug: the client gets a 500, the log the traceback
            logger.exception("a generation failed")
            self._post(_Raised(ApiError(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {type(e).__name__}")))
        finally:
            pieces.close()
            self._post(_END)
            try:
                self._loop.call_soon_threadsafe(self._done)
            except RuntimeError:
                pass

    def cancel(self) -> None:
        """Stop the node's generation (a no-op once it ended)."""
        self._cancel.cancel()

    def __aiter__(self) -> ThreadedGeneration:
        return self

    async def __anext__(self) -> Piece:
        if self._ended:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _END:
            self._ended = True
            raise StopAsyncIteration
        if isinstance(item, _Raised):
            self._ended = True
            raise item.error
        return item


class GenerationThreads:
    """Starts generations, at most `limit` at once; used from the event loop's thread only."""

    def __init__(self, coordinator: Coordinator, limit: int):
        self.coordinator = coordinator
        self.limit = limit
        self.running = 0

    def start(self, ask: Ask, usage: Usage) -> ThreadedGeneration:
        """A running generation, or QueueFull when `limit` threads generate or wait already."""
        if self.running >= self.limit:
            raise QueueFull(f"{self.running} generations are running or waiting")
        self.running += 1
        try:
            return ThreadedGeneration(self.coordinator, ask, usage, self._release)
        except RuntimeError as e:  # no thread could be started: as busy as it gets
            self.running -= 1
            raise QueueFull(f"no thread for another generation ({e})") from None

    def _release(self) -> None:
        self.running -= 1
