"""The household's front door: an OpenAI-compatible HTTP API over the full nodes' Generate.

`/v1/models`, `/v1/completions` and `/v1/chat/completions` (SSE with `stream: true`),
Anthropic's `/v1/messages` and `/v1/messages/count_tokens`, `/healthz`, and `/metrics`
(coordinator/api_metrics.py). The parts, each in its module:

- http_server.py: the HTTP/1.1 server (asyncio and h11), with its timeouts and caps;
- api_access.py: the bearer key beyond loopback, and the Host and Origin checks;
- openai_request.py: what a request body may hold;
- anthropic_request.py, anthropic_api.py: the Messages API as a translation of the chat API's
  request and answer shapes;
- generation.py: the queue, the choice of node, failover, stop sequences, cancelling;
- generation_threads.py: a generation's blocking gRPC stream on a thread of its own.

This module maps requests to those parts and answers in OpenAI's shapes, so the official clients
raise their usual exceptions with our message. Beyond the generation queue the answer is 429
with Retry-After; a client that goes away, streaming or not, cancels its generation (the
server cancels the request's task, whose `finally` cancels the node's call).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from urllib.parse import unquote

from expertmesh.coordinator import anthropic_api, anthropic_request
from expertmesh.coordinator.api_access import AccessPolicy
from expertmesh.coordinator.generation import (
    Coordinator,
    CoordinatorConfig,
    Finish,
    Logprobs,
    Piece,
    TokenLogprob,
    Usage,
)
from expertmesh.coordinator.generation_threads import GenerationThreads, ThreadedGeneration
from expertmesh.coordinator.http_server import RETRY_AFTER_S, Exchange, HttpServer, ServerLimits
from expertmesh.coordinator.openai_request import ApiError, Ask, decode_body, parse_ask
from expertmesh.coordinator.request_queue import QueueFull
from expertmesh.coordinator.tool_calls import ToolCall, UnparsedToolCall, invalid_call, openai_call

__all__ = ["Coordinator", "CoordinatorConfig", "Finish", "OpenAIServer"]

# while a prompt is prefilled (a cold one at K3's size fetches for minutes), a streaming client
# gets an SSE comment this often, so that it and any proxy between see the connection alive
SSE_KEEPALIVE_S = 10.0
# how many of the prompt's expert uses an approximate prompt substituted (0: the prompt was exact)
SUBSTITUTED_HEADER = "X-Expertmesh-Prompt-Expert-Uses-Substituted"
GENERATION_THREAD_HEADROOM = 32  # generation threads beyond max_waiting: running ones, up to 32 per batch row
_GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
_MESSAGES_PATHS = ("/v1/messages", "/v1/messages/count_tokens")  # Anthropic's (anthropic_api.py)
_GET_PATHS = ("/v1/models", "/metrics", "/healthz")
_MODEL_PREFIX = "/v1/models/"  # + a model id, percent-encoded: OpenAI's "retrieve model"


def _busy(reason: object) -> ApiError:
    return ApiError(
        HTTPStatus.TOO_MANY_REQUESTS,
        f"the household is busy ({reason}); retry later",
        type_="rate_limit_error",
        code="queue_full",
    )


class OpenAIServer:
    """The API on `host:port` (port 0 picks a free one), served from a background thread once started.

    `access` defaults to no keys, which is allowed on loopback only (a ValueError otherwise)."""

    def __init__(
        self,
        coordinator: Coordinator,
        host: str = "127.0.0.1",
        port: int = 8000,
        *,
        access: AccessPolicy | None = None,
        limits: ServerLimits | None = None,
    ):
        self.coordinator = coordinator
        self.access = access or AccessPolicy(host)
        self.http = HttpServer(
            self._handle,
            host,
            port,
            limits,
            on_response=coordinator.metrics.record,
            name="openai-api",
            error_body=_http_error_body,
        )
        self.host, self.port = host, self.http.port
        per_node = max(1, coordinator.config.generations_per_node)
        self._threads = GenerationThreads(
            coordinator, coordinator.config.max_waiting + GENERATION_THREAD_HEADROOM * per_node
        )
        self._health: asyncio.Future | None = None  # the health round in flight
        self._parser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="api-parse")

    def start(self) -> OpenAIServer:
        """Serve from a background thread (the socket is bound already, so the port is known)."""
        self.http.start()
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def stop(self) -> None:
        self.http.stop()
        self._parser.shutdown(wait=False, cancel_futures=True)
        self.coordinator.close()

    # -- routes --------------------------------------------------------------------------------

    async def _handle(self, ex: Exchange) -> None:
        request = ex.request
        path = request.path.rstrip("/") or "/"
        try:
            refusal = self.access.refusal(request, self.port)
            if refusal is not None:
                raise refusal
            model = unquote(path[len(_MODEL_PREFIX) :]) if path.startswith(_MODEL_PREFIX) else None
            if request.method in ("GET", "HEAD") and (path in _GET_PATHS or model):
                await self._get(ex, path, model)
            elif request.method == "POST" and path in _GENERATE_PATHS:
                await self._complete(ex, chat=path == "/v1/chat/completions")
            elif request.method == "POST" and path in _MESSAGES_PATHS:
                await self._messages(ex, counting=path.endswith("/count_tokens"))
            elif path in (*_GET_PATHS, *_GENERATE_PATHS, *_MESSAGES_PATHS) or model:
                await self._error(
                    ex, ApiError(HTTPStatus.METHOD_NOT_ALLOWED, f"{request.method} is not allowed on {path}")
                )
            else:
                raise ApiError(HTTPStatus.NOT_FOUND, f"no such path: {request.path}", code="not_found")
        except QueueFull as e:
            await self._error(ex, _busy(e))
        except ApiError as e:
            if ex.status is None:
                await self._error(ex, e)

    async def _json(self, ex: Exchange, status: int, body: dict, headers: Sequence[tuple[str, str]] = ()) -> None:
        await ex.respond(status, [("Content-Type", "application/json"), *headers], json.dumps(body).encode())

    async def _error(self, ex: Exchange, e: ApiError) -> None:
        headers = []
        if e.status == HTTPStatus.TOO_MANY_REQUESTS:
            headers.append(("Retry-After", str(RETRY_AFTER_S)))
        elif e.status == HTTPStatus.UNAUTHORIZED:
            headers.append(("WWW-Authenticate", "Bearer"))
        elif e.status == HTTPStatus.METHOD_NOT_ALLOWED:
            post = ex.request.path.rstrip("/") in (*_GENERATE_PATHS, *_MESSAGES_PATHS)
            headers.append(("Allow", "POST" if post else "GET, HEAD"))
        anthropic = ex.request.path.rstrip("/") in _MESSAGES_PATHS
        await self._json(ex, e.status, anthropic_api.error_body(e) if anthropic else e.body(), headers)

    async def _get(self, ex: Exchange, path: str, model: str | None = None) -> None:
        c = self.coordinator
        now = int(time.time())
        if model is not None:  # /v1/models/{id}, the id percent-decoded (ids hold a "/")
            if model not in c.config.models():
                raise ApiError(HTTPStatus.NOT_FOUND, f"the model '{model}' is not served here", code="model_not_found")
            await self._json(ex, 200, {"id": model, "object": "model", "created": now, "owned_by": "expertmesh"})
        elif path == "/v1/models":
            models = [{"id": m, "object": "model", "created": now, "owned_by": "expertmesh"} for m in c.config.models()]
            await self._json(ex, 200, {"object": "list", "data": models})
        elif path == "/metrics":
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            await ex.respond(200, [("Content-Type", CONTENT_TYPE_LATEST)], generate_latest(c.metrics.registry))
        else:
            up = await self._healthy_nodes()
            running, waiting = c.queue.depth()
            body = {
                "status": "ok" if up else "no full node",
                "full_nodes": len(up),
                "running": running,
                "waiting": waiting,
            }
            await self._json(ex, 200 if up else 503, body)

    async def _healthy_nodes(self) -> list[str]:
        """The nodes answering gRPC health now. The checks block, so they run on the loop's
        executor, and one round serves every /healthz that arrives while it runs: probes need
        no key, and a flood of them must not become a flood of checks."""
        if self._health is None or self._health.done():
            self._health = asyncio.get_running_loop().run_in_executor(None, self.coordinator.healthy_nodes)
        return await asyncio.shield(self._health)  # a probe that leaves does not cancel the others' answer

    async def _complete(self, ex: Exchange, chat: bool) -> None:
        raw = await ex.body()
        # Off the loop: a legal 4 MB body of tiny values takes seconds to parse, and every other
        # connection (streams, /healthz) would wait for it. One parser thread: `json.loads` holds the
        # GIL while it runs, so parses side by side would stall the loop as long as all of them.
        ask = await asyncio.get_running_loop().run_in_executor(self._parser, self._parse, raw, chat)
        ask.prefix_space = self.access.prefix_space(ex.request)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        usage = Usage()
        generation = self._threads.start(ask, usage)
        try:
            if ask.stream:
                await self._stream(ex, ask, rid, generation, usage)
            else:
                await self._whole(ex, ask, rid, generation, usage)
        finally:
            generation.cancel()  # a no-op once it ended; else the client left (or the server stops)

    async def _messages(self, ex: Exchange, counting: bool) -> None:
        """Anthropic's Messages API: the request translated into a chat request (anthropic_request.py),
        the answer translated back (anthropic_api.py)."""
        raw = await ex.body()
        ask = await asyncio.get_running_loop().run_in_executor(self._parser, self._parse_messages, raw, counting)
        ask.prefix_space = self.access.prefix_space(ex.request)  # as a chat's: one key's, never another's
        if counting:
            tokens = await asyncio.get_running_loop().run_in_executor(None, self.coordinator.count_tokens, ask)
            await self._json(ex, 200, anthropic_api.count_body(tokens))
            return
        mid, rid = "msg_" + uuid.uuid4().hex[:24], "chatcmpl-" + uuid.uuid4().hex[:24]
        usage = Usage()
        generation = self._threads.start(ask, usage)
        try:
            if not ask.stream:
                completion, finish = await self._completion(ask, rid, generation, usage)
                await self._json(ex, 200, anthropic_api.message(completion, finish, usage, ask.model, mid))
                return
            events = anthropic_api.EventStream(ask.model, mid, usage)

            async def send(pairs: list[tuple[str, dict]]) -> None:
                for name, data in pairs:
                    await ex.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())

            async def start() -> None:
                await ex.start_stream(200, [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache")])
                await send(events.start())

            # as a chat stream is: a prompt that takes long to prefill gets Anthropic's own
            # keep-alive, ping events, once its stream was started with message_start
            ping = f"event: ping\ndata: {json.dumps(anthropic_api.PING)}\n\n".encode()
            waiting, started = await self._first_kept_alive(ex, generation, start, ping)
            try:
                first = waiting.result()
                if not started:
                    await start()
                    started = True
                async for chunk in self._chunks(ask, rid, first, generation):
                    await send(events.end(chunk) if isinstance(chunk, Finish) else events.chunk(chunk))
            except ApiError as e:  # after the first token, or once kept alive: the stream ends with the error
                if not started:
                    raise
                await send([("error", anthropic_api.error_body(e))])
            await ex.end_stream()
        finally:
            generation.cancel()

    def _parse_messages(self, raw: bytes, counting: bool) -> Ask:
        c = self.coordinator
        body = anthropic_request.openai_body(decode_body(raw), counting)
        return parse_ask(body, True, c.config.models(), c.config.default_max_tokens, checked=True)

    def _parse(self, raw: bytes, chat: bool) -> Ask:
        c = self.coordinator
        return parse_ask(decode_body(raw), chat, c.config.models(), c.config.default_max_tokens, checked=True)

    # -- OpenAI's response shapes --------------------------------------------------------------

    @staticmethod
    def _choice(
        ask: Ask, text: str | None, finish: str | None, delta: bool, tokens: list[TokenLogprob], offset: int = 0
    ) -> dict:
        """One choice; `tokens`: the log probabilities of the tokens behind `text` (if asked), and
        `offset` where `text` starts in the whole answer (the legacy shape counts from there).
        A chunk without tokens (the last, with the finish_reason) has null logprobs, as OpenAI's."""
        listed = ask.logprobs and (bool(tokens) or not delta)
        if not ask.chat:
            logprobs = OpenAIServer._legacy_logprobs(tokens, offset) if listed else None
            return {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        key = "delta" if delta else "message"
        content = {"content": text} if text is not None else {}
        if not delta:
            content = {"role": "assistant", "content": text or ""}
        logprobs = {"content": [OpenAIServer._chat_logprob(t) for t in tokens], "refusal": None} if listed else None
        return {"index": 0, key: content, "logprobs": logprobs, "finish_reason": finish}

    @staticmethod
    def _chat_logprob(t: TokenLogprob, top: bool = True) -> dict:
        entry = {"token": t.token, "logprob": t.logprob, "bytes": t.bytes}
        return {**entry, "top_logprobs": [OpenAIServer._chat_logprob(a, top=False) for a in t.top]} if top else entry

    @staticmethod
    def _legacy_logprobs(tokens: list[TokenLogprob], offset: int) -> dict:
        """The completions API's shape: parallel lists, the alternatives as {token: logprob}."""
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t.token)
        return {
            "tokens": [t.token for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{a.token: a.logprob for a in t.top} for t in tokens],
            "text_offset": offsets,
        }

    @staticmethod
    def _envelope(ask: Ask, rid: str, chunk: bool) -> dict:
        kind = ("chat.completion" if ask.chat else "text_completion") + (".chunk" if chunk and ask.chat else "")
        return {"id": rid, "object": kind, "created": int(time.time()), "model": ask.model}

    @staticmethod
    def _usage(u: Usage) -> dict:
        return {
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
            # OpenAI's field: prompt tokens a node's prefix cache held, so not computed again
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
            # expertmesh's: how many of the prompt's expert uses an approximate prompt
            # (`prompt_experts`) substituted; 0: exact
            "prompt_expert_uses_substituted": u.prompt_expert_uses_substituted,
        }

    async def _whole(self, ex: Exchange, ask: Ask, rid: str, pieces: ThreadedGeneration, usage: Usage) -> None:
        body, _ = await self._completion(ask, rid, pieces, usage)
        await self._json(ex, 200, body, [(SUBSTITUTED_HEADER, str(usage.prompt_expert_uses_substituted))])

    async def _completion(self, ask: Ask, rid: str, pieces: AsyncIterator[Piece], usage: Usage) -> tuple[dict, Finish]:
        """The whole answer in OpenAI's shape, and how it finished (the Messages API reads both)."""
        text, tokens, calls, invalid, finish = [], [], [], [], Finish("length")
        async for piece in pieces:
            if isinstance(piece, Finish):
                finish = piece
            elif isinstance(piece, Logprobs):
                tokens.extend(piece.tokens)
            elif isinstance(piece, ToolCall):
                calls.append(openai_call(piece))
            elif isinstance(piece, UnparsedToolCall):
                invalid.append(invalid_call(piece))
            else:
                text.append(piece)
        body = self._envelope(ask, rid, chunk=False)
        reason = "tool_calls" if calls and finish.reason == "stop" else finish.reason
        choice = self._choice(ask, "".join(text), reason, delta=False, tokens=tokens)
        if calls:  # as OpenAI answers a call: no text is null content
            choice["message"].update(content=choice["message"]["content"] or None, tool_calls=calls)
        if invalid:
            choice["message"]["invalid_tool_calls"] = invalid
        body.update(choices=[choice], usage=self._usage(usage))
        return body, finish

    async def _first_kept_alive(
        self, ex: Exchange, pieces: ThreadedGeneration, start: Callable[[], Awaitable[None]], keepalive: bytes
    ) -> tuple[asyncio.Future[Piece], bool]:
        """Wait for a stream's first piece while its prompt is prefilled (a cold one at K3's size
        fetches for minutes): every SSE_KEEPALIVE_S without it, the stream is started (`start`,
        once) and `keepalive` written, so the client and any proxy between see the connection
        alive. Returns the first piece's finished future (its result raises the generation's
        error) and whether the stream was started."""
        waiting = asyncio.ensure_future(self._first(pieces))
        started = False
        try:
            while not (await asyncio.wait({waiting}, timeout=SSE_KEEPALIVE_S))[0]:
                if not started:
                    await start()
                    started = True
                await ex.write(keepalive)
        finally:
            waiting.cancel()  # a no-op once done; else the client left while the prompt was prefilled
        return waiting, started

    @staticmethod
    async def _first(pieces: ThreadedGeneration) -> Piece:
        """The first piece, before a stream starts: errors until then are still plain HTTP errors."""
        try:
            return await anext(pieces)
        except StopAsyncIteration:
            return Finish("length")

    async def _chunks(
        self, ask: Ask, rid: str, first: Piece, pieces: AsyncIterator[Piece]
    ) -> AsyncIterator[dict | Finish]:
        """The stream's chunks in OpenAI's shape, the last with its finish_reason, then the Finish
        itself (the Messages API reads the stop sequence from it). Raises ApiError mid-way."""
        tokens: list[TokenLogprob] = []  # log probabilities of the next text's tokens
        offset = 0  # characters sent so far (the legacy logprobs count from the answer's start)

        def chunk(text: str | None, reason: str | None) -> dict:
            nonlocal offset
            choice = self._choice(ask, text, reason, delta=True, tokens=tokens, offset=offset)
            offset += len(text or "")
            tokens.clear()
            return {**self._envelope(ask, rid, chunk=True), "choices": [choice]}

        if ask.chat:
            yield {
                **self._envelope(ask, rid, chunk=True),
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
            }
        finish, calls = Finish("length"), 0
        async for piece in _chained(first, pieces):
            if isinstance(piece, Finish):
                finish = piece
            elif isinstance(piece, Logprobs):
                tokens.extend(piece.tokens)
            elif isinstance(piece, (ToolCall, UnparsedToolCall)):
                choice = self._choice(ask, None, None, delta=True, tokens=[])
                if isinstance(piece, ToolCall):
                    choice["delta"]["tool_calls"] = [openai_call(piece, index=calls)]
                    calls += 1
                else:
                    choice["delta"]["invalid_tool_calls"] = [invalid_call(piece)]
                yield {**self._envelope(ask, rid, chunk=True), "choices": [choice]}
            else:
                yield chunk(piece, None)
        yield chunk(None if ask.chat else "", "tool_calls" if calls and finish.reason == "stop" else finish.reason)
        yield finish

    async def _stream(self, ex: Exchange, ask: Ask, rid: str, pieces: ThreadedGeneration, usage: Usage) -> None:
        async def send(obj: dict | str) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj)
            await ex.write(f"data: {data}\n\n".encode())

        async def start() -> None:
            await ex.start_stream(200, [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache")])

        # errors before the first token are plain HTTP errors, unless the prompt took so long that
        # the stream was started to keep the client alive: then they end the stream, as later ones do
        waiting, started = await self._first_kept_alive(ex, pieces, start, b": prefilling the prompt\n\n")
        try:
            first = waiting.result()
            if not started:
                await start()
                started = True
            async for chunk in self._chunks(ask, rid, first, pieces):
                if isinstance(chunk, Finish):
                    continue
                if chunk["choices"] and chunk["choices"][0].get("finish_reason") is not None:
                    # a stream's headers left before the prompt ran: its last chunk says whether it was approximate
                    chunk = {**chunk, "prompt_expert_uses_substituted": usage.prompt_expert_uses_substituted}
                if ask.include_usage:  # as OpenAI's: every chunk has the field, null until the usage chunk
                    chunk = {**chunk, "usage": None}
                await send(chunk)
        except ApiError as e:  # after the first token, or once the stream was kept alive: it ends with the error
            if not started:
                raise
            await send({"error": e.body()["error"]})
            await send("[DONE]")
            await ex.end_stream()
            return
        if ask.include_usage:
            await send({**self._envelope(ask, rid, chunk=True), "choices": [], "usage": self._usage(usage)})
        await send("[DONE]")
        await ex.end_stream()


def _http_error_body(path: str, status: int, message: str) -> bytes:
    """An error the HTTP server answers itself (a body over the cap, late or malformed), in the
    shape of the API at `path`: Anthropic's clients read `error.type` (`request_too_large` for a
    413) from their own shape, OpenAI's from theirs."""
    error = ApiError(HTTPStatus(status), message, type_="server_error" if status >= 500 else "invalid_request_error")
    return json.dumps(anthropic_api.error_body(error) if path.rstrip("/") in _MESSAGES_PATHS else error.body()).encode()


async def _chained(first: Piece, rest: AsyncIterator[Piece]) -> AsyncIterator[Piece]:
    yield first
    async for piece in rest:
        yield piece
