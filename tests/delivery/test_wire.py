"""Our own HTTP/1.1 wire (delivery.wire) against raw, scripted answers on loopback.

tests/delivery/test_transport.py runs the outcome table through every wire; these cases are
the wire's own: connection reuse and when not to reuse, framing (chunked, closed by
the server, interim 1xx, truncated), the connection limit, and header injection.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from delivery.errors import AddressRefusedError
from delivery.http import build_http_client
from delivery.policy import Outcome
from delivery.ssrf import AddressPolicy
from delivery.wire import MAX_HEAD_BYTES, WireTransport
from tests.delivery.loopback import StartReceiver, answers, tls_receiver_recording_sni
from tests.delivery.scripted import OK, attempt, pooled, scripted
from tests.helpers import LOOPBACK, until


async def test_one_connection_carries_request_after_request(http: httpx.AsyncClient) -> None:
    async with scripted() as server:
        for n in range(5):
            result = await attempt(http, server.url, body=b"%d" % n)
            assert (result.outcome, result.response_excerpt) == (Outcome.SUCCEEDED, "ok")
    assert server.connections == 1
    assert server.bodies == [b"0", b"1", b"2", b"3", b"4"]
    head = server.heads[0].decode()
    assert head.startswith("POST /hook HTTP/1.1\r\n")
    assert f"Host: 127.0.0.1:{server.port}\r\n" in head
    assert "Content-Length: 1\r\n" in head


async def test_a_chunked_body_is_read_whole_and_the_connection_reused(
    http: httpx.AsyncClient,
) -> None:
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    )
    async with scripted(chunked, OK) as server:
        first = await attempt(http, server.url)
        second = await attempt(http, server.url)
    assert first.response_excerpt == "hello world"
    assert second.outcome is Outcome.SUCCEEDED
    assert server.connections == 1


async def test_a_body_ended_by_closing_is_complete_and_not_reused(
    http: httpx.AsyncClient,
) -> None:
    until_close = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it"
    async with scripted(until_close, OK, close_after_each=True) as server:
        first = await attempt(http, server.url)
        second = await attempt(http, server.url)
    assert (first.outcome, first.response_excerpt) == (Outcome.SUCCEEDED, "all of it")
    assert second.outcome is Outcome.SUCCEEDED
    assert server.connections == 2


async def test_a_truncated_body_is_ambiguous_not_success(http: httpx.AsyncClient) -> None:
    truncated = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nonly5"
    async with scripted(truncated, close_after_each=True) as server:
        result = await attempt(http, server.url)
    assert result.outcome is Outcome.AMBIGUOUS
    assert "may have arrived" in (result.error or "")


async def test_a_malformed_answer_is_ambiguous(http: httpx.AsyncClient) -> None:
    async with scripted(b"SMTP ready\r\n\r\n") as server:
        result = await attempt(http, server.url)
    assert result.outcome is Outcome.AMBIGUOUS
    assert "malformed response" in (result.error or "")


async def test_an_endless_response_head_is_cut_not_buffered(http: httpx.AsyncClient) -> None:
    endless = b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"p" * (4 * MAX_HEAD_BYTES) + b"\r\n\r\n"
    async with scripted(endless) as server:
        result = await attempt(http, server.url)
    assert result.outcome is Outcome.AMBIGUOUS
    assert f"the response head is over {MAX_HEAD_BYTES} bytes" in (result.error or "")


async def test_an_interim_100_continue_is_skipped(http: httpx.AsyncClient) -> None:
    answer = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n"
    async with scripted(answer) as server:
        result = await attempt(http, server.url)
    assert (result.outcome, result.status_code) == (Outcome.SUCCEEDED, 201)


async def test_extra_bytes_after_a_response_close_the_connection(
    http: httpx.AsyncClient,
) -> None:
    async with scripted(OK + b"HTTP/1.1 200 OK\r\n", OK) as server:
        first = await attempt(http, server.url)
        second = await attempt(http, server.url)
    assert first.outcome is Outcome.SUCCEEDED
    assert second.outcome is Outcome.SUCCEEDED
    assert server.connections == 2  # the connection with stray bytes was not trusted again


async def test_a_body_not_read_to_its_end_closes_the_connection(
    http: httpx.AsyncClient,
) -> None:
    # More is announced than sent: the rest never comes while the connection stays open.
    big = b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"x" * 2000
    async with scripted(big, OK) as server:
        first = await attempt(http, server.url, body_cap=1024)
        second = await attempt(http, server.url)
    assert first.outcome is Outcome.SUCCEEDED
    assert len(first.response_excerpt or "") == 64
    assert second.outcome is Outcome.SUCCEEDED
    assert server.connections == 2


async def test_an_idle_connection_the_server_closed_is_not_used(
    http: httpx.AsyncClient,
) -> None:
    async with scripted(OK, OK, close_after_each=True) as server:
        assert (await attempt(http, server.url)).outcome is Outcome.SUCCEEDED
        await until(lambda: pooled(http) == 0, "the idle connection to see the server's close")
        assert (await attempt(http, server.url)).outcome is Outcome.SUCCEEDED
    assert server.connections == 2


async def test_connections_stay_within_the_limit() -> None:
    async with (
        build_http_client(
            max_connections=2, timeout=5, transport="wire", allowed_networks=LOOPBACK
        ) as http,
        scripted(delay=0.05) as server,
    ):
        results = await asyncio.gather(*(attempt(http, server.url) for _ in range(8)))
    assert [r.outcome for r in results] == [Outcome.SUCCEEDED] * 8
    assert server.most_open == 2
    assert len(server.bodies) == 8


async def test_at_the_limit_an_idle_connection_to_another_host_makes_room() -> None:
    async with (
        build_http_client(
            max_connections=1, timeout=5, transport="wire", allowed_networks=LOOPBACK
        ) as http,
        scripted() as one,
        scripted() as two,
    ):
        assert (await attempt(http, one.url)).outcome is Outcome.SUCCEEDED
        assert (await attempt(http, two.url)).outcome is Outcome.SUCCEEDED
        await until(lambda: one.open_now == 0, "the pool to close the connection to one")
        assert two.open_now == 1


async def test_a_header_with_a_line_break_is_refused_before_anything_is_sent() -> None:
    transport = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with scripted() as server:
        with pytest.raises(Exception, match="line break"):
            await transport.post(server.url, {"x-evil": "a\r\nx-injected: 1"}, b"{}", deadline=1.0)
        await transport.aclose()
    assert server.bodies == []


async def test_the_httpx_api_on_the_same_pool(http: httpx.AsyncClient) -> None:
    """Clients with hooks or mounts go through httpx's transport API; same wire."""
    transport = WireTransport(policy=AddressPolicy(LOOPBACK))
    not_found = b"HTTP/1.1 404 Not Found\r\nX-Why: gone\r\nContent-Length: 4\r\n\r\nnope"
    async with (
        scripted(not_found) as server,
        httpx.AsyncClient(transport=transport) as client,
    ):
        response = await client.post(server.url, content=b"hello")
        assert (response.status_code, response.reason_phrase) == (404, "Not Found")
        assert response.headers["x-why"] == "gone"
        assert response.content == b"nope"
        again = await client.post(server.url, content=b"again")
        assert again.status_code == 200

        async def streamed() -> AsyncIterator[bytes]:
            yield b"str"
            yield b"eamed"

        # httpx would announce a stream as chunked; the wire sends it whole, with a length.
        assert (await client.post(server.url, content=streamed())).status_code == 200
    assert server.bodies == [b"hello", b"again", b"streamed"]
    streamed_head = server.heads[-1].lower()
    assert b"transfer-encoding" not in streamed_head
    assert streamed_head.count(b"content-length: 8\r\n") == 1
    assert server.connections == 1


