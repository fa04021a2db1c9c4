"""`send_attempt`'s outcome table, exactly: what each answer, failure and deadline becomes.

The mutation run of `delivery/http.py` (docs/mutation.md) showed which parts of the
classification no fast test pinned; each test here pins one of them against a real
receiver on 127.0.0.1 (the scripted one of tests/delivery/scripted.py writes exact bytes),
through both transports where the transport does not decide the answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
from collections.abc import AsyncIterator, Mapping

import httpx
import pytest

from delivery.errors import DeliveryConfigurationError
from delivery.http import (
    DeliveryClient,
    OutgoingRequest,
    _describe,
    _via,
    build_http_client,
    send_attempt,
)
from delivery.policy import Outcome
from delivery.receiver import Receiver
from delivery.wire import WireTransport
from outbox.clock import ManualClock
from tests.delivery.scripted import HANG_UP, scripted
from tests.helpers import LOOPBACK, until

KEY = b"k" * 32
START = dt.datetime(2026, 12, 1, 12, 0, 0, tzinfo=dt.UTC)


@pytest.fixture(params=["wire", "httpx"])
async def client(request: pytest.FixtureRequest) -> AsyncIterator[DeliveryClient]:
    async with build_http_client(
        max_connections=10, timeout=5, transport=request.param, allowed_networks=LOOPBACK
    ) as built:
        yield built


def outgoing(
    url: str,
    *,
    deadline: float = 5.0,
    overrides: Mapping[int, Outcome] | None = None,
    retry_after_max: float = 3600.0,
    extra_headers: Mapping[str, str] | None = None,
) -> OutgoingRequest:
    return OutgoingRequest(
        delivery_id=7,
        url=url,
        message_id="msg_7",
        body=b'{"a":1}',
        keys=[KEY],
        timeout=deadline,
        status_overrides=overrides or {},
        retry_after_max=retry_after_max,
        extra_headers=extra_headers or {},
    )


async def test_the_default_read_cap_is_64_kib_and_the_default_excerpt_2048_bytes(
    client: httpx.AsyncClient,
) -> None:
    """A body announced longer than it is, stalled right after 64 KiB: the default cap
    stops reading there (succeeded at once); one byte more of cap would wait for the
    deadline (ambiguous)."""
    body = b"".join(b"%07d\n" % n for n in range(8192))  # 65,536 bytes
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n"
    async with scripted(head + body) as server:
        result = await send_attempt(client, outgoing(server.url, deadline=2.0), ManualClock())
    assert (result.outcome, result.status_code, result.error) == (Outcome.SUCCEEDED, 200, None)
    assert result.response_excerpt == body[:2048].decode()


async def test_a_body_as_long_as_the_cap_is_read_no_further(client: httpx.AsyncClient) -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n"
    async with scripted(head + b"z" * 10) as server:
        result = await send_attempt(
            client, outgoing(server.url, deadline=2.0), ManualClock(), body_cap=10, excerpt_bytes=4
        )
    assert (result.outcome, result.response_excerpt) == (Outcome.SUCCEEDED, "zzzz")


@pytest.mark.parametrize(
    ("status", "location", "error"),
    [
        (300, "/a", "HTTP 300 Status; redirect to /a not followed"),
        (399, "/b", "HTTP 399 Status; redirect to /b not followed"),
        (301, None, "HTTP 301 Moved Permanently; redirect to ? not followed"),
        (400, "/c", "HTTP 400 Bad Request"),
        (299, "/d", None),
    ],
)
async def test_only_3xx_answers_record_where_they_pointed(
    client: httpx.AsyncClient,
    receiver: Receiver,
    status: int,
    location: str | None,
    error: str | None,
) -> None:
    headers = {"Location": location} if location else {}
    url = receiver.route(f"/s{status}", status=status, headers=headers)
    result = await send_attempt(client, outgoing(url), ManualClock(START))
    assert result.error == error
    assert result.location == (
        ("?" if location is None else location) if error and status < 400 else None
    )


async def test_a_long_location_is_kept_to_300_characters_on_one_line(
    client: httpx.AsyncClient, receiver: Receiver
) -> None:
    target = "/" + "x" * 400
    url = receiver.route("/far", status=302, headers={"Location": target})
    result = await send_attempt(client, outgoing(url), ManualClock(START))
    assert result.location == target[:300]
    assert result.error == f"HTTP 302 Found; redirect to {target[:300]} not followed"


async def test_an_empty_reason_phrase_leaves_no_trailing_space(
    client: httpx.AsyncClient,
) -> None:
    async with scripted(b"HTTP/1.1 500 \r\nContent-Length: 0\r\n\r\n") as server:
        result = await send_attempt(client, outgoing(server.url), ManualClock(START))
    assert (result.outcome, result.error) == (Outcome.RETRYABLE, "HTTP 500")


async def test_the_excerpt_is_text_postgresql_accepts(client: httpx.AsyncClient) -> None:
    body = b"a\x00b\xffc"
    head = b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n" % len(body)
    async with scripted(head + body) as server:
        result = await send_attempt(client, outgoing(server.url), ManualClock(START))
    assert result.response_excerpt == "a\ufffdb\ufffdc"
    assert (result.outcome, result.status_code) == (Outcome.PERMANENT, 400)


@pytest.mark.parametrize(
    ("status", "outcome", "disables"),
    [
        (410, Outcome.PERMANENT, True),
        (500, Outcome.PERMANENT, False),
        (404, Outcome.RETRYABLE, False),
    ],
)
async def test_the_endpoints_status_overrides_decide(
    client: httpx.AsyncClient,
    receiver: Receiver,
    status: int,
    outcome: Outcome,
    disables: bool,
) -> None:
    overrides = {500: Outcome.PERMANENT, 404: Outcome.RETRYABLE}
    url = receiver.route(f"/o{status}", status=status)
    result = await send_attempt(client, outgoing(url, overrides=overrides), ManualClock(START))
    assert (result.outcome, result.disables_endpoint) == (outcome, disables)


async def test_retry_after_is_clamped_to_the_requests_maximum(
    client: httpx.AsyncClient, receiver: Receiver
) -> None:
    url = receiver.route("/later", status=429, headers={"Retry-After": "500"})
    result = await send_attempt(client, outgoing(url, retry_after_max=60), ManualClock(START))
    assert (result.outcome, result.retry_after) == (Outcome.RETRYABLE, 60)
    date = receiver.route(
        "/date", status=503, headers={"Retry-After": "Tue, 01 Dec 2026 12:00:30 GMT"}
    )
    result = await send_attempt(client, outgoing(date), ManualClock(START))
    assert result.retry_after == 30


async def test_a_407_without_a_proxy_is_the_receivers_answer(
    client: httpx.AsyncClient,
) -> None:
    """407 is only the egress proxy's refusal when the attempt went through one."""
    answer = b"HTTP/1.1 407 Proxy Authentication Required\r\nContent-Length: 0\r\n\r\n"
    async with scripted(answer) as server:
        result = await send_attempt(client, outgoing(server.url), ManualClock(START))
    assert (result.outcome, result.error) == (
        Outcome.PERMANENT,
        "HTTP 407 Proxy Authentication Required",
    )


