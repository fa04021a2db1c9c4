"""One signed HTTP attempt, and the single place where httpx exceptions become outcomes.

An attempt's result is a value (`AttemptResult`), never an exception: the worker
records whatever happened and decides what comes next from it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import time
import weakref
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from delivery.errors import (
    AddressRefusedError,
    DeliveryConfigurationError,
    InvalidEndpointURLError,
)
from delivery.oauth import OAUTH_FAILURE_PREFIX, TokenCache, TokenError
from delivery.policy import (
    RETRY_AFTER_MAX_SECONDS,
    RETRY_AFTER_STATUSES,
    Outcome,
    classify_status,
    parse_retry_after,
)
from delivery.signing import SigningKey, signature_header
from delivery.ssrf import AddressPolicy, build_guarded_transport
from delivery.wire import IDENTITY_EXTENSION, PROXY_EXTENSION, WireResponse, WireTransport
from outbox.clock import Clock
from outbox.endpoint_auth import ClientCertificate, OAuthClient
from outbox.urls import parse_proxy_url

USER_AGENT = "webhook-outbox/0.1"


@dataclass(frozen=True, slots=True)
class OutgoingRequest:
    delivery_id: int
    url: str
    message_id: str
    body: bytes
    keys: list[SigningKey]
    timeout: float
    status_overrides: Mapping[int, Outcome] = field(default_factory=dict)
    retry_after_max: float = RETRY_AFTER_MAX_SECONDS
    # The endpoint's custom headers (validated when saved); ours are applied after them.
    extra_headers: Mapping[str, str] = field(default_factory=dict)
    # The endpoint's own egress proxy URL (decrypted; a secret), overriding the default.
    proxy: str | None = field(default=None, repr=False)
    # Authenticated delivery (outbox.endpoint_auth): the client certificate presented over
    # HTTPS (mutual TLS), and the OAuth2 client whose bearer token goes with the request.
    client_certificate: ClientCertificate | None = field(default=None, repr=False)
    oauth: OAuthClient | None = field(default=None, repr=False)


@dataclass(slots=True)
class AttemptResult:
    delivery_id: int
    started_at: dt.datetime
    duration_ms: int
    outcome: Outcome
    status_code: int | None = None
    error: str | None = None
    response_excerpt: str | None = None
    request_headers: dict[str, str] = field(default_factory=dict)
    retry_after: float | None = None
    disables_endpoint: bool = False  # 410 Gone (unless the endpoint overrides it)
    location: str | None = None  # where a 3xx pointed; recorded, never followed


class _Progress:
    """How far one request got, from httpx's trace hook or the wire's `on_send`.

    The line between "nothing was sent" (safe to retry) and "it may have arrived"
    (ambiguous) is the moment the request headers start going out. A timeout that
    fires before that is a connect or pool failure.
    """

    __slots__ = ("on_start", "sending", "started")

    def __init__(self, on_start: Callable[[], None] | None) -> None:
        self.on_start = on_start
        self.started = False
        self.sending = False

    async def __call__(self, event: str, info: Mapping[str, Any]) -> None:
        if event.endswith("send_request_headers.started"):
            self.send_started()
        else:
            self._start()

    def send_started(self) -> None:
        """The request's first byte is going out: the trace's send-started event, and
        the wire's `on_send` (a plain call, no coroutine per attempt)."""
        self._start()
        self.sending = True

    def _start(self) -> None:
        if not self.started:
            self.started = True
            if self.on_start is not None:
                self.on_start()


TRANSPORTS = ("wire", "httpx")
DEFAULT_TRANSPORT = "wire"


class DeliveryClient(httpx.AsyncClient):
    """The httpx client attempts go through, knowing the transport it was built with.

    Why a subclass: `send_attempt` posts straight through that transport when the client
    adds nothing of its own (no auth, no event hooks), skipping httpx's request and
    response models, and httpx has no public accessor for a client's transport.
    """

    def __init__(
        self, *, transport: httpx.AsyncBaseTransport, proxy: str | None, **kwargs: Any
    ) -> None:
        super().__init__(transport=transport, **kwargs)
        self.delivery_transport = transport
        # The default egress proxy as host:port (never its credentials), or None.
        self.proxy = proxy
        # The default headers as a dict, taken at the first direct attempt (_client_headers).
        self.base_headers: dict[str, str] | None = None


