"""Our own HTTP/1.1 wire for webhook POSTs: asyncio protocols and httptools' parser.

Why: on a drain to an instant receiver, aiohttp's request path was a quarter to a
third of the worker's CPU (docs/performance-history.md: where the time goes), as much per
request as the whole raw-ceiling client spends. A webhook POST needs little of a
general client: one request per connection at a time, keep-alive, an egress proxy,
and none of redirects, cookies, compression, auth or streaming uploads. This wire
writes each request as one buffer and parses the answer with httptools (llhttp,
the parser of Node.js and uvicorn), in C.

It keeps what httpx's own pool guarantees (tests/test_transport.py runs every case
through both):

- the SSRF guard: names are resolved once and every answer checked
  (`GuardedResolver`), IP literals are checked as they are, and the checked address
  is what is dialled; TLS still verifies and sends SNI for the URL's host;
- a name's addresses are raced (Happy Eyeballs, RFC 8305), so one that drops
  packets costs a 250 ms stagger, not the attempt's whole deadline;
- through a proxy, the same guard first: HTTPS tunnels (`CONNECT`) to the checked
  address, plain HTTP names it in absolute form;
- the scheme rule (`https_only`);
- the failure mapping, into the httpx classes `delivery.http.send_attempt` turns
  into outcomes: connect failures are `ConnectError` / `ConnectTimeout` (nothing was
  sent), a connection lost or a malformed answer after sending is
  `RemoteProtocolError` / `ReadError` (it may have arrived);
- the progress callback (`trace`) fires when the request starts going out, so
  shutdown can tell queued attempts from started ones;
- a response body not read to its end closes the connection instead of reusing it.

What it trusts (tests/test_wire_defects.py, and tests/test_wire_fuzz.py against h11):
a response counts only when it was parsed to its end; a connection goes back to the
pool only when nothing at all followed that end, the server keeps it alive and speaks
HTTP/1.1; the head, the trailers (dropped, never merged into the headers) and the
bytes between body bytes are bounded; a discarded connection is aborted, so nothing
it still had to send stays buffered.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import re
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar, cast

import httptools
import httpx
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from delivery.errors import InvalidEndpointURLError
from delivery.ssrf import AddressPolicy, CheckedURLs, GuardedResolver, Resolver, system_resolver
from outbox.urls import ProxyURL, parse_proxy_url

# Stop reading a body the caller is not consuming once this much is buffered.
_READ_HIGH_WATER = 256 * 1024
# A response head (status line and headers) larger than this is refused: the parser
# would otherwise buffer a receiver's endless header for as long as the deadline allows.
# The same cap bounds the trailers, and the bytes a body may go without a body byte
# (chunk framing and extensions, trailers).
MAX_HEAD_BYTES = 64 * 1024
# An idle connection is kept at most this long: under the 5 s idle timeout common
# servers use (Node, Apache, uvicorn), so a request rarely leaves on a connection the
# server is closing at that moment (an ambiguous attempt, and likely a duplicate).
KEEPALIVE_EXPIRY = 4.0
# A server's own `Keep-Alive: timeout=N` is honoured this much early, for the same reason.
_KEEPALIVE_MARGIN = 1.0
_KEEPALIVE_TIMEOUT = re.compile(rb"(?i)(?:^|[,;\s])timeout\s*=\s*\"?(\d{1,9})")
# Interim (1xx) answers before the final one: real servers send one or two (100 Continue,
# 103 Early Hints); more is a receiver stalling inside the head cap.
_MAX_INTERIMS = 8
_SEND_STARTED = "http11.send_request_headers.started"
# A name's checked addresses are reused this long for new connections (aiohttp's default).
_DNS_TTL_SECONDS = 10.0
_HTTP11 = b"HTTP/1.1"
# Happy Eyeballs (RFC 8305): the next address is tried this long after the previous one
# started, while that one keeps trying; the first connection up wins.
CONNECT_STAGGER_SECONDS = 0.25
# A proxy's answer to CONNECT larger than this is refused (it is a status line and a few
# headers).
_MAX_PROXY_HEAD = 16 * 1024
_PROXY_STATUS = re.compile(rb"^HTTP/1\.[01] ([0-9]{3})(?: ([^\r\n]*))?\r\n")
T = TypeVar("T")
# The httpx request extension carrying a request's own proxy URL (an endpoint's).
PROXY_EXTENSION = "outbox_proxy"

Trace = Callable[[str, Mapping[str, Any]], Awaitable[None]]


class _Target:
    """An endpoint URL, parsed and checked once: where to connect and what to send.

    Through a proxy (`proxy` set) it pools apart from direct connections (`key` names
    the proxy and a digest of its credentials); a plain-HTTP request goes to the proxy in
    absolute form (`at` an address the guard checked) with `proxy_lines` in its head.
    """

    __slots__ = (
        "_at",
        "host",
        "host_header",
        "key",
        "literal",
        "path",
        "port",
        "proxy",
        "proxy_lines",
        "tls",
    )

    def __init__(self, url: URL, proxy: ProxyURL | None = None) -> None:
        self.host = url.raw_host or ""
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.tls = url.scheme == "https"
        self.key = (self.tls, self.host, self.port)
        self.literal = _is_ip_literal(self.host)
        bracketed = f"[{self.host}]" if ":" in self.host else self.host
        default_port = 443 if self.tls else 80
        self.host_header = bracketed if self.port == default_port else f"{bracketed}:{self.port}"
        self.path = (url.raw_path_qs or "/").encode("ascii")
        self.proxy = proxy
        self.proxy_lines = ""
        self._at: dict[str, _Target] = {}
        if proxy is not None:
            credentials = f"{proxy.username}:{proxy.password}".encode()
            via = f"{proxy.display}#{hashlib.sha256(credentials).hexdigest()[:16]}"
            self.key = (self.tls, f"{self.host} via {via}", self.port)
            if not self.tls and proxy.authorization is not None:
                self.proxy_lines = f"Proxy-Authorization: {proxy.authorization}\r\n"
            if not self.tls and self.literal:
                self.path = _absolute(self.host, self.port, self.path)

    def at(self, address: str) -> _Target:
        """This plain-HTTP target through its proxy, addressed to a checked `address`: the
        proxy connects where the guard said, not where its own DNS says."""
        found = self._at.get(address)
        if found is None:
            if len(self._at) > 64:
                self._at.clear()
            found = self._at[address] = _copy_target(self)
            found.path = _absolute(address, self.port, self.path)
        return found


def _copy_target(target: _Target) -> _Target:
    copied = object.__new__(_Target)
    for name in _Target.__slots__:
        setattr(copied, name, getattr(target, name))
    copied._at = {}
    return copied


def _absolute(address: str, port: int, path: bytes) -> bytes:
    """The absolute-form request target (RFC 9112 3.2.2) a proxy forwards."""
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}".encode("ascii") + path


class _TunnelHandshake(asyncio.Protocol):
    """Reads a proxy's answer to CONNECT (a status line and headers), nothing more."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.head: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._buffer = bytearray()
        self.early = False  # bytes came after the head

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.head.done():
            self.early = True
            return
        self._buffer += data
        end = self._buffer.find(b"\r\n\r\n")
        if end >= 0:
            # A refusal may carry a body; after a 200, the tunnel's first bytes are the
            # server's, and a server speaks only after our TLS hello.
            self.early = len(self._buffer) > end + 4
            self.head.set_result(bytes(self._buffer[: end + 4]))
            self.transport.pause_reading()  # type: ignore[union-attr]
        elif len(self._buffer) > _MAX_PROXY_HEAD:
            self.head.set_exception(
                ConnectionError(f"the proxy's answer to CONNECT is over {_MAX_PROXY_HEAD} bytes")
            )

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.head.done():
            self.head.set_exception(
                ConnectionError(f"the proxy closed the connection during CONNECT ({exc})")
            )


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class _Unexpected(Exception):
    """Bytes after a complete response, or with no request waiting for them."""