async def test_signed_headers_and_the_recorded_ones(
    client: httpx.AsyncClient, receiver: Receiver
) -> None:
    """Custom headers go out but are recorded by name only; ours win over theirs."""
    url = receiver.route("/h", status=204)
    extra = {"authorization": "Bearer s3cret", "webhook-id": "forged"}
    result = await send_attempt(client, outgoing(url, extra_headers=extra), ManualClock(START))
    [received] = receiver.received("/h")
    stamp = str(int(START.timestamp()))
    assert received.headers["authorization"] == "Bearer s3cret"
    assert received.headers["webhook-id"] == "msg_7"
    assert received.headers["webhook-timestamp"] == stamp
    assert received.headers["accept-encoding"] == "identity"
    assert received.headers["content-type"] == "application/json"
    assert result.request_headers["authorization"] == "[redacted]"
    assert result.request_headers["webhook-id"] == "msg_7"
    assert result.request_headers["webhook-timestamp"] == stamp
    # The attempt row's names are the lower-case names sent (an operator reads them).
    assert sorted(result.request_headers) == [
        "accept-encoding",
        "authorization",
        "content-type",
        "webhook-id",
        "webhook-signature",
        "webhook-timestamp",
    ]
    assert result.request_headers["webhook-signature"] == received.headers["webhook-signature"]
    assert result.request_headers["content-type"] == "application/json"
    assert result.request_headers["accept-encoding"] == "identity"
    assert (result.delivery_id, result.started_at, result.outcome) == (7, START, Outcome.SUCCEEDED)
    assert "s3cret" not in repr(result)


async def test_a_deadline_before_the_request_was_sent_is_retryable() -> None:
    """Waiting for a connection (the only one is busy) is cut by the deadline before a
    byte of the request went out: nothing can have arrived."""
    async with (
        build_http_client(
            max_connections=1, timeout=5, transport="wire", allowed_networks=LOOPBACK
        ) as one,
        scripted(delay=1.0) as server,
    ):
        busy = asyncio.create_task(send_attempt(one, outgoing(server.url), ManualClock(START)))
        await until(lambda: server.bodies, "the first request to hold the only connection")
        queued = await send_attempt(one, outgoing(server.url, deadline=0.2), ManualClock(START))
        assert (await busy).outcome is Outcome.SUCCEEDED
    assert (queued.outcome, queued.status_code) == (Outcome.RETRYABLE, None)
    assert queued.error == "deadline of 0.2s passed before the request was sent"


