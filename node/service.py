"""The gRPC node service (proto/expertmesh/v1/node.proto) of a full node.

It answers for the one model it serves: what it is (Info), which experts its disk holds
(GetInventory), an expert's verified upstream bytes (FetchExpert, fetching from the Hub on a
miss when asked, as an owner does), experts run on a peer's activations (ComputeExperts, see
node/household/expert_compute.py) and generation (Generate). Requests are validated before anything is
read; a bad key is INVALID_ARGUMENT or NOT_FOUND, never an exception in a log.

No MLX work runs on gRPC's threads: Generate hands each token to the process's MLX thread and
ComputeExperts its compute (node/engine/model_thread.py), where they take turns fairly.

Generate is bounded: a call holds a gRPC worker thread for its whole stream, waiting ones too, so
unbounded they fill the pool and health checks and Info time out (peers then mark the node down).
`GenerationSlots` admits `max_batch` running and a few waiting calls; any more are answered
RESOURCE_EXHAUSTED at once, which the coordinator takes as "try another node". A call whose client
has gone stops at its next token (grpc closes the stream's generator there, and the generator's
`should_stop` sees the context inactive), and a waiting one leaves the queue. FetchExpert and
ComputeExperts, which also hold a thread for long (an owner's Hub fetch, a turn on the MLX
thread), share the peer-call slots that rpc/server.py sizes from what Generate and the reserve
leave; beyond them, RESOURCE_EXHAUSTED at once too (rpc/admission.py).

With `max_batch` 1 each call runs alone on a fresh `Generator` (and may speculate); above 1 the
running calls share one continuous batch (node/engine/batching.py): each step reads every expert
the batch routes to once, for all of them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import grpc

from expertmesh.node import constants
from expertmesh.node.config import SpeculationConfig
from expertmesh.node.engine.batching import BatchEngine, BatchingUnsupported
from expertmesh.node.engine.chat import ChatTemplateError, encode_rendered, message_ends_by_count, render_chat
from expertmesh.node.engine.constraint import TokenConstraint
from expertmesh.node.engine.generation import (
    ContextLengthError,
    GenerationSummary,
    Generator,
    PromptError,
    SamplingSettings,
    Token,
)
from expertmesh.node.engine.grammar import GrammarError, request_constraint
from expertmesh.node.engine.model_thread import model_thread
from expertmesh.node.engine.prefix_cache import CHECKPOINT_EVERY, PrefixCache
from expertmesh.node.engine.prefix_disk import PrefixDisk
from expertmesh.node.engine.prompt_experts import PromptExperts
from expertmesh.node.engine.sampling import MAX_TOP_LOGPROBS
from expertmesh.node.engine.speculative import make_draft_source
from expertmesh.node.engine.streamed_model import StreamedModel
from expertmesh.node.engine.tools import (
    Split,
    ToolCallSplitter,
    ToolFormat,
    ToolsError,
    chat_messages,
    check_renders_tools,
    tool_format,
    tools_from_json,
    wire_json,
)
from expertmesh.node.engine.vocabulary import token_bytes
from expertmesh.node.errors import Abandoned, DownloadError, ExpertmeshError, SpeculationError
from expertmesh.node.household.expert_compute import ComputeRequestError, ExpertComputer
from expertmesh.node.hub.rate_limit import GATE
from expertmesh.node.model.expert_index import ExpertBytes, ExpertLocation
from expertmesh.node.rpc.admission import BUSY, CallSlots
from expertmesh.node.rpc.call_context import CallContext
from expertmesh.node.rpc.fetch_progress import fetch_reporting_progress
from expertmesh.node.rpc.inventory import encode_inventory, layer_sizes
from expertmesh.node.rpc.prefix_keys import MAX_HELD, message_prefix_keys
from expertmesh.node.rpc.proof import Identity, ProofRefused, Prover
from expertmesh.node.sizes import parse_size
from expertmesh.node.store.integrity import sha256
from expertmesh.node.store.served import ServedExperts
from expertmesh.node.store.stats import SOURCES, StoreStats
from expertmesh.v1 import node_pb2, node_pb2_grpc

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1024 * 1024  # well under gRPC's 4 MB message limit
DEFAULT_MAX_TOKENS = 256
MAX_PROMPT_CHARS = 1_000_000
MAX_MESSAGES = 10_000
MAX_TEMPERATURE = 2.0  # as the OpenAI API's
MAX_PENALTY = 2.0  # presence and frequency penalties: OpenAI's range is -2 to 2
MAX_REPETITION_PENALTY = 10.0  # multiplicative: beyond this every repeated token is gone anyway
MAX_LOGIT_BIAS = 100.0  # as OpenAI's: -100 bans a token, 100 forces it
MAX_LOGIT_BIAS_TOKENS = 300  # as OpenAI's
CHAT_ROLES = ("system", "user", "assistant", "tool")
TOOL_CHOICES = ("", "auto", "none", "required", "function")  # GenerateRequest.tool_choice (node.proto)
COUNT_CALLS = 2  # token counts at once: they take turns at the tokenizer's lock, so more only wait
DEFAULT_WAITING_GENERATIONS = 3  # calls that may wait for the running one; more are refused
WAIT_POLL_S = 0.25  # how often a waiting call checks that its client is still there
SEED_MODULUS = 2**64  # MLX seeds are unsigned 64-bit; the proto's (and OpenAI's) are signed


class GenerationSlots:
    """Admission for Generate: `running` generations run at once (1: the model has one cache; more:
    one continuous batch of that many rows) and up to `waiting` more wait for a place, in arrival
    order; `admit` refuses any more at once.

    Why not let grpc queue them: a waiting call holds a worker thread, so the queue would be the
    thread pool itself, and health checks and Info would wait behind it.
    """

    def __init__(self, waiting: int = DEFAULT_WAITING_GENERATIONS, running: int = 1):
        self.running = max(1, running)
        self.capacity = self.running + max(0, waiting)
        self._cond = threading.Condition()
        self._admitted = 0
        self._queue: deque[object] = deque()
        self._running = 0

    def fit(self, threads: int) -> None:
        """Admit no more calls than `threads` (the worker threads Generate may hold), one at least;
        no more run at once than are admitted, so Info's `generation_slots` (what an API sends
        this node at once) is what it runs, not a `--max-batch` its threads cannot reach."""
        with self._cond:
            self.capacity = max(1, min(self.capacity, threads))
            self.running = min(self.running, self.capacity)

    def admit(self) -> bool:
        """Take a place (running or waiting); False when every place is taken. Pair with `leave`."""
        with self._cond:
            if self._admitted >= self.capacity:
                return False
            self._admitted += 1
            return True

    def leave(self) -> None:
        with self._cond:
            self._admitted -= 1

    def turn(self, still_wanted: Callable[[], bool]) -> bool:
        """Wait for this call's turn to run; False if `still_wanted` turned false first. After
        True, call `done` when the generation ends."""
        ticket = object()
        with self._cond:
            self._queue.append(ticket)
            try:
                while self._running >= self.running or self._queue[0] is not ticket:
                    if not still_wanted():
                        return False
                    self._cond.wait(WAIT_POLL_S)
                self._running += 1
                return True
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()

    def done(self) -> None:
        with self._cond:
            self._running -= 1
            self._cond.notify_all()

    def depth(self) -> tuple[int, int]:
        """(running, waiting) now."""
        with self._cond:
            return self._running, len(self._queue)

    def in_use(self) -> int:
        """Places taken now: running, waiting, and admitted calls still preparing their prompt."""
        with self._cond:
            return self._admitted


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("expertmesh")
    except PackageNotFoundError:
        return "unknown"


@dataclass
class _Prompt:
    """A Generate call's prompt as the node reads it."""

    ids: list[int]
    ends: list[int]  # where its messages end: the prefix cache's checkpoints (node/engine/prefix_cache.py)
    fmt: ToolFormat | None  # the model's tool-call format, if it has one
    tools: list[dict] | None  # the tools the request declared
    # (where its first k messages end, their key: node/rpc/prefix_keys.py): the labels of the
    # states it leaves in the prefix cache, which the node reports so its next turn comes here
    labels: list[tuple[int, bytes]] = field(default_factory=list)


