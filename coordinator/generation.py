"""Routing one validated ask to the household's full nodes, as a stream of text pieces.

Each generation waits for a slot in the bounded FIFO queue (request_queue.py; as many slots as the
full nodes run generations at once, each node's own count from its Info, node_pool.py), goes to
the least busy full node with a free slot, and moves to another node if the
first fails before its first token; among nodes with a free slot, one that holds a prefix of its
prompt goes first. Stop sequences are applied here, on the streamed text, and
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

import builtins
import contextlib
import logging
import threading
from collections.abc import Callable, Generator
from concurrent import futures
from dataclasses import dataclass, field
from enum import Enum
from http import HTTPStatus

import grpc

from expertmesh.coordinator import tool_calls
from expertmesh.coordinator.api_metrics import ApiMetrics
from expertmesh.coordinator.node_pool import NodePool
from expertmesh.coordinator.openai_request import ApiError, Ask, generate_request
from expertmesh.coordinator.request_queue import LeftQueue, QueueFull, RequestQueue
from expertmesh.coordinator.stop_sequences import StopScanner
from expertmesh.node.constants import CONTEXT_LENGTH_EXCEEDED, REASON_METADATA_KEY
from expertmesh.node.rpc.admission import is_busy
from expertmesh.node.rpc.call_watch import QUIET_S, CallWatch, Watched
from expertmesh.node.rpc.client import NodeClient
from expertmesh.node.rpc.prefix_keys import held_table, message_prefix_keys
from expertmesh.v1 import node_pb2

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
class Usage:
    """The tokens one answer cost, as OpenAI's `usage` counts them; filled in as tokens arrive."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of the prompt's, those a node's prefix cache held (not computed again)
    prompt_expert_uses_substituted: int = 0  # by an approximate prompt (`prompt_experts`); 0: exact

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class TokenLogprob:
    """One generated token's log probability, as OpenAI shows it: its text, its UTF-8 bytes (a
    token that is part of a character has bytes but no whole text), and the most likely ones'."""

    token: str
    bytes: list[int]
    logprob: float
    top: list[TokenLogprob] = field(default_factory=list)

    @classmethod
    def of(cls, raw: builtins.bytes, logprob: float, top: list[TokenLogprob] | None = None) -> TokenLogprob:
        return cls(raw.decode("utf-8", errors="replace"), list(raw), logprob, top or [])


@dataclass
class Logprobs:
    """Yielded just before the text its tokens made (with `logprobs` asked only): the tokens
    whose text reaches the client, so those cut at a stop sequence are not reported either."""

    tokens: list[TokenLogprob]


class _LogprobBook:
    """Tokens' log probabilities held until their text is released by the stop scanner."""

    def __init__(self) -> None:
        self._pending: list[tuple[int, TokenLogprob]] = []  # (where its text starts, the token)
        self._received = 0  # characters received from the node

    def add(self, token: node_pb2.TokenEvent) -> None:
        top = [TokenLogprob.of(t.token_bytes, t.logprob) for t in token.top_logprobs]
        self._pending.append((self._received, TokenLogprob.of(token.token_bytes, token.logprob, top)))
        self._received += len(token.text)

    def release(self, sent: int | None) -> Logprobs | None:
        """The tokens whose text starts before character `sent` (None: all of them)."""
        n = len(self._pending) if sent is None else sum(1 for start, _ in self._pending if start < sent)
        released, self._pending = self._pending[:n], self._pending[n:]
        return Logprobs([t for _, t in released]) if released else None


@dataclass
class Finish:
    """The last item a generation yields: why it ended, as OpenAI's finish_reason."""

    reason: str  # stop | length
    stop_sequence: str | None = None  # the client's stop sequence that ended it, if one did


Piece = str | Logprobs | tool_calls.ToolCall | tool_calls.UnparsedToolCall | Finish


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
    grpc.StatusCode.CANCELLED,  # from the node (it stopped) or from the watch (it hung), not from us
)