async def test_deadline_messages_say_how_far_the_attempt_got(
    client: httpx.AsyncClient,
) -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"
    async with scripted(head) as server:
        body_late = await send_attempt(
            client, outgoing(server.url, deadline=0.3), ManualClock(START)
        )
    assert (body_late.outcome, body_late.status_code) == (Outcome.AMBIGUOUS, 200)
    assert body_late.error == (
        "deadline of 0.3s passed reading the response body after status 200; "
        "the request may have arrived"
    )
    async with scripted(b"HTTP/1.1 200 OK\r\n", delay=0) as server:
        head_late = await send_attempt(
            client, outgoing(server.url, deadline=0.3), ManualClock(START)
        )
    assert (head_late.outcome, head_late.status_code) == (Outcome.AMBIGUOUS, None)
    assert head_late.error == (
        "deadline of 0.3s passed waiting for the response; the request may have arrived"
    )


async def test_a_connection_dropped_after_sending_names_the_failure(
    client: DeliveryClient,
) -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        result = await send_attempt(
            client, outgoing(f"http://127.0.0.1:{port}/drop"), ManualClock(START)
        )
    finally:
        server.close()
        await server.wait_closed()
    assert result.outcome is Outcome.AMBIGUOUS
    closed = {
        True: "the server closed the connection without sending a response",  # the wire
        False: "Server disconnected without sending a response.",  # httpcore
    }[isinstance(client.delivery_transport, WireTransport)]
    assert result.error == f"failed after sending, may have arrived: RemoteProtocolError: {closed}"
    assert result.status_code is None


@pytest.mark.parametrize("whose", ["default", "endpoint"])
async def test_a_407_from_the_egress_proxy_is_retryable_and_says_whose(
    whose: str, receiver: Receiver
) -> None:
    """Plain HTTP through a proxy that reads the request and answers 407: nothing reached
    the receiver, so it is retried (a 407 of the receiver's own is permanent, above)."""
    refusal = b"HTTP/1.1 407 Proxy Authentication Required\r\nContent-Length: 0\r\n\r\n"
    async with scripted(refusal) as proxy:
        proxy_url = f"http://127.0.0.1:{proxy.port}"
        async with build_http_client(
            max_connections=2,
            timeout=5,
            allowed_networks=LOOPBACK,
            proxy=proxy_url if whose == "default" else None,
        ) as through:
            request = outgoing(receiver.route("/behind", status=204))
            if whose == "endpoint":
                request = dataclasses.replace(request, proxy=proxy_url)
            result = await send_attempt(through, request, ManualClock(START))
    assert proxy.heads[0].startswith(b"POST http://127.0.0.1:%d/behind " % receiver.port)
    assert receiver.requests == []
    assert (result.outcome, result.status_code, result.disables_endpoint) == (
        Outcome.RETRYABLE,
        407,
        False,
    )
    assert result.error == (
        "HTTP 407 from the egress proxy: it refused the credentials in the proxy "
        "URL (or needs some); fix OUTBOX_HTTP_PROXY or the endpoint's proxy"
    )


async def test_failures_name_the_proxy_they_went_through_never_its_credentials() -> None:
    """`_via` is what an operator reads after a failure past the proxy."""
    plain = httpx.AsyncClient()
    async with (
        build_http_client(
            max_connections=1, timeout=1, proxy="http://user:pw@10.1.2.3:3128"
        ) as proxied,
        build_http_client(max_connections=1, timeout=1) as direct,
    ):
        request = outgoing("http://example.com/hook")
        own = dataclasses.replace(request, proxy="http://u:secret@10.9.9.9:8080")
        broken = dataclasses.replace(request, proxy="ftp://nonsense")
        assert _via(proxied, request) == " through the proxy 10.1.2.3:3128"
        assert _via(direct, own) == " through the proxy 10.9.9.9:8080"
        assert _via(proxied, own) == " through the proxy 10.9.9.9:8080"
        assert _via(direct, broken) == " through the endpoint's proxy"
        assert _via(direct, request) == ""
        assert _via(plain, request) == ""
    await plain.aclose()


def test_an_exception_is_described_by_its_type_and_message_on_one_line() -> None:
    assert _describe(httpx.ReadError("")) == "ReadError: ReadError"
    assert _describe(httpx.ReadError("peer\nreset  it")) == "ReadError: peer reset it"
    assert _describe(httpx.ReadError("x" * 600)) == "ReadError: " + "x" * 489