class NodeService(node_pb2_grpc.NodeServicer):
    """Serves `experts` to peers; with `sm` (a loaded model) it is a full node and generates too."""

    prover: Prover | None = None  # answers Prove; set by expertmesh/assembly.py once the port is known
    # a call's prompt experts when it names none (`serve --prompt-experts`); set by expertmesh/assembly.py
    prompt_experts: PromptExperts = PromptExperts()

    def __init__(
        self,
        sm: StreamedModel | None,
        node_id: str,
        experts: ServedExperts,
        peers=None,
        speculation: SpeculationConfig | None = None,
        waiting_generations: int = DEFAULT_WAITING_GENERATIONS,
        max_batch: int = 1,
        prefix_cache_bytes: int = 0,
        prefix_dir: Path | None = None,
        prefix_disk_bytes: int = parse_size(constants.DEFAULT_PREFIX_DISK_BUDGET),
    ):
        """`speculation` (`serve --speculate`) drafts and verifies tokens in Generate; a model whose
        cache cannot roll back generates without it (logged once, here). `waiting_generations`:
        Generate calls that may wait while the running ones run (see GenerationSlots).
        `max_batch`: Generate calls decoded together in one batch (node/engine/batching.py); a
        batch cannot verify drafts exactly, so a call speculates only when it runs alone (the most
        common case at home: one person asking), and calls that come while it runs form the batch.
        A model whose caches mlx-lm cannot batch runs one call at a time (logged once, here).
        `prefix_cache_bytes`: the states of earlier prompts kept for the next request that shares
        a prefix with one (node/engine/prefix_cache.py); 0: none. `prefix_dir`: where long ones are
        kept across restarts (node/engine/prefix_disk.py), one folder a model commit, within
        `prefix_disk_bytes` (0: none kept on disk)."""
        self.sm = sm
        self.prefix: PrefixCache | None = None
        if sm is not None and prefix_cache_bytes > 0:
            disk = None
            if prefix_dir is not None and prefix_disk_bytes > 0:
                try:
                    disk = PrefixDisk(prefix_dir / sm.commit, sm.commit, prefix_disk_bytes)
                except OSError as e:  # a home that cannot hold it: prefixes stay in memory only
                    logger.warning("prompt prefixes are kept in memory only: %s", e)
            self.prefix = model_thread().call(
                PrefixCache.for_model, sm.model, prefix_cache_bytes, CHECKPOINT_EVERY, disk
            )
        self.speculation, self._draft = None, None
        self.batch: BatchEngine | None = None
        if sm is not None and max_batch > 1:
            try:
                self.batch = BatchEngine(sm, max_batch)
            except BatchingUnsupported as e:
                logger.warning("generating one request at a time: %s", e)
                max_batch = 1
        if sm is not None and speculation is not None and speculation.mode != "off":
            try:
                # one draft model for every request, loaded on the MLX thread where it runs
                draft = model_thread().call(make_draft_source, speculation, sm.tokenizer)
                Generator(sm, speculation, draft_source=draft)  # checks the model's cache can roll back
                self.speculation, self._draft = speculation, draft
            except SpeculationError as e:
                logger.warning("generating without speculation: %s", e)
        self.computer = ExpertComputer(sm) if sm is not None else None
        self.peers = peers  # the PeerTable this node follows, if any
        self.experts = experts
        self.node_id = node_id
        self.role = "full" if sm is not None else "cache"
        self.generation_slots = GenerationSlots(waiting_generations, running=max_batch if sm is not None else 1)
        # FetchExpert and ComputeExperts together (rpc/admission.py); rpc/server.py sizes them
        self.peer_call_slots = CallSlots()
        # Generate's token counts: no generation slot (nothing runs), but each holds a worker
        # thread while it waits for the tokenizer's lock; unbounded, a burst of counts of long
        # conversations (count_tokens is the API's, open to every client) would hold them all
        self.count_slots = CallSlots(COUNT_CALLS)
        # Tokenisers keep "parse special tokens or not" as shared state that each encode sets, and
        # chat encoding switches it per piece: one encode at a time keeps each piece as intended.
        self._tokenize_lock = threading.Lock()
        self._vocab: int | None = None  # the tokenizer's size, once asked (logit_bias)
        self._generated_tokens, self._generation_seconds = 0, 0.0  # of every Generate so far (for Info)
        self._generated_lock = threading.Lock()  # batched calls end on several threads at once
        self._route_lock = threading.Lock()
        self._speculating = False  # a call runs alone with speculation now

    def close(self) -> None:
        """Stop the batch engine (after the server: no call reaches it any more)."""
        if self.batch is not None:
            self.batch.close()

    # -- helpers ------------------------------------------------------------------------------

    def _model_key(self) -> node_pb2.ModelKey:
        return node_pb2.ModelKey(repo_id=self.experts.repo_id, commit=self.experts.commit)

    def _check_model(self, model: node_pb2.ModelKey, context: CallContext, allow_empty_commit: bool = False) -> None:
        ex = self.experts
        if model.repo_id != ex.repo_id or (model.commit != ex.commit and not (allow_empty_commit and not model.commit)):
            context.abort(grpc.StatusCode.NOT_FOUND, f"this node serves {ex.repo_id}@{ex.commit[:12]} only")

    # -- rpcs ---------------------------------------------------------------------------------

    def Info(self, request: node_pb2.InfoRequest, context: CallContext) -> node_pb2.InfoResponse:
        mlx_version = ""
        if self.sm is not None:
            import mlx.core as mx

            mlx_version = mx.__version__  # type: ignore[attr-defined]  # mlx's stubs omit the version it has
        disk = self.experts.disk
        stats = self.experts.stats.snapshot()
        hub = GATE.usage()  # this process's Hub requests in the Hub's current rate-limit windows
        return node_pb2.InfoResponse(
            node_id=self.node_id,
            role=self.role,
            models=[self._model_key()],
            ram_budget_bytes=self.experts.ram_budget_bytes,
            disk_budget_bytes=disk.budget_bytes,
            disk_used_bytes=disk.nbytes,
            expertmesh_version=_version(),
            mlx_version=mlx_version,
            protocol_version=constants.PROTOCOL_VERSION,
            live_peers=self.peers.live_count() if self.peers is not None else 0,
            expert_uses=stats.uses,
            expert_bytes=stats.bytes,
            generated_tokens=self._generated_tokens,
            generation_seconds=self._generation_seconds,
            ram_used_bytes=self.sm.store.ram.nbytes if self.sm is not None else 0,
            compute=self.computer is not None,
            shared_rows=self.computer is not None,
            # what an API in front of it may send at once (coordinator/node_pool.py)
            generation_slots=self.generation_slots.running if self.sm is not None else 0,
            hub_requests={bucket: u.requests for bucket, u in hub.items()},
            hub_quota={bucket: u.quota for bucket, u in hub.items() if u.quota is not None},
            prefixes_held=self._prefixes_held(),
        )

    def _prefixes_held(self) -> list[node_pb2.PrefixHeld]:
        """What the prefix cache holds, as keys (node/rpc/prefix_keys.py): where a coordinator
        sends a conversation's next turn."""
        if self.prefix is None:
            return []
        return [node_pb2.PrefixHeld(key=k, tokens=n) for k, n in self.prefix.held(MAX_HELD)]

    def Prove(self, request: node_pb2.ProveRequest, context: CallContext) -> node_pb2.ProveResponse:
        """Open to all (rpc/auth.py): this node's signed identity, for a caller that dialed one of
        its own addresses (rpc/proof.py), and nothing else."""
        if self.prover is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this node does not prove itself")
        identity = Identity(
            self.node_id,
            self.role,
            self.experts.disk.budget_bytes,
            self.computer is not None,
            constants.PROTOCOL_VERSION,
        )
        try:
            return self.prover.answer(request, identity)
        except ProofRefused as e:
            context.abort(e.code, str(e))

    def GetInventory(self, request: node_pb2.InventoryRequest, context: CallContext) -> node_pb2.InventoryResponse:
        self._check_model(request.model, context)
        layers = encode_inventory(self._layer_sizes, self.experts.disk)
        return node_pb2.InventoryResponse(model=self._model_key(), layers=layers)

    @functools.cached_property
    def _layer_sizes(self) -> dict[int, int]:
        """Experts per MoE layer, counted once: counting per call cost O(layers x experts) of
        GIL-held time on a gRPC thread (0.2 s at K3's size), and any member may ask at will."""
        return layer_sizes(self.experts.index)

    @contextlib.contextmanager
    def _peer_call(self, context: CallContext) -> Iterator[None]:
        """Hold one of the peer-call slots for the call's whole life, or refuse it at once with
        RESOURCE_EXHAUSTED when every one is taken (rpc/admission.py says why)."""
        slots = self.peer_call_slots
        if not slots.enter():
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{BUSY}: {slots.capacity} expert fetches and computations for peers run; ask another node or the Hub",
            )
        try:
            yield
        finally:
            slots.leave()

    def FetchExpert(self, request: node_pb2.FetchExpertRequest, context: CallContext) -> Iterator[node_pb2.ExpertChunk]:
        key = request.key
        self._check_model(key.model, context)
        loc = self.experts.index.experts.get((key.layer, key.expert))
        if loc is None:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{self.experts.repo_id} has no expert {key.expert} in layer {key.layer}",
            )
        with self._peer_call(context):
            yield from self._fetch_expert(request, loc, context)

    def _fetch_expert(
        self, request: node_pb2.FetchExpertRequest, loc: ExpertLocation, context: CallContext
    ) -> Iterator[node_pb2.ExpertChunk]:
        """FetchExpert once admitted: the held copy, or (`fetch_on_miss`) the owner's fetch."""
        key = request.key
        if request.keep_only:
            yield self._keep(loc, context)
            return
        blob: ExpertBytes | None = self.experts.held_copy(loc)
        if blob is None:
            if not request.fetch_on_miss:
                context.abort(grpc.StatusCode.NOT_FOUND, f"expert {key.expert} of layer {key.layer} is not held here")
            try:
                if request.progress:
                    blob = yield from fetch_reporting_progress(self.experts, loc, context)
                else:
                    blob = self.experts.fetch_as_owner(loc, context.is_active)
            except Abandoned:
                context.abort(grpc.StatusCode.CANCELLED, "the caller gave up before the owner's fetch began")
            except ExpertmeshError as e:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"fetching the expert failed: {e}")
        digest = sha256(blob)
        view = memoryview(blob)
        for start in range(0, len(blob), CHUNK_BYTES):
            chunk = node_pb2.ExpertChunk(data=bytes(view[start : start + CHUNK_BYTES]))
            if start == 0:
                chunk.size, chunk.sha256 = len(blob), digest
            yield chunk

    def _keep(self, loc: ExpertLocation, context: CallContext) -> node_pb2.ExpertChunk:
        """FetchExpert with keep_only: hold the expert (fetching it on a miss), send no bytes."""
        try:
            kept = self.experts.keep(loc, context.is_active)
        except Abandoned:
            context.abort(grpc.StatusCode.CANCELLED, "the caller gave up before the owner's fetch began")
        except ExpertmeshError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"fetching the expert failed: {e}")
        if not kept:
            disk = self.experts.disk
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the disk budget is full ({disk.nbytes} of {disk.budget_bytes} bytes): warming never evicts",
            )
        return node_pb2.ExpertChunk(size=loc.nbytes, sha256=self.experts.digests.get((loc.layer, loc.expert)) or "")

    def ComputeExperts(
        self, request: node_pb2.ComputeExpertsRequest, context: CallContext
    ) -> node_pb2.ComputeExpertsResponse:
        if self.computer is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this node is a cache peer: it serves expert bytes only")
        self._check_model(request.model, context)
        with self._peer_call(context):
            try:
                result = self.computer.compute(request)
            except ComputeRequestError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except DownloadError as e:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"fetching an expert to compute failed: {e}")
        return node_pb2.ComputeExpertsResponse(
            experts=result.outputs,
            missing=result.missing,
            compute_seconds=result.seconds,
            queued=result.queued,
            mlx_wait_seconds=result.mlx_wait_seconds,
        )

    def _check_generate(self, request: node_pb2.GenerateRequest, context: CallContext) -> None:
        """Every field of a GenerateRequest in range, or INVALID_ARGUMENT naming it: the coordinator
        checks them too, but any household member can call a node directly."""
        self._check_model(request.model, context, allow_empty_commit=True)

        def refuse(message: str) -> NoReturn:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

        if request.messages:
            if len(request.messages) > MAX_MESSAGES:
                refuse(f"at most {MAX_MESSAGES} messages")
            if any(m.role not in CHAT_ROLES for m in request.messages):
                refuse(f"a message's role must be one of {', '.join(CHAT_ROLES)}")
            if sum(len(m.content) for m in request.messages) > MAX_PROMPT_CHARS:
                refuse(f"the messages must have at most {MAX_PROMPT_CHARS} characters")
        elif not 0 < len(request.prompt) <= MAX_PROMPT_CHARS:
            refuse(f"the prompt must have 1 to {MAX_PROMPT_CHARS} characters")
        if request.max_tokens > constants.MAX_TOKENS_LIMIT:
            refuse(f"max_tokens must be at most {constants.MAX_TOKENS_LIMIT}")
        if not (math.isfinite(request.temperature) and 0 <= request.temperature <= MAX_TEMPERATURE):
            refuse(f"temperature must be a number from 0 to {MAX_TEMPERATURE:g}, not {request.temperature}")
        if not (math.isfinite(request.top_p) and 0 <= request.top_p <= 1):
            refuse(f"top_p must be a number from 0 to 1, not {request.top_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(request, name)
            if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
                refuse(f"{name} must be a number from {-MAX_PENALTY:g} to {MAX_PENALTY:g}, not {value}")
        if not (
            math.isfinite(request.repetition_penalty) and 0 <= request.repetition_penalty <= MAX_REPETITION_PENALTY
        ):
            refuse(f"repetition_penalty must be a number from 0 to {MAX_REPETITION_PENALTY:g}")
        if not (math.isfinite(request.min_p) and 0 <= request.min_p <= 1):
            refuse(f"min_p must be a number from 0 to 1, not {request.min_p}")
        if request.top_logprobs > MAX_TOP_LOGPROBS:
            refuse(f"top_logprobs must be at most {MAX_TOP_LOGPROBS}")
        if len(request.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            refuse(f"logit_bias may hold at most {MAX_LOGIT_BIAS_TOKENS} tokens")
        vocab = self._vocab_size()
        for token, bias in request.logit_bias.items():
            if token >= vocab:
                refuse(f"logit_bias names token {token}, and this model's tokens are 0 to {vocab - 1}")
            if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                refuse(f"logit_bias values must be numbers from {-MAX_LOGIT_BIAS:g} to {MAX_LOGIT_BIAS:g}")
        if request.tool_choice not in TOOL_CHOICES:  # an unknown one would be served as "auto"
            refuse(
                f"tool_choice must be one of {', '.join(repr(c) for c in TOOL_CHOICES)}, not {request.tool_choice!r}"
            )
        if request.tool_choice == "function" and not request.tool_choice_name:
            refuse("tool_choice 'function' needs tool_choice_name")
        if request.prompt_experts:
            try:
                PromptExperts.parse(request.prompt_experts)
            except ValueError as e:
                refuse(str(e))

    def _vocab_size(self) -> int:
        """The tokens the model's tokenizer knows, counted once (a large vocabulary's dict is costly)."""
        if self._vocab is None and self.sm is not None:
            with self._tokenize_lock:
                self._vocab = len(self.sm.tokenizer.get_vocab())
        return self._vocab or 0

    def _prompt_ids(
        self, sm: StreamedModel, request: node_pb2.GenerateRequest, context: CallContext, stored: bool = True
    ) -> _Prompt:
        """The prompt's tokens: a chat through its template (with its tools, node/engine/tools.py),
        message text kept as plain text (so it cannot forge a turn; node/engine/chat.py), or the
        raw prompt as the client wrote it; where its messages end, when the prefix cache
        checkpoints there; the model's tool-call format, if it has one, and the tools.

        `stored` False (a call that only counts): no message ends or labels. Finding them renders
        the template once per message count, the conversation's length squared (10,000 messages:
        minutes under the tokenizer lock, which every Generate call needs), and a call that stores
        no state has no use for them."""
        tok = sm.tokenizer
        fmt = tool_format(tok)
        with self._tokenize_lock:
            try:
                tools = tools_from_json(request.tools) if request.tools else None
                if request.messages or request.chat:
                    messages = (
                        [_chat_message(m) for m in request.messages]
                        if request.messages
                        else [{"role": "user", "content": request.prompt}]
                    )
                    messages = chat_messages(messages, tok)
                    rendered = tools if tools and request.tool_choice != "none" else None
                    text = render_chat(tok, messages, tools=rendered)
                    if rendered is not None:
                        fmt = check_renders_tools(tok, text, render_chat(tok, messages))
                    ids = encode_rendered(tok, text)
                    if self.prefix is None or not stored:
                        return _Prompt(ids, [], fmt, tools)
                    # a state that trims serves every prefix of its tokens: it needs no checkpoint,
                    # only the labels a next turn (all messages) or another conversation with the
                    # same system prompt (the first) is routed by
                    counts = None if self.prefix.checkpoints else sorted({1, len(messages)})
                    by_count = message_ends_by_count(tok, messages, ids, tools=rendered, counts=counts)
                    ends = sorted({end for _, end in by_count}) if self.prefix.checkpoints else []
                    keys = message_prefix_keys(request)
                    labels = [(end, keys[k - 1]) for k, end in by_count if k <= len(keys)]
                    return _Prompt(ids, ends, fmt, tools, labels)
            except (ChatTemplateError, ToolsError) as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return _Prompt(tok.encode(request.prompt), [], None, tools)  # a raw completion's text is the model's

    def Generate(self, request: node_pb2.GenerateRequest, context: CallContext) -> Iterator[node_pb2.GenerateEvent]:
        sm = self.sm
        if sm is None:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "this node is a cache peer: it has no core to generate with"
            )
        self._check_generate(request, context)
        if request.count_only:  # tokenising only: no generation slot, no model thread
            if not self.count_slots.enter():
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{BUSY}: {self.count_slots.capacity} token counts at once; try another node or later",
                )
            try:
                counted = len(self._prompt_ids(sm, request, context, stored=False).ids)
            finally:
                self.count_slots.leave()
            yield node_pb2.GenerateEvent(done=node_pb2.GenerationDone(prompt_tokens=counted, stop_reason="counted"))
            return
        slots = self.generation_slots
        if not slots.admit():
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this node is busy: {slots.running} generation(s) run and {slots.capacity - slots.running} wait; "
                "try another node or later",
            )
        try:
            prompt = self._prompt_ids(sm, request, context)
            constraint = self._constraint(sm, request, prompt.fmt, prompt.tools, context)
            if not slots.turn(context.is_active):
                return  # the client left while waiting
            try:
                yield from self._generate(sm, request, prompt, context, constraint)
            finally:
                slots.done()
        finally:
            slots.leave()

    def _logprob_fields(self, sm: StreamedModel, t: Token) -> dict:
        """TokenEvent's log probability fields for `t`, when its request asked for them."""
        if t.chosen is None:
            return {}
        with self._tokenize_lock:
            return {
                "logprob": t.chosen.logprob,
                "token_bytes": token_bytes(sm.tokenizer, t.id),
                "top_logprobs": [
                    node_pb2.ApiTopLogprob(
                        id=top.id, logprob=top.logprob, token_bytes=token_bytes(sm.tokenizer, top.id)
                    )
                    for top in t.chosen.top
                ],
            }

    def _constraint(
        self,
        sm: StreamedModel,
        request: node_pb2.GenerateRequest,
        fmt: ToolFormat | None,
        tools: list[dict] | None,
        context: CallContext,
    ) -> TokenConstraint | None:
        """What the request's sampling must follow (its grammar: node/engine/grammar.py), or None:
        free text. A grammar that cannot be compiled is INVALID_ARGUMENT, with the reason."""
        try:
            response_format = wire_json(request.response_format, "response_format") if request.response_format else None
            if response_format is not None and not isinstance(response_format, dict):
                raise GrammarError("response_format must be a JSON object")
            return request_constraint(
                sm.tokenizer, response_format, request.tool_choice, request.tool_choice_name, tools, fmt
            )
        except ValueError as e:  # GrammarError, or response_format that is not JSON (ToolsError)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot enforce the requested format: {e}")

    def _take_speculation(self) -> bool:
        """Whether this call runs alone with speculation (then it must give it back): only while no
        other call generates or waits, since drafts cannot be verified inside a batch. A call that
        comes while it runs goes to the batch; the two take turns on the MLX thread."""
        if self.batch is None or self.speculation is None:
            return False
        with self._route_lock:
            if self._speculating or self.batch.active() or self.generation_slots.in_use() > 1:
                return False
            self._speculating = True
            return True

    def _generate(
        self,
        sm: StreamedModel,
        request: node_pb2.GenerateRequest,
        prompt: _Prompt,
        context: CallContext,
        constraint: TokenConstraint | None = None,
    ) -> Iterator[node_pb2.GenerateEvent]:
        """Generate's stream once the call's turn has come. Tool markup the model writes is split
        out of the text into calls (node/engine/tools.py), declared tools or not."""
        settings = SamplingSettings(
            max_tokens=request.max_tokens or DEFAULT_MAX_TOKENS,
            temp=request.temperature,
            top_p=request.top_p if request.top_p > 0 else 1.0,  # the proto's 0: off
            # any int64 (OpenAI's seeds may be negative) onto MLX's uint64, one seed to one seed
            seed=request.seed % SEED_MODULUS if request.HasField("seed") else None,
            top_k=request.top_k,
            min_p=request.min_p,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty,
            logit_bias=dict(request.logit_bias),
            logprobs=request.logprobs or request.top_logprobs > 0,
            top_logprobs=request.top_logprobs,
            constraint=constraint,
            prompt_experts=PromptExperts.parse(request.prompt_experts)
            if request.prompt_experts
            else self.prompt_experts,
        )
        summary = GenerationSummary()
        splitter = ToolCallSplitter(prompt.fmt, prompt.tools) if prompt.fmt is not None else None
        alone = self._take_speculation()
        # an approximate prompt goes layer-major through a Generator of its own (the batch's prefill
        # is exact), taking turns with the batch on the MLX thread as a speculating call does
        batch = self.batch if not alone and settings.prompt_experts.exact else None
        if batch is not None:  # its tokens' expert uses are its own rows', not the whole step's
            stats = summary.routed = StoreStats()
        else:
            stats = sm.store.stats
        last, t_last, first = stats.snapshot(), time.perf_counter(), True
        space = _prefix_space(request)
        if not settings.prompt_experts.exact:  # an approximate prompt's states are never an exact one's
            space += f"\x00approximate:{settings.prompt_experts}"
        labels = prompt.labels if settings.prompt_experts.exact else []
        prefix = self.prefix.session(space, prompt.ids, prompt.ends, labels) if self.prefix is not None else None
        try:
            if batch is not None:
                tokens = batch.generate(prompt.ids, settings, lambda: not context.is_active(), summary, prefix)
            else:
                generator = Generator(sm, self.speculation, draft_source=self._draft)
                tokens = generator.generate(prompt.ids, settings, lambda: not context.is_active(), summary, prefix)
            for t in tokens:
                now, t_now = stats.snapshot(), time.perf_counter()
                d = _delta(now, last)
                split = splitter.feed(t.text) if splitter is not None else Split(t.text)
                yield node_pb2.GenerateEvent(
                    token=node_pb2.TokenEvent(
                        id=t.id,
                        text=split.text,
                        seconds=t_now - t_last,
                        expert_uses=d[0],
                        hub_bytes=d[1],
                        prompt_tokens=summary.prompt_tokens + summary.cached_tokens if first else 0,
                        cached_tokens=summary.cached_tokens if first else 0,
                        **self._logprob_fields(sm, t),
                        tool_calls=_parsed(split),
                        unparsed_tool_calls=_unparsed(split),
                    )
                )
                first = False
                last, t_last = now, t_now
        except PromptError as e:  # too long for the context, or no tokens at all
            if isinstance(e, ContextLengthError):  # a reason a caller can act on without reading the text
                context.set_trailing_metadata(((constants.REASON_METADATA_KEY, constants.CONTEXT_LENGTH_EXCEEDED),))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except DownloadError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except ExpertmeshError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        finally:
            if alone:
                with self._route_lock:
                    self._speculating = False
            with self._generated_lock:
                self._generated_tokens += summary.generated_tokens
                self._generation_seconds += summary.seconds
        spec = summary.speculation
        tail = Split(summary.trailing_text)
        if splitter is not None:
            tail = splitter.feed(summary.trailing_text)
            end = splitter.finish()
            tail = Split(tail.text + end.text, tail.calls + end.calls, tail.unparsed + end.unparsed)
        yield node_pb2.GenerateEvent(
            done=node_pb2.GenerationDone(
                prompt_tokens=summary.prompt_tokens + summary.cached_tokens,
                generated_tokens=summary.generated_tokens,
                time_to_first_token_s=summary.time_to_first_token_s,
                seconds=summary.seconds,
                stop_reason=summary.stop_reason,
                trailing_text=tail.text,
                tool_calls=_parsed(tail),
                unparsed_tool_calls=_unparsed(tail),
                expert_uses={s: summary.experts.uses[s] for s in SOURCES},
                expert_bytes={s: summary.experts.bytes[s] for s in SOURCES},
                forward_passes=spec.passes if spec else 0,
                drafted_tokens=spec.drafted if spec else 0,
                accepted_tokens=spec.accepted if spec else 0,
                cached_tokens=summary.cached_tokens,
                prefixes_held=self._prefixes_held(),
                prompt_expert_uses_substituted=summary.prompt_substituted,
            )
        )


