"""The wire against hostile or broken receivers (issue 22): one test per defect found.

Scripted receivers on 127.0.0.1 write exact byte streams; where the defect is about
the outcome a delivery gets, the case also runs end to end through the relay and a
worker's `run_once()` on the real database, and reads the recorded outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx
import pytest
import uvloop
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.errors import InvalidEndpointURLError
from delivery.http import OutgoingRequest, build_http_client, send_attempt
from delivery.policy import Outcome
from delivery.ssrf import AddressPolicy
from delivery.wire import KEEPALIVE_EXPIRY, MAX_HEAD_BYTES, WireTransport
from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.db import make_async_engine
from outbox.relay import Relay
from tests.delivery.scripted import (
    OK,
    Monotonic,
    attempt,
    in_pieces,
    pooled,
    post_and_read,
    scripted,
    wire_with,
)
from tests.delivery.workers import make_worker
from tests.helpers import LOOPBACK, add_endpoint, rows, until

SERVER_ERROR = b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n"


async def deliver_one(
    engine: Engine,
    async_engine: AsyncEngine,
    http: httpx.AsyncClient,
    box: SecretBox,
    clock: ManualClock,
    event_type: str,
) -> dict[str, Any]:
    """Publish one event, relay it and run the worker once; the delivery row after it."""
    with engine.begin() as conn:
        publish(conn, event_type, {"n": 1})
    await Relay(async_engine, clock).run_until_idle()
    await make_worker(async_engine, http, box, clock, retry_schedule=(10.0,)).run_once()
    found = rows(
        engine,
        "SELECT d.* FROM deliveries d JOIN outbox_events e ON e.id = d.event_id "
        "WHERE e.event_type = :t",
        t=event_type,
    )
    assert len(found) == 1
    return dict(found[0])


def last_attempt(engine: Engine, delivery_id: int) -> Mapping[str, Any]:
    found = rows(
        engine,
        "SELECT * FROM delivery_attempts WHERE delivery_id = :d ORDER BY attempt_number DESC",
        d=delivery_id,
    )
    return dict(found[0])


# -- 1. bytes after a complete response: the connection is not reused -----------------


async def test_a_status_line_started_after_a_response_does_not_answer_the_next_request(
    http: httpx.AsyncClient,
) -> None:
    async with scripted(OK + b"HTTP/1.1 200 ", SERVER_ERROR) as server:
        first = await attempt(http, server.url)
        second = await attempt(http, server.url)
    assert (first.outcome, first.status_code) == (Outcome.SUCCEEDED, 200)
    assert (second.outcome, second.status_code) == (Outcome.RETRYABLE, 500)
    assert server.connections == 2


async def test_a_204_followed_by_bytes_does_not_answer_the_next_request(
    http: httpx.AsyncClient,
) -> None:
    no_content = b"HTTP/1.1 204 No Content\r\n\r\nHTTP/1.1 200 "
    async with scripted(no_content, SERVER_ERROR) as server:
        first = await attempt(http, server.url)
        second = await attempt(http, server.url)
    assert (first.outcome, first.status_code) == (Outcome.SUCCEEDED, 204)
    assert (second.outcome, second.status_code) == (Outcome.RETRYABLE, 500)
    assert server.connections == 2


async def test_even_a_line_break_after_a_response_keeps_the_connection_from_reuse(
    http: httpx.AsyncClient,
) -> None:
    async with scripted(OK + b"\r\n", OK) as server:
        first = await attempt(http, server.url)
        second = await attempt(http, server.url)
    assert [first.outcome, second.outcome] == [Outcome.SUCCEEDED] * 2
    assert server.connections == 2


async def test_another_endpoints_server_cannot_decide_an_outcome_on_a_shared_host(
    engine: Engine, async_engine: AsyncEngine, box: SecretBox, clock: ManualClock
) -> None:
    """Endpoint A's answer ends with the start of a status line; B, on the same host and
    port (so the same pooled connection), gets a 500 that must be recorded as one."""
    async with (
        scripted(OK + b"HTTP/1.1 200 ", SERVER_ERROR) as server,
        build_http_client(
            max_connections=10, timeout=5, transport="wire", allowed_networks=LOOPBACK
        ) as http,
    ):
        add_endpoint(engine, box, f"http://127.0.0.1:{server.port}/a", "a.*")
        add_endpoint(engine, box, f"http://127.0.0.1:{server.port}/b", "b.*")
        a = await deliver_one(engine, async_engine, http, box, clock, "a.created")
        b = await deliver_one(engine, async_engine, http, box, clock, "b.created")
    assert (a["state"], a["last_status_code"]) == ("succeeded", 200)
    assert (b["state"], b["last_status_code"]) == ("scheduled", 500)
    assert last_attempt(engine, b["id"])["outcome"] == "retryable"


# -- 2. trailers are bounded ----------------------------------------------------------


async def test_endless_trailer_lines_are_cut_at_the_head_cap(http: httpx.AsyncClient) -> None:
    endless = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n"
        + b"x-a: b\r\n" * (2 * 1024 * 1024 // 8)  # 2 MiB of trailers, never ended
    )
    began = time.monotonic()
    async with scripted(endless) as server:
        result = await attempt(http, server.url)
    assert result.outcome is Outcome.AMBIGUOUS
    assert f"the response trailers are over {MAX_HEAD_BYTES} bytes" in (result.error or "")
    assert time.monotonic() - began < 2  # cut when the cap is reached, not at the deadline


async def test_one_endless_trailer_line_is_cut_at_the_head_cap(http: httpx.AsyncClient) -> None:
    endless = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nx-a: "
        + b"b" * (2 * 1024 * 1024)
    )
    async with scripted(endless) as server:
        result = await attempt(http, server.url)
    assert result.outcome is Outcome.AMBIGUOUS
    assert f"over {MAX_HEAD_BYTES} bytes after the head without a body byte" in (result.error or "")


# -- 3. a discarded connection is aborted ---------------------------------------------


async def test_a_discarded_connection_drops_what_the_receiver_never_read(
    http: httpx.AsyncClient,
) -> None:
    """A receiver that stops reading: after the deadline, the request's unsent bytes go
    with the connection (abort) instead of draining into the socket for ever (close)."""
    body = b"x" * (32 * 1024 * 1024)
    reading = asyncio.Event()
    gone = asyncio.Event()
    received = 0

    async def stop_reading(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal received
        await reader.readuntil(b"\r\n\r\n")
        await reading.wait()
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(1024 * 1024):
                received += len(chunk)
        gone.set()
        writer.close()

    server = await asyncio.start_server(stop_reading, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/hook"
    request = OutgoingRequest(
        delivery_id=1, url=url, message_id="msg_1", body=body, keys=[b"k" * 32], timeout=0.3
    )
    result = await send_attempt(http, request, ManualClock())
    assert result.outcome is Outcome.AMBIGUOUS
    reading.set()  # the receiver reads again: only what was already in flight is left
    async with asyncio.timeout(10):
        await gone.wait()
    server.close()
    await server.wait_closed()
    assert received < len(body)


# -- 4. trailers never become headers -------------------------------------------------

CHUNKED_503_WITH_TRAILER = (
    b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"4\r\nbusy\r\n0\r\nRetry-After: 3000\r\n\r\n"
)


async def test_a_trailer_is_not_a_header(http: httpx.AsyncClient) -> None:
    async with scripted(CHUNKED_503_WITH_TRAILER, OK) as server:
        result = await attempt(http, server.url)
        again = await attempt(http, server.url)
    assert (result.outcome, result.status_code, result.response_excerpt) == (
        Outcome.RETRYABLE,
        503,
        "busy",
    )
    assert result.retry_after is None
    assert again.outcome is Outcome.SUCCEEDED
    assert server.connections == 1  # trailers read to their end: the connection is fine


async def test_a_trailer_retry_after_does_not_schedule_the_delivery(
    engine: Engine, async_engine: AsyncEngine, box: SecretBox, clock: ManualClock
) -> None:
    async with (
        scripted(CHUNKED_503_WITH_TRAILER) as server,
        build_http_client(
            max_connections=10, timeout=5, transport="wire", allowed_networks=LOOPBACK
        ) as http,
    ):
        add_endpoint(engine, box, server.url)
        delivery = await deliver_one(engine, async_engine, http, box, clock, "order.created")
    assert (delivery["state"], delivery["last_status_code"]) == ("scheduled", 503)
    delay = (delivery["next_attempt_at"] - clock.now()).total_seconds()
    assert 8.0 <= delay <= 12.0  # the schedule's 10 s, not the trailer's 3000 s


# -- 5. Transfer-Encoding: identity, delimited by the close --------------------------

IDENTITY = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: identity\r\n\r\nall of it"


async def test_an_identity_coded_body_ended_by_closing_is_complete(
    http: httpx.AsyncClient,
) -> None:
    async with scripted(IDENTITY, OK, close_after_each=True) as server:
        first = await attempt(http, server.url)
        second = await attempt(http, server.url)
    assert (first.outcome, first.response_excerpt) == (Outcome.SUCCEEDED, "all of it")
    assert second.outcome is Outcome.SUCCEEDED
    assert server.connections == 2


async def test_a_transfer_coding_the_wire_cannot_undo_is_refused(
    http: httpx.AsyncClient,
) -> None:
    gzip = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n\x1f\x8b"
    async with scripted(gzip, close_after_each=True) as server:
        result = await attempt(http, server.url)
    assert result.outcome is Outcome.AMBIGUOUS
    assert "unsupported Transfer-Encoding 'gzip'" in (result.error or "")


async def test_an_identity_coded_answer_is_recorded_delivered(
    engine: Engine, async_engine: AsyncEngine, box: SecretBox, clock: ManualClock
) -> None:
    async with (
        scripted(IDENTITY, close_after_each=True) as server,
        build_http_client(
            max_connections=10, timeout=5, transport="wire", allowed_networks=LOOPBACK
        ) as http,
    ):
        add_endpoint(engine, box, server.url)
        delivery = await deliver_one(engine, async_engine, http, box, clock, "order.created")
    assert (delivery["state"], delivery["attempts"]) == ("succeeded", 1)
    assert last_attempt(engine, delivery["id"])["response_excerpt"] == "all of it"


# -- 6. an interim answer's reason is not the final one's -----------------------------


async def test_a_1xx_reason_does_not_carry_into_the_final_answer(
    http: httpx.AsyncClient,
) -> None:
    answer = (
        b"HTTP/1.1 100 Continue\r\nX-Interim: 1\r\n\r\nHTTP/1.1 500\r\nContent-Length: 0\r\n\r\n"
    )
    async with scripted(answer) as server:
        result = await attempt(http, server.url)
    assert (result.outcome, result.status_code, result.error) == (
        Outcome.RETRYABLE,
        500,
        "HTTP 500",
    )


async def test_endless_interim_answers_are_cut(http: httpx.AsyncClient) -> None:
    """Each 1xx answer checks the ones before it: their number is bounded, not only
    their bytes, so a stream of them costs little."""
    endless = b"HTTP/1.1 100 Continue\r\n\r\n" * 2000
    began = time.monotonic()
    async with scripted(endless) as server:
        result = await attempt(http, server.url)
    assert result.outcome is Outcome.AMBIGUOUS
    assert "more than 8 interim (1xx) responses" in (result.error or "")
    assert time.monotonic() - began < 2


async def test_a_reason_split_across_reads_is_whole(http: httpx.AsyncClient) -> None:
    async with in_pieces(
        b"HTTP/1.1 503 Service Unav", b"ailable\r\nContent-Length: 0\r\n\r\n"
    ) as url:
        result = await attempt(http, url)
    assert result.error == "HTTP 503 Service Unavailable"


# -- 8. keep-alive expiry ------------------------------------------------------------


def test_idle_connections_expire_before_common_servers_5_s_timeout() -> None:
    assert KEEPALIVE_EXPIRY < 5
    assert WireTransport(policy=AddressPolicy(LOOPBACK))._pool._expiry == KEEPALIVE_EXPIRY


@pytest.mark.parametrize(
    ("keep_alive", "idle", "reused"),
    [
        (b"", KEEPALIVE_EXPIRY - 0.5, True),
        (b"", KEEPALIVE_EXPIRY + 0.5, False),
        (b"Keep-Alive: timeout=3, max=100\r\n", 1.5, True),
        (b"Keep-Alive: timeout=3, max=100\r\n", 2.5, False),  # a second's margin
        (b"Keep-Alive: timeout=60\r\n", KEEPALIVE_EXPIRY + 0.5, False),  # never longer
    ],
)
async def test_an_idle_connection_expires_by_the_servers_keep_alive_timeout(
    keep_alive: bytes, idle: float, reused: bool
) -> None:
    answer = b"HTTP/1.1 200 OK\r\n" + keep_alive + b"Content-Length: 0\r\n\r\n"
    clock = Monotonic()
    wire = wire_with(clock)
    async with scripted(answer, answer) as server:
        assert await post_and_read(wire, server.url)
        clock.now += idle
        await post_and_read(wire, server.url)
        await wire.aclose()
    assert server.connections == (1 if reused else 2)


async def test_a_server_keep_alive_timeout_of_a_second_or_less_keeps_nothing() -> None:
    answer = b"HTTP/1.1 200 OK\r\nKeep-Alive: timeout=1\r\nContent-Length: 0\r\n\r\n"
    wire = wire_with(Monotonic())
    async with scripted(answer, answer) as server:
        assert not await post_and_read(wire, server.url)
        assert not await post_and_read(wire, server.url)
        await wire.aclose()
    assert server.connections == 2


# -- 9. unwritable before a byte went out: nothing was sent ---------------------------


@contextlib.asynccontextmanager
async def closing_at_once(delay: float = 0.0) -> AsyncIterator[str]:
    """A receiver that accepts each connection and closes it, `delay` seconds later,
    before reading anything (a server shedding load): nothing it was sent arrives."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    loop = asyncio.get_running_loop()

    async def accept_and_close() -> None:
        while True:
            accepted, _ = await loop.sock_accept(listener)
            if delay:
                await asyncio.sleep(delay)  # the scenario: the close comes this late
            accepted.close()

    task = asyncio.create_task(accept_and_close())
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/hook"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        listener.close()