async def test_the_httpx_api_honours_the_read_timeout() -> None:
    transport = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with (
        scripted(delay=2.0) as server,
        httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(5, read=0.1)) as client,
    ):
        with pytest.raises(httpx.ReadTimeout):
            await client.post(server.url, content=b"x")


def test_the_wire_runs_on_uvloop() -> None:
    """`outbox run` uses uvloop when installed; its transports are not asyncio's classes."""
    import uvloop

    async def exchange() -> tuple[list[Outcome], int]:
        async with (
            build_http_client(
                max_connections=2, timeout=5, transport="wire", allowed_networks=LOOPBACK
            ) as http,
            scripted() as server,
        ):
            results = [await attempt(http, server.url) for _ in range(3)]
        return [r.outcome for r in results], server.connections

    assert uvloop.run(exchange()) == ([Outcome.SUCCEEDED] * 3, 1)


async def test_tls_verifies_the_hostname_sends_sni_and_dials_the_checked_address(
    start_receiver: StartReceiver, tmp_path: Path
) -> None:
    receiver, client_ctx, sni = await tls_receiver_recording_sni(start_receiver, tmp_path)
    resolve, asked = answers(["127.0.0.2"])
    wire = WireTransport(
        policy=AddressPolicy(["127.0.0.2/32"]), ssl_context=client_ctx, resolver=resolve
    )
    url = f"https://hook.test:{receiver.port}/hook"
    response = await wire.post(url, {}, b"{}", deadline=5.0)
    assert response.status_code == 200
    await response.aclose()
    untrusted = WireTransport(policy=AddressPolicy(["127.0.0.2/32"]), resolver=resolve)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        await untrusted.post(url, {}, b"{}", deadline=5.0)
    await wire.aclose()
    await untrusted.aclose()
    assert sni == ["hook.test", "hook.test"]  # both handshakes name the host, not the IP
    assert asked == ["hook.test", "hook.test"]
    assert [r.headers["host"] for r in receiver.requests] == [f"hook.test:{receiver.port}"]


async def test_a_name_with_any_refused_answer_is_never_dialled(
    start_receiver: StartReceiver,
) -> None:
    receiver = await start_receiver("127.0.0.2")
    resolve, _ = answers(["127.0.0.2", "10.0.0.5"])
    wire = WireTransport(policy=AddressPolicy(["127.0.0.2/32"]), resolver=resolve)
    with pytest.raises(AddressRefusedError) as caught:
        await wire.post(f"http://hook.test:{receiver.port}/", {}, b"{}", deadline=5.0)
    await wire.aclose()
    assert caught.value.address == "10.0.0.5"
    assert receiver.requests == []
