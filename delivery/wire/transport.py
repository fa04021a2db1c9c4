"""The wire's face: `WireTransport.post` for webhook POSTs and httpx's transport API."""

from __future__ import annotations

import asyncio
import re
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import httpx
from yarl import URL

from delivery.errors import InvalidEndpointURLError
from delivery.ssrf import AddressPolicy, CheckedURLs, GuardedResolver, Resolver, system_resolver
from delivery.wire.connect import CONNECT_STAGGER_SECONDS, Connecting, _Target
from delivery.wire.connection import KEEPALIVE_EXPIRY, WireResponse, _Pool
from outbox.endpoint_auth import ClientCertificate
from outbox.urls import parse_proxy_url

_SEND_STARTED = "http11.send_request_headers.started"
_HTTP11 = b"HTTP/1.1"
# The httpx request extension carrying a request's own proxy URL (an endpoint's).
PROXY_EXTENSION = "outbox_proxy"
# The httpx request extension carrying a request's client certificate (mutual TLS).
IDENTITY_EXTENSION = "outbox_client_certificate"

Trace = Callable[[str, Mapping[str, Any]], Awaitable[None]]


# Request header lines as the httpx API path writes them: each name an RFC 9110 token,
# each value free of control characters but HTAB (NUL, CR or LF would end the line or
# the head early and let a value write headers, or a request, of its own).
_HEADER_LINES = re.compile(rb"(?:[!#$%&'*+.^_`|~0-9A-Za-z-]+: [^\x00-\x08\x0a-\x1f\x7f]*\r\n)*")
# Headers `post` writes itself from the URL and the body: a caller's would stand beside them.
_OWN_HEADERS = re.compile(r"(?im)^(?:host|content-length|transfer-encoding)[ \t]*:")
# Methods the httpx API path sends: their responses are framed like a POST's (HEAD's
# and CONNECT's are not, TRACE echoes the request).
_METHODS = frozenset({b"POST", b"PUT", b"PATCH", b"DELETE", b"GET", b"OPTIONS"})


class WireTransport(Connecting, httpx.AsyncBaseTransport):
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
        tls_factory: Callable[[], ssl.SSLContext] | None = None,
    ) -> None:
        """`ssl_context` defaults to the system's trust store with verification on;
        `resolver` (host, port -> addresses) to the system resolver. `proxy` is the
        egress proxy for every request (`http://user:password@host:port`, trusted
        configuration: its own address is not checked by the guard, and
        `proxy_resolver` resolves its name); a request's own proxy overrides it.
        `connect_stagger` is the Happy Eyeballs delay between addresses. `tls_factory`
        makes a fresh client TLS context (default: the system's trust store): the
        default one when `ssl_context` is not given, and one per client certificate
        (mutual TLS) a request presents."""
        self._resolver = GuardedResolver(policy, resolver)
        self._pool = _Pool(max_connections, keepalive_expiry)
        self._ssl_context = ssl_context
        self._tls_factory = tls_factory or ssl.create_default_context
        self._identity_contexts: dict[str, ssl.SSLContext] = {}
        self._identified: dict[tuple[str, str, str], _Target] = {}
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

    def _presenting(
        self, target: _Target, url: str, proxy: str | None, identity: ClientCertificate
    ) -> _Target:
        key = (url, proxy or "", identity.version)
        found = self._identified.get(key)
        if found is None:
            if len(self._identified) > 10_000:
                self._identified.clear()
            found = self._identified[key] = target.presenting(identity)
        return found

    async def post(
        self,
        url: str,
        headers: Mapping[str, str],
        body: bytes,
        *,
        deadline: float,
        trace: Trace | None = None,
        proxy: str | None = None,
        identity: ClientCertificate | None = None,
        on_send: Callable[[], None] | None = None,
    ) -> WireResponse:
        """POST `body` with exactly `headers` (plus Host and Content-Length); returns once
        the response head is in. The caller's own deadline bounds the whole exchange;
        `deadline` bounds getting a connection, as a connect timeout. `proxy` overrides
        the default proxy for this request (an endpoint's own); `identity` is the client
        certificate an HTTPS request presents (mutual TLS; ignored for plain HTTP).

        A `Host`, `Content-Length` or `Transfer-Encoding` in `headers` is refused, not
        overridden: the wire writes them from the URL and the body, and a second one
        beside them would let the receiver (or a proxy before it) frame the request
        differently. `InvalidEndpointURLError` then says which; nothing is sent.

        `on_send` is called, like `trace` with its send-started event, just before the
        request's first byte is written: a plain call, no coroutine per request.
        """
        target = (
            self._targets.get(url)
            if proxy is None and self._proxy is None
            else await self._proxied_target(url, proxy)
        )
        if identity is not None and target.tls:
            target = self._presenting(target, url, proxy, identity)
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
        return await self._exchange(
            target, head + body, trace, connect_timeout=deadline, on_send=on_send
        )

    async def _exchange(
        self,
        target: _Target,
        data: bytes,
        trace: Trace | None,
        *,
        connect_timeout: float | None,
        read_timeout: float | None = None,
        on_send: Callable[[], None] | None = None,
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
        response.forwarded = target.proxy is not None and not target.tls
        try:
            if trace is not None:
                await trace(_SEND_STARTED, {})
            if on_send is not None:
                on_send()
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
        identity = request.extensions.get(IDENTITY_EXTENSION)
        if identity is not None and target.tls:
            target = self._presenting(target, str(request.url), proxy, identity)
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