async def test_a_connection_closed_before_sending_is_a_connect_error() -> None:
    """The httpx API path, whose trace hook may wait before the request goes out."""

    wire = WireTransport(policy=AddressPolicy(LOOPBACK))

    async def slow_trace(event: str, info: Mapping[str, Any]) -> None:
        await until(lambda: pooled(wire) == 0, "the receiver's close to reach the connection")

    async with (
        # The close comes after the client has its connection (Happy Eyeballs handed it
        # over) and before the trace hook lets the request go out.
        closing_at_once(delay=0.03) as url,
        httpx.AsyncClient(transport=wire) as client,
    ):
        with pytest.raises(httpx.ConnectError, match="closed before the request was sent"):
            await client.post(url, content=b"{}", extensions={"trace": slow_trace})


def test_a_connection_closed_before_sending_is_retried_not_held(
    engine: Engine, database_url: str, box: SecretBox, clock: ManualClock
) -> None:
    """On uvloop (what `outbox run` uses), the receiver's close is seen as the connection
    opens; the attempt is recorded retryable, nothing sent, not ambiguous."""

    async def scenario() -> dict[str, Any]:
        async_engine = make_async_engine(database_url)
        try:
            async with (
                closing_at_once() as url,
                build_http_client(
                    max_connections=10, timeout=5, transport="wire", allowed_networks=LOOPBACK
                ) as http,
            ):
                add_endpoint(engine, box, url)
                return await deliver_one(engine, async_engine, http, box, clock, "order.created")
        finally:
            await async_engine.dispose()

    delivery = uvloop.run(scenario())
    attempt_row = last_attempt(engine, delivery["id"])
    assert delivery["state"] == "scheduled"
    assert attempt_row["outcome"] == "retryable"
    assert "closed before the request was sent; nothing was sent" in attempt_row["error"]