class Fate(Enum):
    """What one node's failed attempt means for the request."""

    OURS = "ours"  # our own cancel: the client left, nobody reads the answer
    RETRY = "retry"  # nothing reached the client yet: another node may answer
    REFUSED = "refused"  # the node refused the request itself: the client's error, as is
    BROKEN = "broken"  # the answer was cut after text went out: a 502


@dataclass(frozen=True)
class Outcome:
    """A failed attempt, classified: its fate, whether the node is ranked last a while (it failed,
    rather than refused or was full), whether it was full, and what to tell."""

    fate: Fate
    node_failed: bool
    full: bool
    what: str


def classify(code: grpc.StatusCode | None, *, cancelled: bool, hung: bool, started: bool) -> Outcome:
    """The outcome of an attempt that ended in gRPC status `code`, or, with `code` None, in a stream
    that ended without a whole answer. Pure: the caller acts on it.

    `cancelled`: the request was cancelled (by its client); `hung`: the call watch gave the node up;
    `started`: text went to the client already, so the ask can no longer move to another node."""
    if code is None:
        return Outcome(Fate.BROKEN if started else Fate.RETRY, node_failed=True, full=False, what="cut")
    if code == grpc.StatusCode.CANCELLED and cancelled and not hung:
        return Outcome(Fate.OURS, node_failed=False, full=False, what="cancelled")
    what = "stopped answering" if hung else code.name.lower()
    full = code == grpc.StatusCode.RESOURCE_EXHAUSTED
    node_failed = not full and code not in _NODE_ERRORS
    if not started and (hung or code in _TRY_ANOTHER):
        return Outcome(Fate.RETRY, node_failed, full, what)
    if not started and code in _NODE_ERRORS:
        return Outcome(Fate.REFUSED, node_failed, full, what)
    return Outcome(Fate.BROKEN, node_failed, full, what)


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


class _Admission:
    """One admitted request: its place in the queue, and the nodes it tried since it got it.

    Every node refusing as full although the queue gave the request a slot means the queue
    counted slots the household does not have (a node's Info not heard in time, or another API's
    requests on it). Each node's slots are now what runs there; the request gives its slot back
    and waits in the queue again, as an admitted request should, rather than get a 429. Bounded:
    a household kept full from elsewhere ends in the 429 after FULL_ROUNDS."""

    def __init__(self, queue: RequestQueue, cancel: Cancellation):
        self.queue, self.cancel = queue, cancel
        self.tried: set[str] = set()
        self.busy: set[str] = set()  # nodes that answered RESOURCE_EXHAUSTED: every slot taken
        self.full_rounds = 0
        self._held = contextlib.ExitStack()

    def __enter__(self) -> _Admission:
        return self

    def __exit__(self, *exc: object) -> None:
        self._held.close()

    def wait(self) -> bool:
        """Wait for a slot; False if the client left meanwhile (its place went to the next one)."""
        try:
            self._held.enter_context(self.queue.slot(cancelled=lambda: self.cancel.cancelled))
        except LeftQueue:
            return False
        return not self.cancel.cancelled

    def all_full(self) -> bool:
        return bool(self.tried) and self.busy == self.tried

    def wait_again(self) -> bool:
        """Give the slot back, pause, and wait for one again; False if the client left.

        Raises QueueFull after FULL_ROUNDS rounds."""
        self.full_rounds += 1
        if self.full_rounds > FULL_ROUNDS:
            raise QueueFull(f"every full node is generating already ({len(self.busy)} asked)")
        self._held.close()
        if self.cancel.wait(min(FULL_PAUSE_MAX_S, FULL_PAUSE_S * self.full_rounds)) or not self.wait():
            return False
        self.tried.clear()
        self.busy.clear()
        return True