def build_http_client(
    *,
    max_connections: int,
    timeout: float,
    allowed_networks: Sequence[str] = (),
    https_only: bool = False,
    transport: str = DEFAULT_TRANSPORT,
    proxy: str | None = None,
) -> DeliveryClient:
    """The client every attempt goes through.

    Every connection passes the SSRF guard (private, loopback and other special
    ranges refused unless listed in `allowed_networks`), redirects are never
    followed and proxies from the environment are ignored. `transport="wire"` (our
    own HTTP/1.1 wire, delivery.wire, the default and production path) keeps httpx's
    API and is several times faster than `"httpx"` (httpcore's own pool, through the
    same guard) under load (see docs/performance.md). `proxy`
    (`http://user:password@host:port`, OUTBOX_HTTP_PROXY) is the egress proxy of every
    attempt; endpoints may name their own. Only the wire sends through proxies.
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, not {transport!r}")
    policy = AddressPolicy(allowed_networks)
    wire: httpx.AsyncBaseTransport
    shown: str | None = None
    if transport == "wire":
        wire = WireTransport(
            policy=policy, https_only=https_only, max_connections=max_connections, proxy=proxy
        )
        shown = wire.proxy
    else:
        if proxy is not None:
            raise DeliveryConfigurationError(
                "OUTBOX_HTTP_PROXY needs OUTBOX_HTTP_TRANSPORT=wire (the default); the httpx "
                "transport sends directly"
            )
        limits = httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        )
        wire = build_guarded_transport(policy, https_only=https_only, limits=limits)
    return DeliveryClient(
        transport=wire,
        proxy=shown,
        follow_redirects=False,
        trust_env=False,
        timeout=httpx.Timeout(timeout),
        headers={"user-agent": USER_AGENT},
    )


def _storable(raw: bytes) -> str:
    """Response bytes as text PostgreSQL accepts: invalid UTF-8 and NUL become U+FFFD."""
    return raw.decode("utf-8", "replace").replace("\x00", "\ufffd")


def _direct_transport(client: httpx.AsyncClient) -> httpx.AsyncBaseTransport | None:
    """The transport an attempt may call directly: the one `build_http_client` chose,
    when the client adds nothing of its own.

    Why: httpx's client layers (URL merging, cookie jar, auth and redirect loops, hooks)
    cost more CPU per webhook than the wire itself (the benchmark profile put them at
    about 30 % of the worker's samples). A webhook POST uses none of them: no cookies,
    no auth, redirects are never followed. When the client has hooks or auth
    configured, or is not a `DeliveryClient`, the full `client.send` path is used.
    """
    if (
        not isinstance(client, DeliveryClient)
        or client.auth is not None
        or any(client.event_hooks.values())
    ):
        return None
    return client.delivery_transport


class _Response(Protocol):
    """What send_attempt reads of a response: httpx.Response or the wire's own."""

    @property
    def status_code(self) -> int: ...

    @property
    def reason_phrase(self) -> str: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    def aiter_raw(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


def _direct_wire(client: httpx.AsyncClient) -> WireTransport | None:
    """The wire when the client adds nothing of its own (no hooks, auth): then the
    attempt posts through it directly (`WireTransport.post`)."""
    wire = _direct_transport(client)
    return wire if isinstance(wire, WireTransport) else None


def _client_headers(client: DeliveryClient) -> dict[str, str]:
    """The client's default headers (lower-case names), read once per client."""
    found = client.base_headers
    if found is None:
        found = client.base_headers = dict(client.headers)
    return found


async def _post_httpx(
    client: httpx.AsyncClient,
    transport: httpx.AsyncBaseTransport | None,
    request: OutgoingRequest,
    headers: dict[str, str],
    progress: _Progress,
) -> httpx.Response:
    """POST through httpx's API (a client with hooks or auth, or the httpx transport);
    the response streams, and the caller closes it."""
    extensions: dict[str, Any] = {
        "timeout": httpx.Timeout(request.timeout).as_dict(),
        "trace": progress,
    }
    if request.proxy is not None:
        if not _sends_through_wire(client):
            raise httpx.ConnectError(
                "the endpoint has a proxy, which only the wire transport sends through "
                "(a client from build_http_client); set OUTBOX_HTTP_TRANSPORT=wire (the default)"
            )
        extensions[PROXY_EXTENSION] = request.proxy
    if request.client_certificate is not None:
        if not _sends_through_wire(client):
            raise httpx.ConnectError(
                "the endpoint has a client certificate, which only the wire transport "
                "presents; set OUTBOX_HTTP_TRANSPORT=wire (the default)"
            )
        extensions[IDENTITY_EXTENSION] = request.client_certificate
    outgoing = httpx.Request(
        "POST",
        request.url,
        headers={**client.headers, **headers},
        content=request.body,
        extensions=extensions,
    )
    if transport is None:
        return await client.send(outgoing, stream=True, follow_redirects=False)
    response = await transport.handle_async_request(outgoing)
    response.request = outgoing
    return response


async def _read_capped(response: _Response, body_cap: int) -> bytearray:
    """The body's bytes as they come, until its end or past `body_cap`."""
    if isinstance(response, WireResponse):
        return await response.read_capped(body_cap)
    body = bytearray()
    async for chunk in response.aiter_raw():
        body += chunk
        if len(body) >= body_cap:
            break
    return body


def _through_proxy(client: httpx.AsyncClient, request: OutgoingRequest) -> bool:
    return request.proxy is not None or (isinstance(client, DeliveryClient) and bool(client.proxy))


def _via(client: httpx.AsyncClient, request: OutgoingRequest) -> str:
    """' through the proxy host:port' when the attempt went through one (never its
    credentials): a proxy that refuses a plain-HTTP request without reading its body
    resets the connection, and the operator must see where that happened."""
    if request.proxy is not None:
        try:
            return f" through the proxy {parse_proxy_url(request.proxy).display}"
        except InvalidEndpointURLError:
            return " through the endpoint's proxy"
    if isinstance(client, DeliveryClient) and client.proxy:
        return f" through the proxy {client.proxy}"
    return ""


def _certificate_hint(request: OutgoingRequest, exc: BaseException) -> str:
    """Why an HTTPS receiver may close without answering: with TLS 1.3 the client's
    handshake ends before the server checks the client certificate, so a refused (or
    missing) certificate shows up as a close, or an alert, after the request went out."""
    if not request.url.startswith("https://"):
        return ""
    message = str(exc).lower()
    if "without sending a response" not in message and "alert" not in message:
        return ""
    if request.client_certificate is None:
        return (
            "; a receiver that requires a client certificate (mutual TLS) closes like this: "
            "this endpoint presents none (set one with `outbox endpoints set-auth`)"
        )
    return (
        "; a receiver that requires a client certificate closes like this when it refuses "
        "the endpoint's (check it is issued by the CA the receiver trusts)"
    )


def _sends_through_wire(client: httpx.AsyncClient) -> bool:
    return isinstance(client, DeliveryClient) and isinstance(
        client.delivery_transport, WireTransport
    )


def _one_line(text: str, limit: int = 500) -> str:
    return " ".join(text.split())[:limit]


def _describe(exc: BaseException) -> str:
    detail = str(exc) or type(exc).__name__
    return _one_line(f"{type(exc).__name__}: {detail}")


_TOKEN_CACHES: weakref.WeakKeyDictionary[httpx.AsyncClient, TokenCache] = (
    weakref.WeakKeyDictionary()
)


def token_cache(client: httpx.AsyncClient, clock: Clock) -> TokenCache:
    """The OAuth2 access tokens of the attempts made through `client`, in this process."""
    found = _TOKEN_CACHES.get(client)
    if found is None:
        found = _TOKEN_CACHES[client] = TokenCache(clock)
    return found


async def send_attempt(
    client: httpx.AsyncClient,
    request: OutgoingRequest,
    clock: Clock,
    *,
    body_cap: int = 64 * 1024,
    excerpt_bytes: int = 2048,
    on_start: Callable[[], None] | None = None,
) -> AttemptResult:
    """One attempt; for an endpoint with OAuth2 client credentials, with its bearer token.

    The token comes from the cache (`token_cache`) or the token endpoint; a token
    endpoint that fails gives the attempt its clear error (delivery.oauth says which
    outcome). A 401 from the receiver with a cached token refreshes the token once and
    makes the attempt once more. The token is recorded only as `[redacted]`.
    """
    expired = request.client_certificate and request.client_certificate.not_after
    if expired and expired <= clock.now():
        # The receiver would refuse it (after our request went out, with TLS 1.3): say why
        # now, and send nothing. Retryable: a new certificate lets the retries through.
        return AttemptResult(
            delivery_id=request.delivery_id,
            started_at=clock.now(),
            duration_ms=0,
            outcome=Outcome.RETRYABLE,
            error=(
                f"the endpoint's client certificate expired at {expired.isoformat()}; set a "
                "new one with `outbox endpoints set-auth`"
            ),
        )
    if request.oauth is None or (request.proxy is not None and not _sends_through_wire(client)):
        # No token to fetch, or an endpoint proxy this client cannot send through: then
        # the token request must not go out directly either, and the POST fails clearly.
        return await _send_once(
            client,
            request,
            clock,
            body_cap=body_cap,
            excerpt_bytes=excerpt_bytes,
            on_start=on_start,
        )
    tokens = token_cache(client, clock)
    # One deadline for the whole attempt: the token (or the wait for another attempt's
    # fetch of it), the POST, and on a 401 the new token and the POST again. Without it
    # an attempt could take several times its timeout and outlive its lease.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + request.timeout
    stale: str | None = None
    result: AttemptResult | None = None
    for _ in range(2):
        started_at = clock.now()
        began = time.perf_counter()
        left = round(deadline - loop.time(), 3)  # to the ms: it shows in messages
        if result is not None and left <= 0:
            return result  # no time left to try a new token: the 401 stands
        try:
            async with asyncio.timeout(left):
                token, fresh = await tokens.token(
                    client, request.oauth, within=left, stale=stale, proxy=request.proxy
                )
            left = round(deadline - loop.time(), 3)
            if left <= 0:
                raise TimeoutError
        except (TokenError, TimeoutError) as exc:
            if isinstance(exc, TokenError):
                problem, outcome = f"{exc}", exc.outcome
            else:
                problem, outcome = (
                    f"the OAuth token endpoint {request.oauth.token_url} did not answer "
                    f"within the attempt's {request.timeout:g}s",
                    Outcome.RETRYABLE,
                )
            return AttemptResult(
                delivery_id=request.delivery_id,
                started_at=started_at,
                duration_ms=int((time.perf_counter() - began) * 1000),
                outcome=outcome,
                error=_one_line(f"{OAUTH_FAILURE_PREFIX}{problem}"),
            )
        authorized = dataclasses.replace(
            request,
            timeout=left,
            extra_headers={**request.extra_headers, "authorization": f"Bearer {token}"},
        )
        result = await _send_once(
            client,
            authorized,
            clock,
            body_cap=body_cap,
            excerpt_bytes=excerpt_bytes,
            on_start=on_start,
        )
        if result.status_code != 401 or fresh:
            return result
        stale = token  # refused: the receiver may have revoked it before it expired
    assert result is not None
    return result


async def _send_once(
    client: httpx.AsyncClient,
    request: OutgoingRequest,
    clock: Clock,
    *,
    body_cap: int,
    excerpt_bytes: int,
    on_start: Callable[[], None] | None,
) -> AttemptResult:
    """POST one signed delivery within one deadline that covers connect, send and body read.

    The deadline is one `asyncio.timeout` around the whole exchange, so a receiver
    that trickles its answer a byte at a time, or accepts and never answers, is cut
    at `request.timeout` however it spreads its bytes (httpx's own timeouts are per
    read and would let a trickle run forever). At most `body_cap` bytes of the body
    are read; `excerpt_bytes` of them are kept. `on_start` is called once the request
    leaves the connection pool, which lets shutdown tell started attempts from
    queued ones.
    """
    started_at = clock.now()
    timestamp = int(started_at.timestamp())
    headers = {
        "content-type": "application/json",
        # Compressed answers could expand far past the read cap; ask for none.
        "accept-encoding": "identity",
        "webhook-id": request.message_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signature_header(
            request.keys, request.message_id, timestamp, request.body
        ),
    }
    began = time.perf_counter()
    result = AttemptResult(
        delivery_id=request.delivery_id,
        started_at=started_at,
        duration_ms=0,
        outcome=Outcome.AMBIGUOUS,
        # Custom headers are often credentials: the attempt row keeps their names only.
        # (`headers` itself is never changed below: it may be the row's dict.)
        request_headers=(
            {**dict.fromkeys(request.extra_headers, "[redacted]"), **headers}
            if request.extra_headers
            else headers
        ),
    )
    if request.extra_headers:
        headers = {**request.extra_headers, **headers}
    progress = _Progress(on_start)
    status: int | None = None
    transport = _direct_transport(client)
    try:
        async with asyncio.timeout(request.timeout):
            response: _Response
            if isinstance(transport, WireTransport):
                # Straight through the wire (see `_direct_transport`), in this coroutine:
                # no context manager or coroutine of its own per attempt.
                assert isinstance(client, DeliveryClient)  # _direct_transport said so
                response = await transport.post(
                    request.url,
                    {**_client_headers(client), **headers},
                    request.body,
                    deadline=request.timeout,
                    proxy=request.proxy,
                    identity=request.client_certificate,
                    on_send=progress.send_started,
                )
            else:
                response = await _post_httpx(client, transport, request, headers, progress)
            try:
                status = response.status_code
                body = await _read_capped(response, body_cap)
            finally:
                await response.aclose()
        classification = classify_status(response.status_code, request.status_overrides)
        result.status_code = response.status_code
        result.outcome = classification.outcome
        result.disables_endpoint = classification.disables_endpoint
        result.response_excerpt = _storable(bytes(body[:excerpt_bytes]))
        if result.outcome is not Outcome.SUCCEEDED:
            result.error = f"HTTP {response.status_code} {response.reason_phrase}".strip()
            if 300 <= response.status_code < 400:
                result.location = _one_line(response.headers.get("location") or "?", 300)
                result.error += f"; redirect to {result.location} not followed"
        if response.status_code == 407 and _through_proxy(client, request):
            # Plain HTTP through a proxy: its refusal arrives as a response, and nothing
            # reached the receiver. (HTTPS learns it from CONNECT, as a connect error.)
            result.outcome = Outcome.RETRYABLE
            result.disables_endpoint = False
            result.error = (
                "HTTP 407 from the egress proxy: it refused the credentials in the proxy "
                "URL (or needs some); fix OUTBOX_HTTP_PROXY or the endpoint's proxy"
            )
        if response.status_code in RETRY_AFTER_STATUSES:
            result.retry_after = parse_retry_after(
                response.headers.get("retry-after"), started_at, request.retry_after_max
            )
    except (AddressRefusedError, InvalidEndpointURLError, httpx.LocalProtocolError) as exc:
        # The SSRF guard, the scheme rule, or a request the wire will not frame (a control
        # character in a header, say), all before a byte is sent: the same request again
        # cannot succeed, so retrying only spends attempts.
        result.outcome = Outcome.PERMANENT
        result.error = _one_line(str(exc))
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
        # Nothing reached the receiver: safe to retry.
        result.outcome = Outcome.RETRYABLE
        result.error = "connect failed: " + _describe(exc)
    except TimeoutError:
        result.status_code = status
        if not progress.sending:
            result.outcome = Outcome.RETRYABLE
            result.error = f"deadline of {request.timeout:g}s passed before the request was sent"
        elif status is None:
            result.outcome = Outcome.AMBIGUOUS
            result.error = (
                f"deadline of {request.timeout:g}s passed waiting for the response; "
                "the request may have arrived"
            )
        else:
            result.outcome = Outcome.AMBIGUOUS
            result.error = (
                f"deadline of {request.timeout:g}s passed reading the response body after "
                f"status {status}; the request may have arrived"
            )
    except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as exc:
        if progress.sending:
            result.outcome = Outcome.AMBIGUOUS
            result.error = (
                f"failed after sending{_via(client, request)}, may have arrived: "
                + _describe(exc)
                + _certificate_hint(request, exc)
            )
        else:
            result.outcome = Outcome.RETRYABLE
            result.error = "failed before sending: " + _describe(exc)
    except httpx.HTTPError as exc:
        result.outcome = Outcome.RETRYABLE
        result.error = _describe(exc)
    result.duration_ms = int((time.perf_counter() - began) * 1000)
    return result