# -- 10. what a caller may put in a request -------------------------------------------


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("x-nul", "a\x00b"),
        ("x-bell", "a\x07b"),
        ("x-del", "a\x7fb"),
        ("x-cr", "a\rb"),
        ("x-lf", "a\nx-injected: 1"),
        ("x bad", "name with a space"),
        ("x:colon", "v"),
    ],
)
async def test_the_httpx_api_refuses_control_characters_and_bad_names(
    name: str, value: str
) -> None:
    async with (
        scripted() as server,
        httpx.AsyncClient(transport=WireTransport(policy=AddressPolicy(LOOPBACK))) as client,
    ):
        request = client.build_request("POST", server.url, content=b"{}", headers={name: value})
        with pytest.raises(httpx.LocalProtocolError, match="control character"):
            await client.send(request)
    assert server.bodies == []


@pytest.mark.parametrize("method", ["HEAD", "CONNECT", "TRACE", "GET /x HTTP/1.1\r\nX:"])
async def test_the_httpx_api_refuses_methods_it_cannot_frame(method: str) -> None:
    async with (
        scripted() as server,
        httpx.AsyncClient(transport=WireTransport(policy=AddressPolicy(LOOPBACK))) as client,
    ):
        with pytest.raises(httpx.LocalProtocolError, match="is not supported"):
            await client.request(method, server.url)
    assert server.bodies == []


