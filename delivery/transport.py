"""An aiohttp-based transport under httpx's API.

Why: httpcore's connection pool is the bottleneck of a busy worker. On the 2-core
benchmark box a bare asyncio receiver answered 500-900 requests/s from httpx's
default AsyncClient and several times that through aiohttp. This transport keeps
everything the rest of the code relies on (httpx.Request and httpx.Response, the
`timeout` extension, streaming reads so the response body cap still stops reading,
httpx's exception classes) and swaps only the wire: aiohttp's connector and parser.

Exceptions are translated here, at the boundary, into the httpx classes that
`delivery.http.send_attempt` already turns into outcomes:

| aiohttp                                   | httpx                 | outcome   |
|-------------------------------------------|-----------------------|-----------|
| ClientConnectorError (refused, DNS, TLS)  | ConnectError          | retryable |
| ConnectionTimeoutError                    | ConnectTimeout        | retryable |
| SocketTimeoutError / other timeouts       | ReadTimeout           | ambiguous |
| ServerDisconnectedError, payload, parsing | RemoteProtocolError   | ambiguous |
| other ClientOSError (reset)               | ReadError             | ambiguous |
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import AsyncIterator, Mapping
from types import TracebackType
from typing import Any

import aiohttp
import httpx

from delivery.ssrf import AddressPolicy, CheckedURLs, GuardedResolver

_HTTP11 = b"HTTP/1.1"


def _timeout(extensions: dict[str, Any]) -> aiohttp.ClientTimeout:
    """httpx's per-phase timeouts mapped onto aiohttp's; None means no limit for that phase."""
    phases = extensions.get("timeout") or {}
    connect = phases.get("connect")
    pool = phases.get("pool")
    return aiohttp.ClientTimeout(
        total=None,
        # aiohttp's `connect` covers waiting for a pooled connection as well.
        connect=None if connect is None and pool is None else (connect or 0) + (pool or 0),
        sock_connect=connect,
        sock_read=phases.get("read"),
    )


@functools.lru_cache(maxsize=64)
def _deadline_timeout(seconds: float) -> aiohttp.ClientTimeout:
    """What `httpx.Timeout(seconds)` maps to, for the direct path (same phases)."""
    return _timeout({"timeout": httpx.Timeout(seconds).as_dict()})


def _translate(exc: Exception, request: httpx.Request | None) -> httpx.TransportError:
    """One aiohttp failure as the httpx exception that means the same thing."""
    message = str(exc) or type(exc).__name__
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(message, request=request)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(message, request=request)
    if isinstance(exc, (aiohttp.ServerTimeoutError, TimeoutError)):
        return httpx.ReadTimeout(message, request=request)
    if isinstance(
        exc,
        (
            aiohttp.ServerDisconnectedError,
            aiohttp.ClientPayloadError,
            aiohttp.ClientResponseError,
        ),
    ):
        return httpx.RemoteProtocolError(message, request=request)
    if isinstance(exc, aiohttp.InvalidURL):
        return httpx.UnsupportedProtocol(message, request=request)
    return httpx.ReadError(message, request=request)


# The progress callback of the request this task is sending (`send_attempt`'s
# `_Progress`, in httpcore's trace vocabulary), for `_ProgressRequest`.
_PROGRESS: contextvars.ContextVar[Any] = contextvars.ContextVar("outbox_progress", default=None)


class _ProgressRequest(aiohttp.ClientRequest):
    """Reports when the request starts going out (it has its connection; from here on
    it may have arrived).

    Why not aiohttp's TraceConfig: with a trace config on the session, every request
    builds Trace objects and awaits several signals (re-parsing its URL for them), a
    tenth of a busy worker's CPU; this costs a context-variable read. A request still
    waiting for a pooled or new connection has sent nothing: shutdown may release it.
    """

    async def send(self, conn: Any) -> aiohttp.ClientResponse:
        progress = _PROGRESS.get()
        if progress is not None:
            await progress("http11.send_request_headers.started", {})
        return await super().send(conn)


class DirectResponse:
    """The little of a response `send_attempt` reads, straight from aiohttp.

    The direct path (`AiohttpTransport.post`) skips building httpx.Request and
    httpx.Response objects, whose URL parsing and header models cost more CPU per
    webhook than the aiohttp wire itself (README, performance: the profile).
    Failures are translated into the same httpx exceptions as the transport's.
    """

    __slots__ = ("_response",)

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response

    @property
    def status_code(self) -> int:
        return self._response.status

    @property
    def reason_phrase(self) -> str:
        return self._response.reason or ""

    @property
    def headers(self) -> Mapping[str, str]:
        return self._response.headers  # case-insensitive, like httpx's

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _translate(exc, None) from exc

    async def aclose(self) -> None:
        # A connection whose body was not read to the end cannot be reused safely.
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()


class _ResponseStream(httpx.AsyncByteStream):
    """The response body, read chunk by chunk; closing early drops the connection."""

    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._response = response
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _translate(exc, self._request) from exc

    async def aclose(self) -> None:
        # A connection whose body was not read to the end cannot be reused safely.
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """httpx.AsyncBaseTransport over one aiohttp ClientSession (created on first use).

    The session never follows redirects, keeps no cookies, reads no proxy settings
    from the environment and does not decompress: the caller sees the raw bytes, so
    the body cap counts what actually came over the wire.
    """

    def __init__(
        self,
        *,
        policy: AddressPolicy,
        https_only: bool = False,
        max_connections: int = 100,
        keepalive_expiry: float = 15.0,
        ssl: bool = True,
    ) -> None:
        self._policy = policy
        self._max_connections = max_connections
        self._keepalive_expiry = keepalive_expiry
        self._ssl = ssl
        self._session: aiohttp.ClientSession | None = None
        self._checked = CheckedURLs(policy, https_only=https_only, build=lambda url: url)

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                # The SSRF guard: aiohttp dials exactly what this resolver returns.
                resolver=GuardedResolver(self._policy),
                limit=self._max_connections,
                limit_per_host=0,
                keepalive_timeout=self._keepalive_expiry,
                ssl=self._ssl,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False,
                trust_env=False,
                timeout=aiohttp.ClientTimeout(total=None),
                # httpx already set every header it wants; aiohttp adds none of its own.
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
                request_class=_ProgressRequest,
            )
        return self._session

    async def post(
        self,
        url: str,
        headers: Mapping[str, str],
        body: bytes,
        *,
        deadline: float,
        trace: Any = None,
    ) -> DirectResponse:
        """POST `body` with exactly `headers`; the same guard, timeouts and errors as
        `handle_async_request`, without the httpx request and response models."""
        target = self._checked.get(url)
        session = self._get_session()
        token = _PROGRESS.set(trace)
        try:
            response = await session.request(
                "POST",
                target,
                headers=headers,
                data=body or None,
                allow_redirects=False,
                timeout=_deadline_timeout(deadline),
                compress=None,
                chunked=None,
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _translate(exc, None) from exc
        finally:
            _PROGRESS.reset(token)
        return DirectResponse(response)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        # The scheme rule, and the guard for IP literals (they never reach the resolver).
        self._checked.get(str(request.url))
        session = self._get_session()
        body = await request.aread()
        headers = [
            (name.decode("latin-1"), value.decode("latin-1")) for name, value in request.headers.raw
        ]
        token = _PROGRESS.set(request.extensions.get("trace"))
        try:
            response = await session.request(
                request.method,
                str(request.url),
                headers=headers,
                data=body or None,
                allow_redirects=False,
                timeout=_timeout(request.extensions),
                compress=None,
                chunked=None,
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _translate(exc, request) from exc
        finally:
            _PROGRESS.reset(token)
        return httpx.Response(
            status_code=response.status,
            headers=list(response.raw_headers),
            stream=_ResponseStream(response, request),
            extensions={
                "http_version": _HTTP11,
                "reason_phrase": (response.reason or "").encode("latin-1", "replace"),
            },
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
            # Let aiohttp's transports finish closing before the loop goes away.
            await asyncio.sleep(0)

    async def __aenter__(self) -> AiohttpTransport:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc_value: BaseException | None = None,
        traceback: TracebackType | None = None,
    ) -> None:
        await self.aclose()
