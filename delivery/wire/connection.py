"""One HTTP/1.1 connection of the wire: the response framing (httptools) and the keep-alive pool."""

from __future__ import annotations

import asyncio
import re
import select
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import cast

import httptools
import httpx
from multidict import CIMultiDict, CIMultiDictProxy

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


class _Unexpected(Exception):
    """Bytes after a complete response, or with no request waiting for them."""


# What RFC 9110 allows in no reason phrase or field value (NUL would not even fit in the
# attempt's row).
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


def _says_keep_alive(raw_headers: list[tuple[bytes, bytes]]) -> bool:
    """The response says `keep-alive` in `Connection` or `Proxy-Connection` (and not `close`)."""
    tokens = {
        token.strip(b" \t").lower()
        for name, value in raw_headers
        if name.lower() in (b"connection", b"proxy-connection")
        for token in value.split(b",")
    }
    return b"keep-alive" in tokens and b"close" not in tokens


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
        "forwarded",
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
        # Through a forward proxy in absolute form (plain HTTP): set by the transport.
        self.forwarded = False
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
        connection (llhttp keeps an HTTP/1.0 one that says `Connection: keep-alive`, or
        `Proxy-Connection: keep-alive`, which it reads alike; h11 does not, so neither
        does the wire).
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
            elif lowered in (b"connection", b"proxy-connection"):
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
            chunk = self._take()
            if chunk is not None:
                yield chunk
            elif not await self._more():
                return

    async def read_capped(self, cap: int) -> bytearray:
        """The body as `aiter_raw` gives it, chunk by chunk until its end or until `cap`
        bytes or more are in; without an async generator (and asyncio's tracking of each),
        which cost more CPU per attempt than reading a small body itself."""
        body = bytearray()
        while True:
            chunk = self._take()
            if chunk is not None:
                body += chunk
                if len(body) >= cap:
                    return body
            elif not await self._more():
                return body

    def _take(self) -> bytes | None:
        """The next buffered chunk, if any; reading resumes once half the buffer is gone."""
        if not self._chunks:
            return None
        chunk = self._chunks.popleft()
        self._buffered -= len(chunk)
        if self._buffered <= _READ_HIGH_WATER // 2:
            self._connection.resume_reading()
        return chunk

    async def _more(self) -> bool:
        """With nothing buffered: the connection's error, False at the body's end, or
        True once more has arrived."""
        if self._error is not None:
            raise self._error
        if self._complete:
            return False
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        return True

    async def aclose(self) -> None:
        """Back to the pool when read to the end and kept alive; otherwise closed.

        A forward proxy's connection (plain HTTP through it) is kept only when the proxy
        said `keep-alive`: HTTP/1.1's default is no promise there, as tinyproxy answers
        without `Connection: close` and then closes (tests/delivery/test_proxy_reuse.py).
        """
        if self.closed:
            return
        self.closed = True
        connection = self._connection
        connection.response = None
        if (
            self._complete
            and self.keep_alive
            and self._error is None
            and (not self.forwarded or _says_keep_alive(self._raw_headers))
        ):
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
        self._poller: select.poll | None = None  # see _readable

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
        """Idle, unexpired, and nothing came in since its last response: a close (FIN)
        or stray bytes the event loop has not handled yet show as the socket being
        readable (the check curl, urllib3 and httpcore make before reuse)."""
        return self.writable and now - self.idle_since < self.expiry and not self._readable()

    def _readable(self) -> bool:
        assert self.transport is not None  # writable
        poller = self._poller
        if poller is None:
            sock = self.transport.get_extra_info("socket")
            if sock is None:
                return False
            # One poller per connection (its socket's descriptor does not change while
            # it is open): only the poll itself is left per reuse.
            poller = self._poller = select.poll()
            poller.register(sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))

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