@pytest.mark.parametrize("name", ["Host", "content-length", "Transfer-Encoding"])
async def test_post_refuses_headers_the_wire_writes_itself(name: str) -> None:
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with scripted() as server:
        with pytest.raises(InvalidEndpointURLError, match=f"sets '{name}'"):
            await wire.post(server.url, {name: "5"}, b"{}", deadline=1.0)
        await wire.aclose()
    assert server.bodies == []


async def test_a_request_the_wire_refuses_to_frame_is_a_permanent_outcome() -> None:
    """`LocalProtocolError` is raised before a byte is sent, by what we were asked to
    send: retrying the same request cannot help, so the attempt is permanent."""

    async def bad_header(request: httpx.Request) -> None:
        request.headers["x-injected"] = "a\x00b"  # a hook (or a bug) adds a NUL

    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with httpx.AsyncClient(transport=wire, event_hooks={"request": [bad_header]}) as client:
        result = await send_attempt(
            client,
            OutgoingRequest(
                delivery_id=1,
                url="http://127.0.0.1:9/hook",
                message_id="msg_1",
                body=b"{}",
                keys=[b"k" * 32],
                timeout=3.0,
            ),
            ManualClock(),
        )
    assert result.outcome is Outcome.PERMANENT
    assert "control character" in (result.error or "")
