"""Routing one validated ask to the household's full nodes, as a stream of text pieces.

Each generation waits for a slot in the bounded FIFO queue (request_queue.py; as many slots as the
full nodes run generations at once, each node's own count from its Info, node_pool.py), goes to
the least busy full node with a free slot, and moves to another node if the
first fails before its first token. Stop sequences are applied here, on the streamed text, and
the node's generation is cancelled at the stop. A `Cancellation` lets another thread stop a
generation at any moment: the HTTP server cancels when its client goes away, and cancelling the
node's Generate call (a gRPC stream) makes the node stop within a token, instead of generating for
nobody.

An answer is finished only by the node's GenerationDone with a reason it finishes for (eos,
length, context). A stream that ends without one, one the node cancelled, or one whose node died
(UNAVAILABLE) or hung (node/rpc/call_watch.py) is a cut answer: before any text went to the client the ask
moves to another node, after it the client gets a 502 error, never a finish_reason that says the
answer is whole. The failed node is ranked last for a while (node_pool.py).

The gRPC client is blocking, so `Coordinator.generate` runs on a thread of its own
(generation_threads.py); everything here is thread-safe.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Generator
from concurrent import futures
from dataclasses import dataclass
from http import HTTPStatus

import grpc

from expertmesh.coordinator.api_metrics import ApiMetrics
from expertmesh.coordinator.node_pool import NodePool
from expertmesh.coordinator.openai_request import ApiError, Ask, generate_request
from expertmesh.coordinator.request_queue import LeftQueue, QueueFull, RequestQueue
from expertmesh.coordinator.stop_sequences import StopScanner
from expertmesh.node.constants import CONTEXT_LENGTH_EXCEEDED, REASON_METADATA_KEY
from expertmesh.node.rpc.call_watch import QUIET_S, CallWatch
from expertmesh.node.rpc.client import NodeClient

logger = logging.getLogger(__name__)

GENERATE_DEADLINE_S = 3600.0  # a cold Kimi K3 token can take minutes; a whole answer, up to this
HEALTH_DEADLINE_S = 3.0
ASKING_THREADS = 8  # Info calls to nodes at once (new nodes' generation slots)
# An admitted request that finds every node full waits in the queue again this many times, pausing
# a little longer each time (a household kept full by another API's requests), before its 429.
FULL_ROUNDS = 8
FULL_PAUSE_S = 0.25
FULL_PAUSE_MAX_S = 2.0


@dataclass
class Finish:
    """The last item a generation yields: why it ended, as OpenAI's finish_reason."""

    reason: str  # stop | length


@dataclass
class CoordinatorConfig:
    secret: str
    models: Callable[[], list[str]]  # the repo ids the household serves
    tls_ca: bytes | None = None
    max_waiting: int = 16  # requests that may wait for a slot before the API answers 429
    default_max_tokens: int = 256
    # generations a full node runs at once until its Info says its own (node_pool.py)
    generations_per_node: int = 1
    # a node's stream silent this long has its health asked; not SERVING twice in a row: the node
    # is given up (node/rpc/call_watch.py)
    node_quiet_s: float = QUIET_S


class Cancellation:
    """Stops one generation from any thread: now if its node call is running, else before it starts.

    gRPC's `call.cancel()` is thread-safe and ends the node's Generate at its next token (the
    node's generator checks `context.is_active()` per token)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._call: grpc.Future | None = None
        self._event = threading.Event()
        self.cancelled = False

    def attach(self, call: grpc.Future) -> None:
        """The node call now running; cancelled at once if the cancellation came first."""
        with self._lock:
            self._call = call
            if self.cancelled:
                call.cancel()

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            self._event.set()
            if self._call is not None:
                self._call.cancel()

    def wait(self, seconds: float) -> bool:
        """Pause up to `seconds`; True as soon as the generation is cancelled."""
        return self._event.wait(seconds)


_NODE_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: HTTPStatus.BAD_REQUEST,
    grpc.StatusCode.NOT_FOUND: HTTPStatus.NOT_FOUND,
}
# GenerationDone.stop_reason -> finish_reason; any other reason ("interrupted": the node stopped
# without being asked) is a cut answer, never reported to the user as a finished one
_FINISHED = {"eos": "stop", "length": "length", "context": "length"}
_TRY_ANOTHER = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
)


def _refusal(e: grpc.RpcError, status: HTTPStatus, chat: bool) -> ApiError:
    """The node's refusal in OpenAI's shape: a prompt too long for the model's context (the
    node says so in its trailing metadata) is OpenAI's 400 `context_length_exceeded` on
    `messages` or `prompt`, the code clients look for to shorten a conversation and retry."""
    reasons = dict(e.trailing_metadata() or ()) if hasattr(e, "trailing_metadata") else {}
    error = ApiError(status, e.details() or "the node refused the request")
    if reasons.get(REASON_METADATA_KEY) == CONTEXT_LENGTH_EXCEEDED:
        error.code, error.param = CONTEXT_LENGTH_EXCEEDED, "messages" if chat else "prompt"
    return error


class _Cut(Exception):
    """The node's stream ended without a whole answer (no GenerationDone, or one it did not finish)."""