async def test_the_httpx_transport_refuses_a_proxy_and_shows_none() -> None:
    with pytest.raises(DeliveryConfigurationError) as refused:
        build_http_client(
            max_connections=1, timeout=1, transport="httpx", proxy="http://10.1.2.3:3128"
        )
    assert str(refused.value) == (
        "OUTBOX_HTTP_PROXY needs OUTBOX_HTTP_TRANSPORT=wire (the default); the httpx "
        "transport sends directly"
    )
    async with (
        build_http_client(max_connections=1, timeout=1, transport="httpx") as httpx_client,
        build_http_client(max_connections=1, timeout=1) as wire_client,
    ):
        assert (httpx_client.proxy, wire_client.proxy) == (None, None)


async def test_on_start_is_called_once_when_the_request_leaves_the_pool(
    client: httpx.AsyncClient, receiver: Receiver
) -> None:
    """Shutdown tells started attempts from queued ones by it (Worker._started)."""
    started: list[int] = []
    result = await send_attempt(
        client,
        outgoing(receiver.route("/started", status=204)),
        ManualClock(START),
        on_start=lambda: started.append(1),
    )
    assert (result.outcome, started) == (Outcome.SUCCEEDED, [1])


async def test_a_failure_after_sending_through_the_default_proxy_names_it(
    receiver: Receiver,
) -> None:
    """The proxy read the whole request and hung up: it may have passed it on."""
    async with (
        scripted(HANG_UP) as proxy,
        build_http_client(
            max_connections=2,
            timeout=5,
            allowed_networks=LOOPBACK,
            proxy=f"http://user:pw@127.0.0.1:{proxy.port}",
        ) as through,
    ):
        result = await send_attempt(
            through, outgoing(receiver.route("/behind")), ManualClock(START)
        )
    assert proxy.bodies == [b'{"a":1}']
    assert result.outcome is Outcome.AMBIGUOUS
    assert result.error == (
        f"failed after sending through the proxy 127.0.0.1:{proxy.port}, may have arrived: "
        "RemoteProtocolError: the server closed the connection without sending a response"
    )


async def test_a_transport_failing_before_the_request_went_out_is_retryable() -> None:
    """A client's own transport (here httpx's mock, which never reports sending) that
    fails before the request went out: nothing can have arrived."""

    def reset(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadError("reset by peer")

    async with httpx.AsyncClient(transport=httpx.MockTransport(reset)) as own:
        result = await send_attempt(own, outgoing("http://example.com/hook"), ManualClock(START))
    assert (result.outcome, result.error) == (
        Outcome.RETRYABLE,
        "failed before sending: ReadError: reset by peer",
    )


async def test_any_other_httpx_error_is_retryable_with_its_text() -> None:
    """A plain httpx client (not from build_http_client) given a scheme it cannot send."""
    async with httpx.AsyncClient() as plain:
        result = await send_attempt(plain, outgoing("ftp://example.com/hook"), ManualClock(START))
    assert result.outcome is Outcome.RETRYABLE
    assert result.error == (
        "UnsupportedProtocol: Request URL has an unsupported protocol 'ftp://'."
    )
    assert result.status_code is None


async def test_the_duration_is_the_attempts_wall_time_in_milliseconds(
    client: httpx.AsyncClient, receiver: Receiver
) -> None:
    url = receiver.route("/slowish", status=204, delay=0.3)
    result = await send_attempt(client, outgoing(url), ManualClock(START))
    assert result.outcome is Outcome.SUCCEEDED
    assert 290 <= result.duration_ms < 5000


@pytest.mark.parametrize("transport", ["wire", "httpx"])
async def test_the_built_clients_own_api_follows_no_redirect_and_keeps_its_timeout(
    receiver: Receiver, transport: str
) -> None:
    """Attempts pass their own deadline and never follow a redirect; the client's API,
    for any other caller, does the same by default: `timeout` bounds each wait, a 3xx
    is returned as it came."""
    async with build_http_client(
        max_connections=2, timeout=0.3, transport=transport, allowed_networks=LOOPBACK
    ) as built:
        moved = await built.post(
            receiver.route("/moved", status=302, headers={"location": receiver.url("/ok")})
        )
        assert moved.status_code == 302
        with pytest.raises(httpx.ReadTimeout):
            async with asyncio.timeout(5):
                await built.post(receiver.route("/slow", delay=3.0))
    assert receiver.received("/ok") == []


async def test_the_httpx_transport_keeps_to_max_connections() -> None:
    async with (
        scripted(delay=0.2) as server,
        build_http_client(
            max_connections=1, timeout=5, transport="httpx", allowed_networks=LOOPBACK
        ) as built,
    ):
        results = await asyncio.gather(
            *(send_attempt(built, outgoing(server.url), ManualClock(START)) for _ in "abc")
        )
    assert [r.outcome for r in results] == [Outcome.SUCCEEDED] * 3
    assert server.most_open == 1
