"""One signed HTTP attempt, and the single place where httpx exceptions become outcomes.

An attempt's result is a value (`AttemptResult`), never an exception: the worker
records whatever happened and decides what comes next from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

from delivery.policy import RETRY_AFTER_STATUSES, Outcome, classify_status, parse_retry_after
from delivery.signing import signature_header
from outbox.clock import Clock

USER_AGENT = "webhook-outbox/0.1"


@dataclass(frozen=True, slots=True)
class OutgoingRequest:
    delivery_id: int
    url: str
    message_id: str
    body: bytes
    keys: list[bytes]
    timeout: float


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


TRANSPORTS = ("aiohttp", "httpx")


def build_http_client(
    *, max_connections: int, timeout: float, transport: str = "httpx"
) -> httpx.AsyncClient:
    """The client every attempt goes through: no redirects, no proxies from the environment.

    `transport="aiohttp"` keeps httpx's API but sends through delivery.transport, which
    is several times faster than httpcore's pool under load (see docs/readme-bench.md).
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, not {transport!r}")
    wire: httpx.AsyncBaseTransport | None = None
    if transport == "aiohttp":
        from delivery.transport import AiohttpTransport

        wire = AiohttpTransport(max_connections=max_connections)
    return httpx.AsyncClient(
        follow_redirects=False,
        trust_env=False,
        timeout=httpx.Timeout(timeout),
        limits=httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        ),
        headers={"user-agent": USER_AGENT},
        transport=wire,
    )


def _direct_transport(client: httpx.AsyncClient, url: httpx.URL) -> httpx.AsyncBaseTransport | None:
    """The client's transport for `url` when nothing in the client's own layers applies.

    Why: httpx's client layers (URL merging, cookie jar, auth and redirect loops, hooks)
    cost more CPU per webhook than the aiohttp wire itself (the benchmark profile put
    them at about 30 % of the worker's samples). A webhook POST uses none of them: no
    cookies, no auth, redirects are never followed. When the client has hooks or auth
    configured, the full `client.send` path is used so they still run.
    """
    if client.auth is not None or any(client.event_hooks.values()):
        return None
    # httpx has no public accessor; this honours `mounts` and proxies like send() does.
    return client._transport_for_url(url)


@contextlib.asynccontextmanager
async def _post(
    client: httpx.AsyncClient, request: OutgoingRequest, headers: dict[str, str]
) -> AsyncIterator[httpx.Response]:
    """POST with the client's headers and transport; the response streams and is closed."""
    outgoing = httpx.Request(
        "POST",
        request.url,
        headers={**client.headers, **headers},
        content=request.body,
        extensions={"timeout": httpx.Timeout(request.timeout).as_dict()},
    )
    transport = _direct_transport(client, outgoing.url)
    if transport is None:
        response = await client.send(outgoing, stream=True, follow_redirects=False)
    else:
        response = await transport.handle_async_request(outgoing)
        response.request = outgoing
    try:
        yield response
    finally:
        await response.aclose()


def _one_line(text: str, limit: int = 500) -> str:
    return " ".join(text.split())[:limit]


def _describe(exc: BaseException) -> str:
    detail = str(exc) or type(exc).__name__
    return _one_line(f"{type(exc).__name__}: {detail}")


async def send_attempt(
    client: httpx.AsyncClient,
    request: OutgoingRequest,
    clock: Clock,
    *,
    body_cap: int = 64 * 1024,
    excerpt_bytes: int = 2048,
) -> AttemptResult:
    """POST one signed delivery within one deadline that covers connect, send and body read."""
    started_at = clock.now()
    timestamp = int(started_at.timestamp())
    headers = {
        "content-type": "application/json",
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
        request_headers=headers,
    )
    try:
        async with asyncio.timeout(request.timeout):
            async with _post(client, request, headers) as response:
                body = bytearray()
                async for chunk in response.aiter_raw():
                    body += chunk
                    if len(body) >= body_cap:
                        break
        result.status_code = response.status_code
        result.outcome = classify_status(response.status_code)
        result.response_excerpt = bytes(body[:excerpt_bytes]).decode("utf-8", "replace")
        if result.outcome is not Outcome.SUCCEEDED:
            result.error = f"HTTP {response.status_code} {response.reason_phrase}".strip()
            location = response.headers.get("location")
            if 300 <= response.status_code < 400:
                result.error += f"; redirect to {_one_line(location or '?', 300)} not followed"
        if response.status_code in RETRY_AFTER_STATUSES:
            result.retry_after = parse_retry_after(response.headers.get("retry-after"), started_at)
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
        # Nothing reached the receiver: safe to retry.
        result.outcome = Outcome.RETRYABLE
        result.error = "connect failed: " + _describe(exc)
    except TimeoutError:
        result.outcome = Outcome.AMBIGUOUS
        result.error = f"deadline of {request.timeout:g}s passed; the request may have arrived"
    except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as exc:
        result.outcome = Outcome.AMBIGUOUS
        result.error = "failed after sending, may have arrived: " + _describe(exc)
    except httpx.HTTPError as exc:
        result.outcome = Outcome.RETRYABLE
        result.error = _describe(exc)
    result.duration_ms = int((time.perf_counter() - began) * 1000)
    return result
