"""The API's HTTP/1.1 server: one asyncio event loop for every connection, h11 for the protocol.

Why not the standard library's ThreadingHTTPServer: a thread per connection and no limit at all,
so idle connections exhaust the node's file descriptors (and then its gRPC clients fail), a
negative `Content-Length` skips the body cap, a short body holds a thread forever, a chunked body
is parsed as a second request, and a burst of requests meets a listen backlog of 5.

Why asyncio and h11 rather than uvicorn or aiohttp: an idle connection here costs a socket and a
few kB of memory, no thread. h11 is the HTTP/1.1 state machine uvicorn itself uses: pure
Python, no I/O of its own, well kept, and already installed with httpx2 (-> httpcore2 -> h11). It
does the parts that are easy to get wrong: request-line and header syntax (a garbage line is a
RemoteProtocolError, answered 400 with one log line and no traceback), Content-Length
validation (negative, malformed, conflicting), chunked bodies (decoded, so they are never taken
for a request), header size. What the API needs on top — timeouts, a connection cap, the body
cap, flow control, cancelling a request when its client leaves — is this module. uvicorn would
add an ASGI layer and a server meant to own the process (signals, logging, its own loop), in a
node whose process belongs to gRPC and MLX.

Limits (`ServerLimits`, each value with its reason):
- at most `max_connections` open (and never more than half the open-file limit, open_files.py);
  a new connection beyond that closes the connection idle the longest (waiting for a request,
  or still sending one), and only when every one is busy with a request is the new one
  answered 503 with Retry-After and closed: cheap, and never a reset;
- a listen backlog of 1,024 (the kernel may clamp it: macOS to 128 by default);
- an idle connection is closed after `idle_timeout_s`, a request head must arrive within
  `header_timeout_s` of its first byte (else 408), its body within `body_timeout_s` (else 408);
- a body over `max_body_bytes` is refused 413 before it is read (Content-Length) or as soon as
  it is over (chunked); both Content-Length and Transfer-Encoding in one request is refused 400
  (request smuggling);
- an answer the client stops reading for `write_timeout_s` drops the connection.

When a client closes its connection (or half-closes it: HTTP clients do not) while its request
is handled, the request's task is cancelled at once, whatever it awaits: the API's handler then
cancels its generation. Only bytes pipelined beyond `max_buffered_bytes` pause reading, and with
it that detection, until the answer is written.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from urllib.parse import urlsplit

import h11

from expertmesh.coordinator.open_files import connection_cap

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 5
STOP_GRACE_S = 5.0


@dataclass(frozen=True)
class ServerLimits:
    """What clients may cost the server, alone or together."""

    max_connections: int = 4096  # thousands of idle clients fit; see open_files.py for the real cap
    backlog: int = 1024  # connections the kernel queues before they are accepted
    idle_timeout_s: float = 30.0  # clients keep idle connections 5 s (httpx); this closes forgotten ones
    header_timeout_s: float = 10.0  # from a request's first byte to the end of its head
    body_timeout_s: float = 30.0  # the head to the end of the body: 4 MB at about 1 Mbit/s
    write_timeout_s: float = 60.0  # a client that reads nothing of its answer this long is gone
    max_header_bytes: int = 32 * 1024  # OpenAI clients send about 1 kB
    max_body_bytes: int = 4 * 1024 * 1024  # far above any prompt a node accepts
    max_buffered_bytes: int = 64 * 1024  # read ahead of the request being handled before reading pauses


class ClientGone(Exception):
    """The client closed its connection, or stopped reading its answer."""


class HttpError(Exception):
    """A request refused at the HTTP level: the connection is answered `status` and closed."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class Request:
    method: str
    path: str  # without the query
    query: str
    headers: dict[str, str]  # lower-case names; a repeated header's values joined with ", "
    http_version: str
    client: str  # the peer's "address:port", for the log
    local_address: str  # the address of this machine the client connected to


Handler = Callable[["Exchange"], Awaitable[None]]
# The body of an error the server answers itself (a body too large, late or malformed, a failed
# handler), from the request's path ("" before a request head was read), its status and message:
# the API behind a path decides the shape its clients parse.
ErrorBody = Callable[[str, int, str], bytes]


def error_body(message: str, type_: str = "invalid_request_error") -> bytes:
    """OpenAI's error shape, so clients show our message for refusals made here too."""
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": None}}).encode()


def openai_error_body(path: str, status: int, message: str) -> bytes:
    """The default ErrorBody: OpenAI's shape on every path, a server error typed as one."""
    return error_body(message, "server_error" if status >= 500 else "invalid_request_error")


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