# Request header lines as the httpx API path writes them: each name an RFC 9110 token,
# each value free of control characters but HTAB (NUL, CR or LF would end the line or
# the head early and let a value write headers, or a request, of its own).
_HEADER_LINES = re.compile(rb"(?:[!#$%&'*+.^_`|~0-9A-Za-z-]+: [^\x00-\x08\x0a-\x1f\x7f]*\r\n)*")
# What RFC 9110 allows in no reason phrase or field value (NUL would not even fit in the
# attempt's row).
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
# Headers `post` writes itself from the URL and the body: a caller's would stand beside them.
_OWN_HEADERS = re.compile(r"(?im)^(?:host|content-length|transfer-encoding)[ \t]*:")
# Methods the httpx API path sends: their responses are framed like a POST's (HEAD's
# and CONNECT's are not, TRACE echoes the request).
_METHODS = frozenset({b"POST", b"PUT", b"PATCH", b"DELETE", b"GET", b"OPTIONS"})


def _keep_alive_expiry(value: bytes) -> float | None:
    """How long a connection may idle by the server's `Keep-Alive` header (None: unsaid)."""
    found = _KEEPALIVE_TIMEOUT.search(value)
    if found is None:
        return None
    return max(0.0, int(found.group(1)) - _KEEPALIVE_MARGIN)