@dataclass
class _Progress:
    """How far one attempt got: whether text reached the client, and the usage before it began."""

    counted: int
    started: bool = False


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
            info = self._client(address).info(HEALTH_DEADLINE_S)
            self.pool.learn_slots(address, info.generation_slots)
            self.pool.learn_held(address, held_table(info.prefixes_held))
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

    def generate(self, ask: Ask, usage: Usage, cancel: Cancellation | None = None) -> Generator[Piece]:
        """Yield text pieces, log probabilities and tool calls (coordinator/tool_calls.py), then a
        Finish; `usage` is filled in as tokens arrive.

        Raises QueueFull when too many requests wait already, ApiError when no node can answer.
        Once `cancel` is cancelled it yields nothing more of use (at most a Finish)."""
        cancel = cancel or Cancellation()
        self._learn_new_nodes()
        keys = message_prefix_keys(generate_request(ask))  # where its prefix is held (node_pool.py)
        with _Admission(self.queue, cancel) as admitted:
            if not admitted.wait():
                return
            while not cancel.cancelled:  # cancelled between attempts: no generation at all
                address = self._next_node(admitted, keys)
                if address is None:
                    return
                outcome = yield from self._attempt(address, ask, usage, cancel)
                if outcome is None:
                    return
                if outcome.full:
                    admitted.busy.add(address)

    def count_tokens(self, ask: Ask) -> int:
        """The tokens of `ask`'s prompt as its model's template and tokenizer make them (the
        Messages API's count_tokens), asked of the least busy node; no queue slot: nothing runs.

        Raises ApiError: the node refused the prompt (400), every node was busy counting (429,
        which the API sends with Retry-After), or no node could answer (503)."""
        self._forget_departed()
        request = generate_request(ask)
        request.count_only = True
        tried, busy = 0, 0
        for address in self.pool.ranked(exclude=set()):
            tried += 1
            try:
                for event in self._client(address).generate(request, HEALTH_DEADLINE_S * 10):
                    if event.HasField("done"):
                        return event.done.prompt_tokens
            except grpc.RpcError as e:
                if e.code() in _NODE_ERRORS:
                    raise _refusal(e, _NODE_ERRORS[e.code()], ask.chat) from None
                busy += is_busy(e)
                logger.warning("node %s could not count tokens (%s); trying another", address, e.code().name.lower())
        if tried and busy == tried:  # a burst of counts: the client's to pace, not the household's fault
            raise ApiError(
                HTTPStatus.TOO_MANY_REQUESTS,
                f"every full node of the household is counting tokens already (tried {tried}); retry shortly",
                type_="rate_limit_error",
            )
        raise ApiError(
            HTTPStatus.SERVICE_UNAVAILABLE,
            f"no full node of the household could count the tokens (tried {tried})",
            type_="server_error",
        )

    def _next_node(self, admitted: _Admission, keys: list[bytes]) -> str | None:
        """The node the request has not tried that holds most of its prompt (message-prefix
        `keys`), else the least busy; None if its client left while it waited again for a slot.
        Raises ApiError 503 when no node is left to try."""
        while True:
            candidates = self.pool.ranked(exclude=admitted.tried, keys=keys)
            if candidates:
                admitted.tried.add(candidates[0])
                return candidates[0]
            if not admitted.all_full():
                tried = len(admitted.tried)
                raise ApiError(
                    HTTPStatus.SERVICE_UNAVAILABLE,
                    "no full node of the household could generate" + (f" (tried {tried})" if tried else ""),
                    type_="server_error",
                )
            if not admitted.wait_again():
                return None

    def _attempt(
        self, address: str, ask: Ask, usage: Usage, cancel: Cancellation
    ) -> Generator[Piece, None, Outcome | None]:
        """One node's try at the whole answer: its pieces, then None once the answer is done (or
        the client left), or the Outcome of a failure after which another node should try.

        Raises ApiError for a refusal, or a failure after text went to the client."""
        progress = _Progress(counted=usage.completion_tokens)
        with contextlib.ExitStack() as attempt:
            attempt.enter_context(self.pool.using(address))
            call = self._client(address).generate(generate_request(ask), GENERATE_DEADLINE_S)
            cancel.attach(call)
            watched = attempt.enter_context(self.watch.watching(address, call))
            try:
                yield from self._relay(address, call, watched, ask, usage, cancel, progress)
                return None
            except _Cut as e:
                code, error, detail = None, None, str(e)
            except grpc.RpcError as e:
                code, error, detail = e.code(), e, ""
            finally:
                call.cancel()  # a no-op when finished; stops the node when the client went away
        outcome = classify(code, cancelled=cancel.cancelled, hung=watched.hung, started=progress.started)
        if outcome.fate is Fate.OURS:
            yield Finish("stop")  # nobody reads this
            return None
        if outcome.node_failed:
            self.pool.failed(address)
        if outcome.fate is Fate.RETRY:
            if outcome.full:
                self.pool.full(address)
                self._learn_slots(address)  # it may have restarted with another --max-batch
            logger.warning(
                "node %s failed before its first token (%s); trying another", address, detail or outcome.what
            )
            usage.completion_tokens = progress.counted
            return outcome
        if outcome.fate is Fate.REFUSED and error is not None:
            raise _refusal(error, _NODE_ERRORS[error.code()], ask.chat) from None
        message = detail or f"the node failed mid-generation: {outcome.what}"
        raise ApiError(HTTPStatus.BAD_GATEWAY, message, type_="server_error") from None

    def _relay(
        self,
        address: str,
        call: grpc.Future,
        watched: Watched,
        ask: Ask,
        usage: Usage,
        cancel: Cancellation,
        progress: _Progress,
    ) -> Generator[Piece]:
        """The node's events as the client's pieces, stop sequences applied; raises _Cut when the
        stream ends without a whole answer, grpc.RpcError as the call fails."""
        scanner = StopScanner(ask.stop)
        book = _LogprobBook() if ask.logprobs else None
        sent = 0  # characters that went to the client
        for event in call:
            watched.heard()
            if event.HasField("token"):
                self.pool.answered(address)
                usage.completion_tokens += 1
                usage.prompt_tokens = usage.prompt_tokens or event.token.prompt_tokens
                usage.cached_tokens = usage.cached_tokens or event.token.cached_tokens
                if book is not None:
                    book.add(event.token)
                text = scanner.feed(event.token.text)
                if text:
                    progress.started = True
                    sent += len(text)
                    if book is not None and (logprobs := book.release(sent)):
                        yield logprobs
                    yield text
                for tool in tool_calls.pieces(event.token):  # never text: no stop scan
                    progress.started = True
                    yield tool
                if scanner.stopped:
                    call.cancel()
                    yield Finish("stop", scanner.matched)
                    return
                continue
            done = event.done
            reason = _FINISHED.get(done.stop_reason)
            if reason is None and not cancel.cancelled:
                raise _Cut(f"the node ended the generation early ({done.stop_reason or 'no reason'})")
            usage.prompt_tokens = done.prompt_tokens
            usage.cached_tokens = done.cached_tokens
            self.pool.learn_held(address, held_table(done.prefixes_held))
            # said to the client (body and header): the prompt was approximate
            usage.prompt_expert_uses_substituted = done.prompt_expert_uses_substituted
            tail = scanner.feed(done.trailing_text) + scanner.finish()
            if book is not None and (logprobs := book.release(None if not scanner.stopped else sent + len(tail))):
                yield logprobs
            if tail:
                yield tail
            yield from tool_calls.pieces(done)
            yield Finish("stop" if scanner.stopped or reason != "length" else "length", scanner.matched)
            return
        if not cancel.cancelled:  # an OK status without GenerationDone: not a whole answer
            raise _Cut("the node's stream ended before its generation was done")
        yield Finish("stop")

    def close(self) -> None:
        self.watch.close()
        self._asking.shutdown(wait=False, cancel_futures=True)  # a running Info ends with its channel, below
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()
