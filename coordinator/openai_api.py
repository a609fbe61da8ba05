"""The household's front door: an OpenAI-compatible HTTP API over the full nodes' Generate.

`/v1/models`, `/v1/completions` and `/v1/chat/completions` (SSE with `stream: true`),
`/healthz`, and `/metrics` (coordinator/api_metrics.py). Each request waits for a slot in a bounded FIFO queue (429 beyond it), goes to the
least busy full node, and moves to another node if the first fails before its first token. Stop
sequences are applied here, on the streamed text, and the node's generation is cancelled at
the stop (as it is when the client goes away). Errors use OpenAI's shape, so the official
clients raise their usual exceptions with our message.

Like mlx_lm.server, this uses the standard library's threading HTTP server: one thread per
connection is right for a household's handful of clients, and it adds no dependency.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc

from expertmesh.coordinator.api_metrics import ApiMetrics
from expertmesh.coordinator.node_pool import NodePool
from expertmesh.coordinator.openai_request import ApiError, Ask, generate_request, parse_ask
from expertmesh.coordinator.request_queue import QueueFull, RequestQueue
from expertmesh.coordinator.stop_sequences import StopScanner
from expertmesh.node.rpc.client import NodeClient

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024
GENERATE_DEADLINE_S = 3600.0  # a cold Kimi K3 token can take minutes; a whole answer, up to this
HEALTH_DEADLINE_S = 3.0
RETRY_AFTER_S = 5


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


_NODE_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: HTTPStatus.BAD_REQUEST,
    grpc.StatusCode.NOT_FOUND: HTTPStatus.NOT_FOUND,
}
_TRY_ANOTHER = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
)


class Coordinator:
    """Routes validated asks to full nodes and yields (text, finish_reason) pieces."""

    def __init__(self, config: CoordinatorConfig, pool: NodePool):
        self.config = config
        self.pool = pool
        self.queue = RequestQueue(lambda: len(pool.addresses()), config.max_waiting)
        self.metrics = ApiMetrics(self.queue.depth)
        self._clients: dict[str, NodeClient] = {}
        self._lock = threading.Lock()

    def _client(self, address: str) -> NodeClient:
        """One client per node, kept open: a request then costs no connection set-up."""
        with self._lock:
            if address not in self._clients:
                self._clients[address] = NodeClient(address, self.config.secret, self.config.tls_ca)
            return self._clients[address]

    def healthy_nodes(self) -> list[str]:
        return [address for address in self.pool.addresses() if self._client(address).serving(HEALTH_DEADLINE_S)]

    def generate(self, ask: Ask, usage: dict):
        """Yield text pieces, then a Finish; `usage` is filled in as tokens arrive."""
        tried: set[str] = set()
        with self.queue.slot():
            while True:
                candidates = self.pool.ranked(exclude=tried)
                if not candidates:
                    raise ApiError(
                        HTTPStatus.SERVICE_UNAVAILABLE,
                        "no full node of the household could generate" + (f" (tried {len(tried)})" if tried else ""),
                        type_="server_error",
                    )
                address = candidates[0]
                tried.add(address)
                with self.pool.using(address):
                    call = self._client(address).generate(generate_request(ask), GENERATE_DEADLINE_S)
                    scanner = StopScanner(ask.stop)
                    started = False
                    try:
                        for event in call:
                            if event.HasField("token"):
                                started = True
                                usage["completion_tokens"] += 1
                                usage["prompt_tokens"] = usage["prompt_tokens"] or event.token.prompt_tokens
                                text = scanner.feed(event.token.text)
                                if text:
                                    yield text
                                if scanner.stopped:
                                    call.cancel()
                                    yield Finish("stop")
                                    return
                            else:
                                done = event.done
                                usage["prompt_tokens"] = done.prompt_tokens
                                tail = scanner.feed(done.trailing_text) + scanner.finish()
                                if tail:
                                    yield tail
                                yield Finish("stop" if scanner.stopped or done.stop_reason == "eos" else "length")
                                return
                        yield Finish("length")
                        return
                    except grpc.RpcError as e:
                        if e.code() == grpc.StatusCode.CANCELLED:
                            yield Finish("stop")
                            return
                        if not started and e.code() in _TRY_ANOTHER:
                            logger.warning(
                                "node %s failed before its first token (%s); trying another",
                                address,
                                e.code().name.lower(),
                            )
                            continue
                        if not started and e.code() in _NODE_ERRORS:
                            raise ApiError(
                                _NODE_ERRORS[e.code()], e.details() or "the node refused the request"
                            ) from None
                        raise ApiError(
                            HTTPStatus.BAD_GATEWAY,
                            f"the node failed mid-generation: {e.code().name.lower()}",
                            type_="server_error",
                        ) from None
                    finally:
                        call.cancel()  # no-op when finished; stops the node when the client went away

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()


class _Handler(BaseHTTPRequestHandler):
    server_version = "expertmesh"
    protocol_version = "HTTP/1.1"
    coordinator: Coordinator  # set on the subclass made per server

    def send_response(self, code: int, message: str | None = None) -> None:
        self.coordinator.metrics.record(self.path, code)
        super().send_response(code, message)

    def log_message(self, format: str, *args) -> None:  # the base class's name for it
        logger.info("%s %s", self.address_string(), format % args)

    def _json(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _error(self, e: ApiError) -> None:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == HTTPStatus.TOO_MANY_REQUESTS else None
        self._json(e.status, e.body(), headers)

    def do_GET(self) -> None:  # http.server's name
        c = self.coordinator
        if self.path.rstrip("/") == "/v1/models":
            now = int(time.time())
            self._json(
                200,
                {
                    "object": "list",
                    "data": [
                        {"id": m, "object": "model", "created": now, "owned_by": "expertmesh"}
                        for m in c.config.models()
                    ],
                },
            )
        elif self.path.rstrip("/") == "/metrics":
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            data = generate_latest(c.metrics.registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif self.path.rstrip("/") == "/healthz":
            up = c.healthy_nodes()
            running, waiting = c.queue.depth()
            body = {
                "status": "ok" if up else "no full node",
                "full_nodes": len(up),
                "running": running,
                "waiting": waiting,
            }
            self._json(200 if up else 503, body)
        else:
            self._error(ApiError(HTTPStatus.NOT_FOUND, f"no such path: {self.path}", code="not_found"))

    def _body(self) -> Any:
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            raise ApiError(HTTPStatus.BAD_REQUEST, "bad Content-Length") from None
        if length > MAX_BODY_BYTES:
            raise ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the body is over {MAX_BODY_BYTES} bytes")
        try:
            return json.loads(self.rfile.read(length) or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"the body is not valid JSON: {e}") from None

    def do_POST(self) -> None:
        path = self.path.rstrip("/")
        if path not in ("/v1/completions", "/v1/chat/completions"):
            self._error(ApiError(HTTPStatus.NOT_FOUND, f"no such path: {self.path}", code="not_found"))
            return
        c = self.coordinator
        chat = path == "/v1/chat/completions"
        try:
            ask = parse_ask(self._body(), chat, c.config.models(), c.config.default_max_tokens)
        except ApiError as e:
            self._error(e)
            return
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        usage = {"prompt_tokens": 0, "completion_tokens": 0}
        pieces = c.generate(ask, usage)
        try:
            if ask.stream:
                self._stream(ask, rid, pieces, usage)
            else:
                self._whole(ask, rid, pieces, usage)
        except QueueFull as e:
            self._error(
                ApiError(
                    HTTPStatus.TOO_MANY_REQUESTS,
                    f"the household is busy ({e}); retry later",
                    type_="rate_limit_error",
                    code="queue_full",
                )
            )
        except ApiError as e:
            self._error(e)
        except (BrokenPipeError, ConnectionResetError):
            pieces.close()  # the client went away: the generator's finally cancels the node's call

    def _choice(self, ask: Ask, text: str | None, finish: str | None, delta: bool) -> dict:
        if not ask.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        key = "delta" if delta else "message"
        content = {"content": text} if text is not None else {}
        if not delta:
            content = {"role": "assistant", "content": text or ""}
        return {"index": 0, key: content, "logprobs": None, "finish_reason": finish}

    def _envelope(self, ask: Ask, rid: str, chunk: bool) -> dict:
        kind = ("chat.completion" if ask.chat else "text_completion") + (".chunk" if chunk and ask.chat else "")
        return {"id": rid, "object": kind, "created": int(time.time()), "model": ask.model}

    @staticmethod
    def _usage(usage: dict) -> dict:
        return {**usage, "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]}

    def _whole(self, ask: Ask, rid: str, pieces, usage: dict) -> None:
        text, finish = [], "length"
        for piece in pieces:
            if isinstance(piece, Finish):
                finish = piece.reason
            else:
                text.append(piece)
        body = self._envelope(ask, rid, chunk=False)
        body.update(choices=[self._choice(ask, "".join(text), finish, delta=False)], usage=self._usage(usage))
        self._json(200, body)

    def _stream(self, ask: Ask, rid: str, pieces, usage: dict) -> None:
        first = next(pieces)  # errors before the first token are still plain HTTP errors
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

        def send(obj: dict | str) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj)
            self.wfile.write(f"data: {data}\n\n".encode())
            self.wfile.flush()

        def chunk(text: str | None, reason: str | None) -> dict:
            return {**self._envelope(ask, rid, chunk=True), "choices": [self._choice(ask, text, reason, delta=True)]}

        if ask.chat:
            send(
                {
                    **self._envelope(ask, rid, chunk=True),
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
                }
            )
        finish = "length"
        try:
            for piece in itertools.chain([first], pieces):
                if isinstance(piece, Finish):
                    finish = piece.reason
                else:
                    send(chunk(piece, None))
        except ApiError as e:  # after the first token: the stream ends with the error
            send({"error": e.body()["error"]})
            send("[DONE]")
            return
        send(chunk(None if ask.chat else "", finish))
        if ask.include_usage:
            send({**self._envelope(ask, rid, chunk=True), "choices": [], "usage": self._usage(usage)})
        send("[DONE]")


class OpenAIServer:
    """The API on `host:port` (port 0 picks a free one), served from a background thread once started."""

    def __init__(self, coordinator: Coordinator, host: str = "127.0.0.1", port: int = 8000):
        handler = type("Handler", (_Handler,), {"coordinator": coordinator})
        self.coordinator = coordinator
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.host, self.port = host, self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="openai-api", daemon=True)

    def start(self) -> OpenAIServer:
        """Serve from a background thread (the socket is bound already, so the port is known)."""
        self._thread.start()
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def stop(self) -> None:
        if self._thread.is_alive():
            self.httpd.shutdown()
        self.httpd.server_close()
        self.coordinator.close()