def _chat_message(m: node_pb2.ChatMessage) -> dict:
    """A wire message as the chat template takes it (OpenAI's shape); bad JSON: INVALID_ARGUMENT."""
    out: dict = {"role": m.role, "content": m.content}
    if m.tool_calls:
        calls = wire_json(m.tool_calls, "a message's tool_calls")
        if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise ToolsError("a message's tool_calls must be a list of objects")
        out["tool_calls"] = calls
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    return out


def _parsed(split: Split) -> list[node_pb2.ToolsParsedCall]:
    return [node_pb2.ToolsParsedCall(name=c.name, arguments=c.arguments) for c in split.calls]


def _unparsed(split: Split) -> list[node_pb2.ToolsUnparsedCall]:
    return [node_pb2.ToolsUnparsedCall(text=c.text, reason=c.reason) for c in split.unparsed]


def _delta(now, before) -> tuple[int, int]:
    """(expert uses, hub bytes) between two snapshots of the store's stats."""
    uses = sum(now.uses[s] - before.uses[s] for s in SOURCES)
    return uses, now.bytes["hub"] - before.bytes["hub"]


def _prefix_space(request: node_pb2.GenerateRequest) -> str:
    """Whose stored prefixes a request may resume from: one API key's (the coordinator sends a
    hash of it, never the key); a request without one shares the loopback space."""
    return request.prefix_space