def _raw_response(status: int, body: bytes, headers: Sequence[tuple[str, str]] = ()) -> bytes:
    """A whole response that closes the connection, written without h11: for refusals made
    where h11 cannot send (before a request head, or after a protocol error)."""
    lines = [f"HTTP/1.1 {status} {_phrase(status)}", "Server: expertmesh"]
    lines += ["Content-Type: application/json", f"Content-Length: {len(body)}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


_OVERLOADED = _raw_response(
    HTTPStatus.SERVICE_UNAVAILABLE,
    error_body("the server holds as many connections as it may; retry later", "server_error"),
    [("Retry-After", str(RETRY_AFTER_S))],
)


class Exchange:
    """One request and its answer, as a handler sees them: read the body (if needed), then
    `respond` once, or `start_stream`, `write`... and `end_stream`."""

    def __init__(self, conn: _Connection, request: Request):
        self.request = request
        self._conn = conn
        self.status: int | None = None  # set once the response head is sent

    async def body(self) -> bytes:
        """The whole body; HttpError 400/408/413 when it is malformed, late or too large."""
        return await self._conn.read_body()

    async def respond(self, status: int, headers: list[tuple[str, str]], body: bytes = b"") -> None:
        await self._start(status, [*headers, ("Content-Length", str(len(body)))])
        if body and self.request.method != "HEAD":
            await self._conn.send(h11.Data(data=body))
        await self._conn.send(h11.EndOfMessage())

    async def start_stream(self, status: int, headers: list[tuple[str, str]]) -> None:
        """A response whose body follows in pieces (chunked in HTTP/1.1, to the close in 1.0)."""
        await self._start(status, headers)

    async def write(self, data: bytes) -> None:
        await self._conn.send(h11.Data(data=data))

    async def end_stream(self) -> None:
        await self._conn.send(h11.EndOfMessage())

    async def _start(self, status: int, headers: list[tuple[str, str]]) -> None:
        self.status = status
        self._conn.record(self.request, status)
        headers = [("Server", "expertmesh"), *headers]
        if self._conn.h11.their_state is not h11.DONE:  # the body was not read: no next request here
            headers.append(("Connection", "close"))
        await self._conn.send(h11.Response(status_code=status, headers=headers, reason=_phrase(status).encode()))


def _declared_length(request: Request) -> int | None:
    """The Content-Length, which h11 has checked already (digits, no two different values)."""
    value = request.headers.get("content-length")
    return None if value is None else int(value.split(",")[0])


class _Connection(asyncio.Protocol):
    """One client connection: its bytes in, h11's events out, one request at a time."""

    def __init__(self, server: HttpServer):
        self.server = server
        self.limits = server.limits
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_header_bytes)
        self.transport: asyncio.Transport  # set by connection_made, before any other call
        self.task: asyncio.Task | None = None
        self.client = "?"
        self.local_address = ""
        self.lost = False
        self._inbox = bytearray()  # received, not yet given to h11
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()
        self._paused = False
        self._first_byte_at: float | None = None  # of the request head being read
        self._head_bytes = 0
        self._body: bytes | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)  # a stream server's connections are
        self.transport = transport
        peer = transport.get_extra_info("peername")
        local = transport.get_extra_info("sockname")
        self.client = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "?"
        self.local_address = local[0].removeprefix("::ffff:") if isinstance(local, tuple) else ""
        if not self.server.admit(self):
            transport.write(_OVERLOADED)
            transport.close()
            return
        self.task = asyncio.get_running_loop().create_task(self._serve())

    def data_received(self, data: bytes) -> None:
        if self.task is None:
            return
        if self._first_byte_at is None:
            self._first_byte_at = asyncio.get_running_loop().time()
        self._inbox += data
        self._readable.set()
        if len(self._inbox) > self.limits.max_buffered_bytes and not self._paused:
            self.transport.pause_reading()
            self._paused = True

    def eof_received(self) -> bool:
        return False  # the client is gone (HTTP clients never half-close): close, connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._readable.set()
        self._writable.set()
        self.server.forget(self)
        if self.task is not None and not self.task.done():
            self.task.cancel()  # whatever the request awaits — a generation, a slot — ends now

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # -- the request loop --------------------------------------------------------------------

    async def _serve(self) -> None:
        try:
            while True:
                self.server.mark_idle(self)
                request = await self._read_head()
                if request is None:
                    return
                self.server.mark_busy(self)
                if not await self._handle(request):
                    return
                self.h11.start_next_cycle()
                self._body = None
                pipelined = self._inbox or self.h11.trailing_data[0]  # the next request began already
                self._first_byte_at = asyncio.get_running_loop().time() if pipelined else None
        except (asyncio.CancelledError, ClientGone):
            pass  # the client left, or the server stops
        except Exception:
            logger.exception("the HTTP connection from %s failed", self.client)
        finally:
            self.transport.close()

    def _next_event(self) -> object:
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA and self._inbox:
                self.h11.receive_data(bytes(self._inbox))
                self._inbox.clear()
                continue
            return event

    async def _wait_readable(self, deadline: float) -> bool:
        """True once more bytes arrived, False at `deadline`; ClientGone if the connection closed."""
        if self.lost:
            raise ClientGone
        if self._paused:
            self.transport.resume_reading()
            self._paused = False
        self._readable.clear()
        try:
            async with asyncio.timeout_at(deadline):
                await self._readable.wait()
        except TimeoutError:
            return False
        if self.lost:
            raise ClientGone
        return True

    async def _read_head(self) -> Request | None:
        """The next request's head; None when the connection should just close."""
        idle_since = asyncio.get_running_loop().time()
        while True:
            try:
                event = self._next_event()
            except h11.RemoteProtocolError as e:
                logger.info("%s sent a malformed request: %s", self.client, e)
                self.refuse(e.error_status_hint, f"malformed request: {e}")
                return None
            if event is h11.NEED_DATA:
                started = self._first_byte_at
                deadline = (
                    started + self.limits.header_timeout_s
                    if started is not None
                    else idle_since + self.limits.idle_timeout_s
                )
                if not await self._wait_readable(deadline):
                    if self._first_byte_at is not None:
                        self.refuse(HTTPStatus.REQUEST_TIMEOUT, "the request head did not arrive in time")
                    return None
                continue
            if isinstance(event, h11.Request):
                return self._request(event)
            return None  # ConnectionClosed

    def _request(self, event: h11.Request) -> Request:
        self._head_bytes = len(event.target) + sum(len(n) + len(v) + 4 for n, v in event.headers)
        headers: dict[str, str] = {}
        for name, value in event.headers:
            key, text = name.decode("latin-1"), value.decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        target = event.target.decode("latin-1")
        if target[:7].lower() == "http://" or target[:8].lower() == "https://":
            # absolute-form (RFC 9112 3.2.2, what proxies send): the target's authority replaces Host
            parts = urlsplit(target)
            headers["host"] = parts.netloc
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        path, _, query = target.partition("?")
        return Request(
            method=event.method.decode("latin-1"),
            path=path,
            query=query,
            headers=headers,
            http_version=event.http_version.decode("latin-1"),
            client=self.client,
            local_address=self.local_address,
        )

    def _framing_error(self, request: Request) -> HttpError | None:
        if self._head_bytes > self.limits.max_header_bytes:  # h11 limits only a head still arriving
            return HttpError(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "the request head is too large")
        if not request.path.startswith("/"):
            return HttpError(HTTPStatus.BAD_REQUEST, "the request target must be a path")
        if "content-length" in request.headers and "transfer-encoding" in request.headers:
            return HttpError(HTTPStatus.BAD_REQUEST, "both Content-Length and Transfer-Encoding")
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):  # a gzipped body would be read as JSON and fail as "not JSON"
            return HttpError(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, f"Content-Encoding {encoding!r} is not supported")
        length = _declared_length(request)
        if length is not None and length > self.limits.max_body_bytes:
            return HttpError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the body is over {self.limits.max_body_bytes} bytes"
            )
        return None

    async def _handle(self, request: Request) -> bool:
        """Serve one request; True if the connection may carry another."""
        exchange = Exchange(self, request)
        try:
            error = self._framing_error(request)
            if error is not None:
                raise error
            if "transfer-encoding" not in request.headers and not _declared_length(request):
                await self.read_body()  # no body: h11's end of the request, so the connection may be reused
            await self.server.handler(exchange)
        except HttpError as e:
            if exchange.status is None:
                logger.info("%s %s %s: %d %s", self.client, request.method, request.path, e.status, e.message)
                self.record(request, e.status, log=False)
                self.refuse(e.status, e.message, record=False, path=request.path)
            return False
        except (ClientGone, asyncio.CancelledError):
            raise
        except Exception:
            logger.exception("the API failed on %s %s", request.method, request.path)
            if exchange.status is None:
                self.record(request, HTTPStatus.INTERNAL_SERVER_ERROR)
                self.refuse(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error", record=False, path=request.path)
            return False
        if exchange.status is None:  # a handler that answered nothing: a bug, not a hang
            logger.error("the API answered nothing to %s %s", request.method, request.path)
            self.refuse(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error", path=request.path)
            return False
        return self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE

    # -- reading and writing ----------------------------------------------------------------

    async def read_body(self) -> bytes:
        if self._body is not None:
            return self._body
        if self.h11.they_are_waiting_for_100_continue:
            await self.send(h11.InformationalResponse(status_code=100, headers=[]))
        deadline = asyncio.get_running_loop().time() + self.limits.body_timeout_s
        parts, size = [], 0
        while True:
            try:
                event = self._next_event()
            except h11.RemoteProtocolError as e:
                raise HttpError(HTTPStatus.BAD_REQUEST, f"malformed request body: {e}") from None
            if event is h11.NEED_DATA:
                if not await self._wait_readable(deadline):
                    raise HttpError(HTTPStatus.REQUEST_TIMEOUT, "the request body did not arrive in time")
            elif isinstance(event, h11.Data):
                size += len(event.data)
                if size > self.limits.max_body_bytes:
                    raise HttpError(
                        HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the body is over {self.limits.max_body_bytes} bytes"
                    )
                parts.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                self._body = b"".join(parts)
                return self._body
            else:
                raise ClientGone

    async def send(self, event: h11.Event) -> None:
        if self.lost:
            raise ClientGone
        data = self.h11.send(event)
        if data:
            self.transport.write(data)
        if not self._writable.is_set():
            try:
                async with asyncio.timeout(self.limits.write_timeout_s):
                    await self._writable.wait()
            except TimeoutError:
                self.transport.abort()
                raise ClientGone from None
            if self.lost:
                raise ClientGone

    def refuse(
        self,
        status: int,
        message: str,
        headers: Sequence[tuple[str, str]] = (),
        record: bool = True,
        path: str = "",
    ) -> None:
        """Answer an error outside h11 and close the connection (the answer is flushed first), in
        the shape of the API at `path` (the server's ErrorBody)."""
        if record:
            self.server.record(path, status)
        if not self.lost:
            self.transport.write(_raw_response(status, self.server.error_body(path, status, message), list(headers)))
            self.transport.close()

    def record(self, request: Request, status: int, log: bool = True) -> None:
        self.server.record(request.path, status)
        if log:
            logger.info(
                '%s "%s %s HTTP/%s" %d', self.client, request.method, request.path, request.http_version, status
            )

    def close_idle(self) -> None:
        self.transport.close()


class HttpServer:
    """`handler` served on `host:port` from an event loop on a thread of its own.

    The socket is bound and listening on construction (port 0 picks a free one: `port` says
    which), so errors surface before anything starts and early clients wait in the backlog."""

    def __init__(
        self,
        handler: Handler,
        host: str,
        port: int,
        limits: ServerLimits | None = None,
        on_response: Callable[[str, int], None] | None = None,
        name: str = "http",
        error_body: ErrorBody = openai_error_body,
    ):
        self.handler = handler
        self.error_body = error_body
        self.limits = limits or ServerLimits()
        self.max_connections = connection_cap(self.limits.max_connections)
        self._on_response = on_response
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, port), family=family, backlog=self.limits.backlog)
        self.port: int = self._sock.getsockname()[1]
        self._connections: set[_Connection] = set()
        self._idle: OrderedDict[_Connection, None] = OrderedDict()  # oldest idle first
        self.evicted = 0  # idle connections closed to make room
        self.refused = 0  # connections answered 503 because every one was busy
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stopping: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    def start(self) -> HttpServer:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        """Close every connection (their requests are cancelled) and the socket."""
        if self._thread.is_alive() and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join(timeout=STOP_GRACE_S * 2)
        elif not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()  # never started
        self._sock.close()

    # -- on the loop's thread ----------------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        except Exception as e:  # noqa: BLE001 - handed to start(), which raises it
            self._error = e
        finally:
            self._ready.set()
            self._loop.close()

    async def _main(self) -> None:
        self._stopping = asyncio.Event()
        server = await self._loop.create_server(lambda: _Connection(self), sock=self._sock, backlog=self.limits.backlog)
        self._ready.set()
        await self._stopping.wait()
        server.close()
        tasks = [c.task for c in self._connections if c.task is not None]
        for conn in list(self._connections):
            conn.transport.abort()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=STOP_GRACE_S)
        await self._loop.shutdown_default_executor()

    def admit(self, conn: _Connection) -> bool:
        """Room for `conn`: the connection idle longest closes if the cap is reached; False when
        every open connection is busy with a request."""
        if len(self._connections) >= self.max_connections:
            if not self._idle:
                self.refused += 1
                logger.debug(
                    "refused a connection from %s: %d connections, all busy", conn.client, len(self._connections)
                )
                return False
            oldest, _ = self._idle.popitem(last=False)
            self._connections.discard(oldest)
            oldest.close_idle()
            self.evicted += 1
            logger.debug("closed the idle connection of %s to admit %s", oldest.client, conn.client)
        self._connections.add(conn)
        self._idle[conn] = None  # no request yet: the newest idle connection
        return True

    def mark_idle(self, conn: _Connection) -> None:
        if conn in self._connections:
            self._idle[conn] = None
            self._idle.move_to_end(conn)

    def mark_busy(self, conn: _Connection) -> None:
        self._idle.pop(conn, None)

    def forget(self, conn: _Connection) -> None:
        self._connections.discard(conn)
        self._idle.pop(conn, None)

    def record(self, path: str, status: int) -> None:
        if self._on_response is not None:
            self._on_response(path, status)