class WireResponse:
    """One response as `send_attempt` reads it: status, reason, headers, raw body chunks.

    The head is there when `WireTransport.post` returns; the body streams. `aclose`
    hands the connection back to the pool only when the body was read to its end
    and the server keeps the connection alive.
    """

    __slots__ = (
        "_buffered",
        "_chunks",
        "_complete",
        "_connection",
        "_error",
        "_head",
        "_headers",
        "_raw_headers",
        "_waiter",
        "closed",
        "framed",
        "keep_alive",
        "keep_alive_expiry",
        "reason",
        "released",
        "status_code",
    )

    def __init__(self, connection: _Connection, head: asyncio.Future[None]) -> None:
        self._connection = connection
        self._head = head
        self.status_code = 0
        self.reason = b""
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._headers: CIMultiDictProxy[str] | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._complete = False
        self._error: httpx.TransportError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.keep_alive = False
        self.keep_alive_expiry: float | None = None  # from the server's Keep-Alive: timeout
        self.framed = False  # Content-Length or chunked: the body's end is known
        self.closed = False
        self.released = False  # the connection went back to the pool

    @property
    def reason_phrase(self) -> str:
        return self.reason.decode("latin-1")

    @property
    def headers(self) -> Mapping[str, str]:
        """Case-insensitive, like httpx's (built on first use: most attempts never ask)."""
        if self._headers is None:
            self._headers = CIMultiDictProxy(
                CIMultiDict(
                    (name.decode("latin-1"), value.decode("latin-1"))
                    for name, value in self._raw_headers
                )
            )
        return self._headers

    @property
    def raw_headers(self) -> list[tuple[bytes, bytes]]:
        return self._raw_headers

    # -- fed by the connection ------------------------------------------------------

    def head_received(
        self, status: int, keep_alive: bool, parser: httptools.HttpResponseParser
    ) -> None:
        """The final head is in: how the body ends, and whether the connection may stay.

        A body is delimited by the connection's close only when there is neither a
        Content-Length nor `Transfer-Encoding: chunked` (llhttp reads such a response,
        `Transfer-Encoding: identity` too, to the close). One Transfer-Encoding header
        naming one coding, chunked or identity, is all that is accepted (as h11 does,
        plus identity): a body in any other coding could not be read as sent, and a
        list of codings is where parsers disagree on the framing. Only HTTP/1.1 keeps a
        connection (llhttp keeps an HTTP/1.0 one that says `Connection: keep-alive`;
        h11 does not, so neither does the wire).
        """
        self.status_code = status
        framed = coded = connection = False
        for name, value in self._raw_headers:
            lowered = name.lower()
            if lowered == b"content-length":
                framed = True
            elif lowered == b"transfer-encoding":
                coding = value.strip(b" \t").lower()
                if coded or coding not in (b"chunked", b"identity"):
                    raise _Unexpected(
                        f"unsupported Transfer-Encoding {value.decode('latin-1')!r}"
                        + (" (a second one)" if coded else "")
                    )
                coded = True
                framed = framed or coding == b"chunked"
            elif lowered == b"keep-alive":
                self.keep_alive_expiry = _keep_alive_expiry(value)
            elif lowered == b"connection":
                connection = True
        self.framed = framed
        # Without a Connection header llhttp keeps only HTTP/1.1 (and later) connections.
        self.keep_alive = keep_alive and (not connection or parser.get_http_version() == "1.1")
        if not self._head.done():
            self._head.set_result(None)

    def body_received(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._buffered += len(chunk)
        if self._buffered > _READ_HIGH_WATER:
            self._connection.pause_reading()
        self._wake()

    def finished(self) -> None:
        self._complete = True
        self._wake()

    def failed(self, error: httpx.TransportError) -> None:
        if self._complete:
            return
        self._error = error
        if not self._head.done():
            self._head.set_exception(error)
            self._head.exception()  # retrieved here: the caller may be gone (cancelled)
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._complete:
            return
        if self._head.done() and not self.framed and exc is None:
            self.finished()  # a body delimited by the connection's close ends here
            return
        if isinstance(exc, OSError):
            self.failed(httpx.ReadError(f"connection lost: {exc}"))
        elif self._head.done():
            self.failed(httpx.RemoteProtocolError("the server closed the connection mid-body"))
        else:
            self.failed(
                httpx.RemoteProtocolError(
                    "the server closed the connection without sending a response"
                )
            )

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- read by the caller ---------------------------------------------------------

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                self._buffered -= len(chunk)
                if self._buffered <= _READ_HIGH_WATER // 2:
                    self._connection.resume_reading()
                yield chunk
                continue
            if self._error is not None:
                raise self._error
            if self._complete:
                return
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def aclose(self) -> None:
        """Back to the pool when read to the end and kept alive; otherwise closed."""
        if self.closed:
            return
        self.closed = True
        connection = self._connection
        connection.response = None
        if self._complete and self.keep_alive and self._error is None:
            self.released = connection.release(self.keep_alive_expiry)
        else:
            connection.abort()


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; one request at a time.

    Bytes after a complete response (a stray byte, a line break, the start of another
    status line) mean the connection is not used again: llhttp alone would skip line
    breaks between messages and keep a half-read next message for the next request
    to inherit. Any such bytes that are not line breaks begin a message
    (`on_message_begin`); a read that ends in a line break is fed in two steps, all
    but its last byte and then that byte, so a response that was complete before it
    is seen to be followed by something.
    """

    def __init__(self, pool: _Pool, key: tuple[bool, str, int]) -> None:
        self._pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.response: WireResponse | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._interim = False  # a 1xx answer before the real one
        self._interims = 0  # 1xx answers so far in this response
        self._fresh = False  # the next read is a response's first
        self._read = b""  # the read being parsed
        self._earlier: list[bytes] = []  # this response's reads before it, while in its head
        self._head_bytes = 0  # bytes received before the response head was complete
        self._idle_bytes = 0  # bytes received since the head without a body byte
        self._trailer_bytes = 0
        self._reading_paused = False
        self.counted = False  # holds one of the pool's connections (set by the pool)
        self.closed = False
        self.reusable = True  # nothing but whole responses has come over it
        self.idle_since = 0.0
        self.expiry = 0.0

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            response = self.response
            if response is None or response._complete:
                raise _Unexpected("bytes with no request waiting for them")
            head_done = response._head.done()
            before = response._buffered  # the caller cannot read while this runs
            self._read = data
            if self._fresh:
                self._fresh = False
                if data[0] in b"\r\n":  # llhttp would skip blank lines before the status line
                    raise _Unexpected("a blank line before the status line")
            if data[-1] in b"\r\n" and len(data) > 1:
                view = memoryview(data) if len(data) > 4096 else data  # copy less, or nothing
                self._parser.feed_data(view[:-1])
                if response._complete:
                    self._leftover()  # the response ended before this read did
                    return
                self._parser.feed_data(view[-1:])
            else:  # bytes after the end would include this last one: on_message_begin
                self._parser.feed_data(data)
            if not head_done:
                if not response._head.done():
                    self._earlier.append(data)
                    self._head_bytes += len(data)
                    if self._head_bytes > MAX_HEAD_BYTES:
                        raise _Unexpected(f"the response head is over {MAX_HEAD_BYTES} bytes")
            elif not response._complete and response._buffered == before:
                self._idle_bytes += len(data)
                if self._idle_bytes > MAX_HEAD_BYTES:
                    raise _Unexpected(
                        f"over {MAX_HEAD_BYTES} bytes after the head without a body byte "
                        "(trailers or chunk framing)"
                    )
            else:
                self._idle_bytes = 0
        except httptools.HttpParserUpgrade:
            self._fail(httpx.RemoteProtocolError("the server switched protocols"))
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__ or exc
            self._fail(httpx.RemoteProtocolError(f"malformed response: {cause}"))
        except (httptools.HttpParserError, _Unexpected) as exc:
            self._fail(httpx.RemoteProtocolError(f"malformed response: {exc}"))

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.response is not None:
            self.response.connection_lost(exc)
        self._pool.forget(self)

    # httptools' callbacks

    def on_message_begin(self) -> None:
        self._current()  # a second message after the response is refused

    def on_status(self, status: bytes) -> None:
        response = self._current()
        response.reason += status  # a reason split across reads comes in pieces

    def on_header(self, name: bytes, value: bytes) -> None:
        response = self._current()
        if not response.status_code:  # set when the final head is complete
            response._raw_headers.append((name, value))
            return
        # A trailer, after a chunked body: counted and dropped, never a header (a trailer
        # Retry-After or Location must not decide an outcome the head did not). Framing
        # has no place there (RFC 9110, 6.5.1): such a response is refused, as h11 does.
        self._trailer_bytes += len(name) + len(value) + 4
        if self._trailer_bytes > MAX_HEAD_BYTES:
            raise _Unexpected(f"the response trailers are over {MAX_HEAD_BYTES} bytes")
        if name.lower() in (b"content-length", b"transfer-encoding"):
            raise _Unexpected(f"a {name.decode('latin-1')} trailer")

    def on_headers_complete(self) -> None:
        response = self._current()
        status = self._parser.get_status_code()
        if self._interims:
            self._check_no_blank_line()
        if _CONTROL.search(response.reason) is not None:  # llhttp lets NUL and others through
            raise _Unexpected("a control character in the reason phrase")
        if status < 200:
            if status < 100:  # llhttp takes any three digits
                raise _Unexpected(f"{status:03d} is not a status code")
            self._interim = True  # e.g. 100 Continue: the real answer follows
            return
        response.head_received(status, self._parser.should_keep_alive(), self._parser)

    def on_body(self, body: bytes) -> None:
        self._current().body_received(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            self._interims += 1
            if self._interims > _MAX_INTERIMS:
                raise _Unexpected(f"more than {_MAX_INTERIMS} interim (1xx) responses")
            response = self._current()
            response.reason = b""  # a 1xx answer's reason and headers are not the final one's
            response._raw_headers.clear()
            return
        self._current().finished()
        self._read = b""  # an idle connection keeps no read
        self._earlier.clear()

    def _current(self) -> WireResponse:
        response = self.response
        if response is None or response._complete:
            raise _Unexpected("bytes after the response")
        return response

    def _check_no_blank_line(self) -> None:
        """The message after a 1xx answer starts right at that answer's end: llhttp skips
        blank lines between messages, and a strict parser (h11) refuses them."""
        text = b"".join([*self._earlier, self._read])  # this response so far: heads only
        end = 0
        for _ in range(self._interims):
            end = text.index(b"\r\n\r\n", end) + 4
        if text[end : end + 1] in (b"\r", b"\n"):
            raise _Unexpected("a blank line after an interim (1xx) response")

    def _leftover(self) -> None:
        """Bytes followed a complete response: it stands, the connection goes."""
        self.reusable = False
        self.abort()

    # used by the pool and the response

    @property
    def writable(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    def send(self, data: bytes, response: WireResponse) -> None:
        self.response = response
        self._head_bytes = self._idle_bytes = self._trailer_bytes = self._interims = 0
        self._fresh = True
        self._earlier.clear()
        if not self.writable:
            response.failed(httpx.ConnectError("the connection closed before the request was sent"))
            return
        assert self.transport is not None
        self.transport.write(data)

    def usable(self, now: float) -> bool:
        return self.writable and now - self.idle_since < self.expiry

    def pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_paused and self.transport is not None and not self.closed:
            self._reading_paused = False
            self.transport.resume_reading()

    def release(self, expiry: float | None) -> bool:
        """Back to the pool (True), or closed when it cannot be trusted again (False)."""
        if self.closed or self._reading_paused or not self.reusable:
            self.abort()
            return False
        return self._pool.release(self, expiry)

    def abort(self) -> None:
        """Discard: abort, not close, so request bytes the peer never read are dropped
        with it instead of staying buffered after the pool stopped counting them."""
        self.closed = True
        if self.transport is not None:
            self.transport.abort()
        self._pool.forget(self)

    close = abort  # a connection is never closed gracefully: see abort

    def _fail(self, error: httpx.TransportError) -> None:
        if self.response is not None:
            self.response.failed(error)
        self.abort()


class _Pool:
    """Keep-alive connections by (tls, host, port), at most `limit` open in all.

    At the limit, an idle connection to another host is closed to make room; only
    when every connection is busy does a request wait for one to come back. An idle
    connection expires after `keepalive_expiry` seconds, or sooner when the server's
    `Keep-Alive: timeout` says so.
    """

    def __init__(
        self,
        limit: int,
        keepalive_expiry: float = KEEPALIVE_EXPIRY,
        *,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._limit = limit
        self._expiry = keepalive_expiry
        self._monotonic = monotonic
        self._idle: dict[tuple[bool, str, int], list[_Connection]] = {}
        self._open = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    def take_idle(self, key: tuple[bool, str, int]) -> _Connection | None:
        """A kept-alive connection to `key` that is still usable, or None."""
        idle = self._idle.get(key)
        if not idle:
            return None
        now = self._monotonic()
        while idle:
            connection = idle.pop()
            if connection.usable(now):
                return connection
            connection.abort()
        self._idle.pop(key, None)
        return None

    async def acquire(
        self, key: tuple[bool, str, int], connect: Callable[[], Awaitable[_Connection]]
    ) -> _Connection:
        while True:
            found = self.take_idle(key)
            if found is not None:
                return found
            if self._open >= self._limit:
                self._close_one_idle()
            if self._open < self._limit:
                self._open += 1
                try:
                    connection = await connect()
                except BaseException:
                    self._open -= 1
                    self._wake_one()
                    raise
                connection.counted = True
                if connection.closed:  # lost before it could be used
                    self.forget(connection)
                    raise httpx.ConnectError(
                        "the connection opened and then closed before the request was sent;"
                        " nothing was sent"
                    )
                return connection
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._wake_one()  # pass on the turn this waiter will not use
                else:
                    self._waiters.remove(waiter)
                raise

    def release(self, connection: _Connection, expiry: float | None = None) -> bool:
        """Keep `connection` for its next request, for `expiry` seconds at most (the
        pool's own expiry when the server named none); False when that is no time."""
        connection.expiry = self._expiry if expiry is None else min(expiry, self._expiry)
        if connection.expiry <= 0:
            connection.abort()
            return False
        connection.idle_since = self._monotonic()
        self._idle.setdefault(connection.key, []).append(connection)
        self._wake_one()
        return True

    def forget(self, connection: _Connection) -> None:
        """A connection closed: it no longer counts against the limit."""
        if connection.counted:
            connection.counted = False
            self._open -= 1
            idle = self._idle.get(connection.key)
            if idle and connection in idle:
                idle.remove(connection)
            self._wake_one()

    def _close_one_idle(self) -> None:
        for key, idle in self._idle.items():
            if idle:
                idle.pop(0).abort()
                if not idle:
                    del self._idle[key]
                return

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        for idle in list(self._idle.values()):
            for connection in list(idle):
                connection.abort()
        self._idle.clear()


class WireTransport(httpx.AsyncBaseTransport):
    """Webhook POSTs over our own HTTP/1.1 wire, and httpx's transport API on the same pool.

    Never follows redirects, keeps no cookies, reads no proxy settings from the
    environment and does not decompress: the caller sees the raw bytes, so the body cap
    counts what came over the wire.

    An egress proxy (`proxy`, or one per request) changes where bytes go, never what the
    guard allows: the target's name is still resolved and checked here, HTTPS goes
    through `CONNECT` to the checked address (TLS verified for the URL's host, end to
    end) and plain HTTP to the proxy in absolute form naming the checked address.
    """

    def __init__(
        self,
        *,
        policy: AddressPolicy,
        https_only: bool = False,
        max_connections: int = 100,
        keepalive_expiry: float = KEEPALIVE_EXPIRY,
        ssl_context: ssl.SSLContext | None = None,
        resolver: Resolver | None = None,
        proxy: str | None = None,
        connect_stagger: float = CONNECT_STAGGER_SECONDS,
        proxy_resolver: Resolver | None = None,
    ) -> None:
        """`ssl_context` defaults to the system's trust store with verification on;
        `resolver` (host, port -> addresses) to the system resolver. `proxy` is the
        egress proxy for every request (`http://user:password@host:port`, trusted
        configuration: its own address is not checked by the guard, and
        `proxy_resolver` resolves its name); a request's own proxy overrides it.
        `connect_stagger` is the Happy Eyeballs delay between addresses."""
        self._resolver = GuardedResolver(policy, resolver)
        self._pool = _Pool(max_connections, keepalive_expiry)
        self._ssl_context = ssl_context
        self._targets = CheckedURLs(policy, https_only=https_only, build=_Target)
        self._addresses: dict[tuple[str, int], tuple[float, list[str]]] = {}
        self._proxy = None if proxy is None else parse_proxy_url(proxy, what="OUTBOX_HTTP_PROXY")
        self._proxy_resolver = proxy_resolver or system_resolver
        self._proxied: dict[tuple[str, str], _Target] = {}
        self._stagger = connect_stagger

    @property
    def proxy(self) -> str | None:
        """The default proxy as `host:port` (never its credentials), or None."""
        return None if self._proxy is None else self._proxy.display

    async def _proxied_target(self, url: str, proxy: str | None) -> _Target:
        """The checked target for `url` through `proxy`, else through the default proxy
        (callers go to `self._targets` directly when there is neither: the hot path)."""
        direct = self._targets.get(url)  # the scheme rule, and the guard for literals
        key = (url, proxy or "")
        target = self._proxied.get(key)
        if target is None:
            via = self._proxy if proxy is None else parse_proxy_url(proxy, what="the proxy URL")
            if len(self._proxied) > 10_000:
                self._proxied.clear()
            target = self._proxied[key] = _Target(URL(url), via)
        if target.tls or direct.literal:
            return target
        # Plain HTTP names the checked address to the proxy, so it is resolved (and checked)
        # here, before the request is written.
        return target.at((await self._resolve(target))[0])

    async def post(
        self,
        url: str,
        headers: Mapping[str, str],
        body: bytes,
        *,
        deadline: float,
        trace: Trace | None = None,
        proxy: str | None = None,
    ) -> WireResponse:
        """POST `body` with exactly `headers` (plus Host and Content-Length); returns once
        the response head is in. The caller's own deadline bounds the whole exchange;
        `deadline` bounds getting a connection, as a connect timeout. `proxy` overrides
        the default proxy for this request (an endpoint's own).

        A `Host`, `Content-Length` or `Transfer-Encoding` in `headers` is refused, not
        overridden: the wire writes them from the URL and the body, and a second one
        beside them would let the receiver (or a proxy before it) frame the request
        differently. `InvalidEndpointURLError` then says which; nothing is sent.
        """
        target = (
            self._targets.get(url)
            if proxy is None and self._proxy is None
            else await self._proxied_target(url, proxy)
        )
        lines = "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
        if (
            lines.count("\n") != len(headers)
            or lines.count("\r") != len(headers)
            or ("\x00" in lines)
        ):
            raise InvalidEndpointURLError(
                "a request header contains a line break or NUL; fix the endpoint's headers"
            )
        lowered = lines.lower()  # a cheap look first: the regex runs when a name might match
        own = (
            _OWN_HEADERS.search(lines)
            if "host" in lowered or "content-length" in lowered or "transfer-encoding" in lowered
            else None
        )
        if own is not None:
            raise InvalidEndpointURLError(
                f"a request header sets {own.group(0)[:-1].strip()!r}, which the wire writes "
                "itself from the URL and the body; remove it from the headers"
            )
        head = (
            b"POST "
            + target.path
            + f" HTTP/1.1\r\nHost: {target.host_header}\r\n{target.proxy_lines}{lines}"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
        )
        return await self._exchange(target, head + body, trace, connect_timeout=deadline)

    async def _exchange(
        self,
        target: _Target,
        data: bytes,
        trace: Trace | None,
        *,
        connect_timeout: float | None,
        read_timeout: float | None = None,
    ) -> WireResponse:
        connection = self._pool.take_idle(target.key)
        if connection is None:
            try:
                async with asyncio.timeout(connect_timeout):
                    connection = await self._pool.acquire(target.key, lambda: self._connect(target))
            except TimeoutError as exc:
                raise httpx.ConnectTimeout(
                    f"no connection to {target.host}:{target.port} within {connect_timeout:g}s"
                ) from exc
        if not connection.writable:
            # Lost between being opened (or taken) and now: nothing was sent, retry safely.
            connection.abort()
            raise httpx.ConnectError(
                f"the connection to {target.host}:{target.port} closed before the request "
                "was sent; nothing was sent"
            )
        response = WireResponse(connection, asyncio.get_running_loop().create_future())
        try:
            if trace is not None:
                await trace(_SEND_STARTED, {})
            connection.send(data, response)  # unwritable by now: ConnectError, as above
            if read_timeout is None:
                await response._head  # the caller's deadline bounds it
            else:
                try:
                    async with asyncio.timeout(read_timeout):
                        await response._head
                except TimeoutError as exc:
                    raise httpx.ReadTimeout(f"no response within {read_timeout:g}s") from exc
        except BaseException:
            await response.aclose()
            raise
        return response

    async def _connect(self, target: _Target) -> _Connection:
        if target.proxy is not None:
            return await self._connect_through_proxy(target, target.proxy)
        loop = asyncio.get_running_loop()
        addresses = [target.host] if target.literal else await self._resolve(target)
        tls = self._tls_context() if target.tls else None

        async def open_one(address: str) -> _Connection:
            _, connection = await loop.create_connection(
                lambda: _Connection(self._pool, target.key),
                address,
                target.port,
                ssl=tls,
                server_hostname=target.host if tls is not None else None,
            )
            return connection

        return await self._first_to_connect(
            addresses, open_one, f"{target.host}:{target.port}", _close_connection
        )

    async def _first_to_connect(
        self,
        addresses: Sequence[str],
        open_one: Callable[[str], Coroutine[Any, Any, T]],
        what: str,
        discard: Callable[[T], None],
    ) -> T:
        """Happy Eyeballs (RFC 8305 section 5): the first address gets `self._stagger`
        seconds before the next one starts beside it (at once when it fails), and so on;
        the first connection up (TCP and TLS) wins and the others are cancelled. A
        blackholed first address costs a stagger, not the whole deadline.

        Only OSError and TLS failures move on to the next address; anything else (the
        guard's refusal, a proxy's answer) propagates. Losers that connected anyway are
        handed to `discard`."""
        failures: list[str] = []
        running: dict[asyncio.Task[T], str] = {}
        remaining = list(addresses)
        try:
            while remaining or running:
                if remaining:
                    address = remaining.pop(0)
                    running[asyncio.create_task(open_one(address))] = address
                done, _ = await asyncio.wait(
                    running,
                    timeout=self._stagger if remaining else None,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                for task in done:
                    address = running.pop(task)
                    error = task.exception()
                    if error is None:
                        return task.result()
                    if not isinstance(error, (OSError, ssl.SSLError)):
                        raise error
                    failures.append(f"{address}: {error}")
        finally:
            for task in running:
                task.cancel()
            for outcome in await asyncio.gather(*running, return_exceptions=True):
                if not isinstance(outcome, BaseException):
                    discard(outcome)  # a loser that connected anyway
        raise httpx.ConnectError(f"cannot connect to {what} ({'; '.join(failures)})")

    async def _connect_through_proxy(self, target: _Target, proxy: ProxyURL) -> _Connection:
        """A connection to the proxy; for HTTPS, a `CONNECT` tunnel to an address the guard
        checked, with TLS for the URL's host on top."""
        loop = asyncio.get_running_loop()
        if _is_ip_literal(proxy.host):
            proxy_addresses: Sequence[str] = [proxy.host]
        else:
            try:
                proxy_addresses = await self._proxy_resolver(proxy.host, proxy.port)
            except OSError as exc:
                raise httpx.ConnectError(
                    f"cannot resolve the proxy {proxy.display}: {exc}"
                ) from exc
        where = f"the proxy {proxy.display}"
        if not target.tls:

            async def open_plain(address: str) -> _Connection:
                _, connection = await loop.create_connection(
                    lambda: _Connection(self._pool, target.key), address, proxy.port
                )
                return connection

            return await self._first_to_connect(
                proxy_addresses, open_plain, where, _close_connection
            )
        checked = [target.host] if target.literal else await self._resolve(target)
        tls_context = self._tls_context()

        async def open_tunnel(proxy_address: str) -> _TunnelHandshake:
            _, handshake = await loop.create_connection(_TunnelHandshake, proxy_address, proxy.port)
            return handshake

        async def through(address: str) -> _Connection:
            """CONNECT to one checked address, then TLS for the URL's host. A refusal of
            this address (or TLS failing) moves on to the next; an unreachable proxy or
            refused credentials end the attempt."""
            handshake = await self._first_to_connect(
                proxy_addresses, open_tunnel, where, _close_handshake
            )
            try:
                status, reason = await self._tunnel(handshake, proxy, address, target.port)
                if status in (401, 407):  # tinyproxy answers wrong credentials with 401
                    raise httpx.ConnectError(_proxy_auth_refused(proxy, status, reason))
                if status != 200:
                    raise ConnectionRefusedError(
                        f"{where} refused CONNECT ({status} {reason}); check its allowed "
                        "ports (e.g. tinyproxy's ConnectPort)"
                    )
                connection = _Connection(self._pool, target.key)
                assert handshake.transport is not None
                tls = await loop.start_tls(
                    handshake.transport, connection, tls_context, server_hostname=target.host
                )
                if tls is None:  # pragma: no cover - only a server-side start_tls returns None
                    raise ConnectionError("TLS did not start")
            except BaseException:
                _close_handshake(handshake)
                raise
            connection.connection_made(tls)
            return connection

        return await self._first_to_connect(
            checked, through, f"{target.host}:{target.port} through {where}", _close_connection
        )

    async def _tunnel(
        self, handshake: _TunnelHandshake, proxy: ProxyURL, address: str, port: int
    ) -> tuple[int, str]:
        """Ask the proxy to `CONNECT` to `address` (checked by the guard); its status."""
        authority = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
        authorization = proxy.authorization
        request = f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n" + (
            f"Proxy-Authorization: {authorization}\r\n" if authorization else ""
        )
        assert handshake.transport is not None
        handshake.transport.write(request.encode("latin-1") + b"\r\n")
        try:
            head = await handshake.head
        except ConnectionError as exc:
            handshake.transport.abort()
            raise httpx.ConnectError(f"{exc} (the proxy {proxy.display})") from exc
        matched = _PROXY_STATUS.match(head)
        if matched is None:
            handshake.transport.abort()
            raise httpx.ConnectError(
                f"the proxy {proxy.display} answered CONNECT with something that is not HTTP/1.1"
            )
        reason = (matched.group(2) or b"").decode("latin-1")[:100]
        status = int(matched.group(1))
        if status == 200 and handshake.early:
            handshake.transport.abort()
            raise httpx.ConnectError(
                f"the proxy {proxy.display} sent bytes into the tunnel before TLS started"
            )
        return status, " ".join(reason.split())

    async def _resolve(self, target: _Target) -> list[str]:
        """The name's addresses, each checked by the SSRF guard (refused: AddressRefusedError)."""
        key = (target.host, target.port)
        cached = self._addresses.get(key)
        now = time.monotonic()
        if cached is not None and now - cached[0] < _DNS_TTL_SECONDS:
            return cached[1]
        try:
            answers = await self._resolver.resolve(target.host, target.port)
        except OSError as exc:
            raise httpx.ConnectError(f"cannot resolve {target.host}: {exc}") from exc
        addresses = list(answers)
        if len(self._addresses) > 10_000:
            self._addresses.clear()
        self._addresses[key] = (now, addresses)
        return addresses

    def _tls_context(self) -> ssl.SSLContext:
        """The client TLS context, built on first use (most workers send to few hosts)."""
        if self._ssl_context is None:
            self._ssl_context = ssl.create_default_context()
        return self._ssl_context

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """httpx's transport API on the same pool (for clients with mounts, hooks or auth).

        Refused with `httpx.LocalProtocolError` before anything is sent: a method other
        than POST, PUT, PATCH, DELETE, GET or OPTIONS (a HEAD or CONNECT answer is framed
        differently), a header name that is not a token, a header value with a control
        character (NUL, CR, LF, ...). Content-Length and Transfer-Encoding are the wire's
        own: the body is read whole and sent with its length.
        """
        method = request.method.encode("ascii", "replace")
        if method not in _METHODS:
            raise httpx.LocalProtocolError(
                f"this wire sends webhooks; the method {request.method!r} is not supported "
                f"(use one of {', '.join(sorted(m.decode() for m in _METHODS))})"
            )
        proxy = request.extensions.get(PROXY_EXTENSION)
        target = (
            self._targets.get(str(request.url))
            if proxy is None and self._proxy is None
            else await self._proxied_target(str(request.url), proxy)
        )
        # The body is read whole, so it goes out with a Content-Length, never chunked.
        kept = [
            (name, value)
            for name, value in request.headers.raw
            if name.lower() not in (b"content-length", b"transfer-encoding")
        ]
        lines = b"".join(name + b": " + value + b"\r\n" for name, value in kept)
        if _HEADER_LINES.fullmatch(lines) is None:
            bad = next(
                name
                for name, value in kept
                if not _HEADER_LINES.fullmatch(name + b": " + value + b"\r\n")
            )
            raise httpx.LocalProtocolError(
                f"the request header {bad.decode('latin-1')!r} has a name that is not a token "
                "or a value with a control character (NUL, CR, LF, ...); fix the header"
            )
        body = await request.aread()
        data = (
            method
            + b" "
            + target.path
            + b" HTTP/1.1\r\n"
            + target.proxy_lines.encode("latin-1")
            + lines
            + b"Content-Length: %d\r\n\r\n" % len(body)
            + body
        )
        phases = request.extensions.get("timeout") or {}
        connect, pool = phases.get("connect"), phases.get("pool")
        waited = None if connect is None and pool is None else (connect or 0) + (pool or 0)
        response = await self._exchange(
            target,
            data,
            request.extensions.get("trace"),
            connect_timeout=waited,
            read_timeout=phases.get("read"),
        )
        return httpx.Response(
            status_code=response.status_code,
            headers=response.raw_headers,
            stream=_ResponseStream(response, phases.get("read")),
            extensions={"http_version": _HTTP11, "reason_phrase": response.reason},
        )

    async def aclose(self) -> None:
        self._pool.close()
        await asyncio.sleep(0)  # let the transports finish closing before the loop goes


class _ResponseStream(httpx.AsyncByteStream):
    """A wire response's body for httpx.Response, each read bounded by the read timeout."""

    def __init__(self, response: WireResponse, read_timeout: float | None) -> None:
        self._response = response
        self._read_timeout = read_timeout

    async def __aiter__(self) -> AsyncIterator[bytes]:
        chunks = self._response.aiter_raw()
        while True:
            try:
                async with asyncio.timeout(self._read_timeout):
                    chunk = await anext(chunks)
            except StopAsyncIteration:
                return
            except TimeoutError as exc:
                raise httpx.ReadTimeout(f"no body bytes within {self._read_timeout:g}s") from exc
            yield chunk

    async def aclose(self) -> None:
        await self._response.aclose()


def _close_connection(connection: _Connection) -> None:
    connection.close()


def _close_handshake(handshake: _TunnelHandshake) -> None:
    if handshake.transport is not None:
        handshake.transport.abort()


def _proxy_auth_refused(proxy: ProxyURL, status: int, reason: str) -> str:
    """What a 407 (or 401) from the proxy means here, without the credentials."""
    answer = f"{status} {reason}".strip()
    if proxy.authorization is None:
        return (
            f"the proxy {proxy.display} requires credentials ({answer}); put them in the "
            "proxy URL: http://user:password@host:port"
        )
    return (
        f"the proxy {proxy.display} refused the credentials in the proxy URL ({answer}); "
        "fix the user name or password"
    )