class Coordinator:
    """Routes validated asks to full nodes and yields (text, finish_reason) pieces."""

    def __init__(self, config: CoordinatorConfig, pool: NodePool):
        self.config = config
        self.pool = pool
        pool.default_slots = max(1, config.generations_per_node)  # until a node's Info says its own
        self.queue = RequestQueue(pool.slots, config.max_waiting)
        self.metrics = ApiMetrics(self.queue.depth)
        self._clients: dict[str, NodeClient] = {}
        self._lock = threading.Lock()
        self._learning = threading.Lock()  # one request at a time asks new nodes their slots
        self._asking = futures.ThreadPoolExecutor(ASKING_THREADS, thread_name_prefix="api-info")  # Info calls
        self.watch = CallWatch(lambda address, timeout_s: self._client(address).serving(timeout_s), config.node_quiet_s)

    def _client(self, address: str) -> NodeClient:
        """One client per node, kept open: a request then costs no connection set-up."""
        with self._lock:
            if address not in self._clients:
                self._clients[address] = NodeClient(address, self.config.secret, self.config.tls_ca)
            return self._clients[address]

    def _learn_slots(self, address: str) -> None:
        """Ask a node how many generations it runs at once; one that does not answer keeps the
        default and is asked again after SLOTS_ASKED_S."""
        try:
            self.pool.learn_slots(address, self._client(address).info(HEALTH_DEADLINE_S).generation_slots)
        except grpc.RpcError as e:
            logger.debug("node %s did not say its generation slots: %s", address, e.code().name.lower())
        except ValueError:  # its channel was closed under the call: the node just left
            logger.debug("node %s left while it was asked its generation slots", address)

    def _forget_departed(self) -> None:
        """Close the clients of nodes that left the household, once none of their calls runs:
        an API that runs for weeks sees nodes come and go on new addresses."""
        current, busy = set(self.pool.addresses()), self.pool.busy()
        with self._lock:
            gone = [a for a in self._clients if a not in current and not busy.get(a)]
            clients = [self._clients.pop(a) for a in gone]
        for client in clients:
            client.close()
        self.pool.forget(gone)

    def _learn_new_nodes(self) -> None:
        """Before a request takes its place in the queue: the slots of nodes not heard from yet,
        so the queue's size is the household's (a node that joined, or the first requests).
        Requests arriving meanwhile wait for the answer rather than queue on the default.

        New nodes are asked all at once, so a request waits one Info deadline at most, not one
        per node; a node that did not answer before (hung, or down) is asked again in the
        background, so it does not hold every request for its deadline each SLOTS_ASKED_S."""
        with self._learning:
            self._forget_departed()
            first, again = self.pool.to_ask()
            asked = [self._asking.submit(self._learn_slots, address) for address in first]
            for address in again:
                self._asking.submit(self._learn_slots, address)
            futures.wait(asked)

    def healthy_nodes(self) -> list[str]:
        self._forget_departed()
        return [address for address in self.pool.addresses() if self._client(address).serving(HEALTH_DEADLINE_S)]

    def generate(self, ask: Ask, usage: dict, cancel: Cancellation | None = None) -> Generator[str | Finish]:
        """Yield text pieces, then a Finish; `usage` is filled in as tokens arrive.

        Raises QueueFull when too many requests wait already, ApiError when no node can answer.
        Once `cancel` is cancelled it yields nothing more of use (at most a Finish)."""
        cancel = cancel or Cancellation()
        tried: set[str] = set()
        busy: set[str] = set()  # nodes that answered RESOURCE_EXHAUSTED: every slot taken
        full_rounds = 0
        self._learn_new_nodes()
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(self.queue.slot(cancelled=lambda: cancel.cancelled))
            except LeftQueue:
                return  # the client left while this waited: its place went to the next one
            while True:
                if cancel.cancelled:  # the client left while this waited for its slot: no generation at all
                    return
                candidates = self.pool.ranked(exclude=tried)
                if not candidates and tried and busy == tried:
                    # Every node refused as full although the queue gave this request a slot: the
                    # queue counted slots the household does not have (a node's Info not heard in
                    # time, or another API's requests on it). Each node's slots are now what runs
                    # there; the request gives its slot back and waits in the queue again, as an
                    # admitted request should, rather than get a 429. Bounded: a household kept
                    # full from elsewhere ends in the 429 after FULL_ROUNDS.
                    full_rounds += 1
                    if full_rounds > FULL_ROUNDS:
                        raise QueueFull(f"every full node is generating already ({len(busy)} asked)")
                    held.close()
                    if cancel.wait(min(FULL_PAUSE_MAX_S, FULL_PAUSE_S * full_rounds)):
                        return
                    try:
                        held.enter_context(self.queue.slot(cancelled=lambda: cancel.cancelled))
                    except LeftQueue:
                        return
                    tried.clear()
                    busy.clear()
                    continue
                if not candidates:
                    raise ApiError(
                        HTTPStatus.SERVICE_UNAVAILABLE,
                        "no full node of the household could generate" + (f" (tried {len(tried)})" if tried else ""),
                        type_="server_error",
                    )
                address = candidates[0]
                tried.add(address)
                with contextlib.ExitStack() as attempt:
                    attempt.enter_context(self.pool.using(address))
                    call = self._client(address).generate(generate_request(ask), GENERATE_DEADLINE_S)
                    cancel.attach(call)
                    watched = attempt.enter_context(self.watch.watching(address, call))
                    scanner = StopScanner(ask.stop)
                    counted = usage["completion_tokens"]
                    started = False  # text went to the client: from here a failure cannot move to another node
                    try:
                        for event in call:
                            watched.heard()
                            if event.HasField("token"):
                                self.pool.answered(address)
                                usage["completion_tokens"] += 1
                                usage["prompt_tokens"] = usage["prompt_tokens"] or event.token.prompt_tokens
                                text = scanner.feed(event.token.text)
                                if text:
                                    started = True
                                    yield text
                                if scanner.stopped:
                                    call.cancel()
                                    yield Finish("stop")
                                    return
                            else:
                                done = event.done
                                reason = _FINISHED.get(done.stop_reason)
                                if reason is None and not cancel.cancelled:
                                    raise _Cut(
                                        f"the node ended the generation early ({done.stop_reason or 'no reason'})"
                                    )
                                usage["prompt_tokens"] = done.prompt_tokens
                                # said to the client (body and header): the prompt was approximate
                                usage["prompt_expert_uses_substituted"] = done.prompt_expert_uses_substituted
                                tail = scanner.feed(done.trailing_text) + scanner.finish()
                                if tail:
                                    yield tail
                                yield Finish("stop" if scanner.stopped or reason != "length" else "length")
                                return
                        if not cancel.cancelled:  # an OK status without GenerationDone: not a whole answer
                            raise _Cut("the node's stream ended before its generation was done")
                        yield Finish("stop")
                        return
                    except _Cut as e:
                        self.pool.failed(address)
                        if not started:
                            logger.warning("node %s failed before its first token (%s); trying another", address, e)
                            usage["completion_tokens"] = counted
                            continue
                        raise ApiError(HTTPStatus.BAD_GATEWAY, str(e), type_="server_error") from None
                    except grpc.RpcError as e:
                        code = e.code()
                        if code == grpc.StatusCode.CANCELLED and cancel.cancelled and not watched.hung:
                            yield Finish("stop")  # our own cancel: the client left, nobody reads this
                            return
                        # CANCELLED otherwise came from the node (it stopped) or from the watch (it hung)
                        what = "stopped answering" if watched.hung else code.name.lower()
                        if code != grpc.StatusCode.RESOURCE_EXHAUSTED and code not in _NODE_ERRORS:
                            self.pool.failed(address)
                        if not started and (watched.hung or code in (*_TRY_ANOTHER, grpc.StatusCode.CANCELLED)):
                            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                                busy.add(address)
                                self.pool.full(address)
                                self._learn_slots(address)  # it may have restarted with another --max-batch
                            logger.warning("node %s failed before its first token (%s); trying another", address, what)
                            usage["completion_tokens"] = counted
                            continue
                        if not started and code in _NODE_ERRORS:
                            raise _refusal(e, _NODE_ERRORS[code], ask.chat) from None
                        raise ApiError(
                            HTTPStatus.BAD_GATEWAY, f"the node failed mid-generation: {what}", type_="server_error"
                        ) from None
                    finally:
                        call.cancel()  # no-op when finished; stops the node when the client went away

    def close(self) -> None:
        self.watch.close()
        self._asking.shutdown(wait=False, cancel_futures=True)  # a running Info ends with its channel, below
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()
