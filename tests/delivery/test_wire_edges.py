"""The wire's edges that its mutation run (docs/mutation.md) found no test for.

Each case pins one decision of delivery/wire.py that a one-token change could flip
without another test noticing: which error class and text a broken answer gets, a
blank line after an interim answer, the keep-alive expiry instant, what the pool does
at its limit, reading paused and resumed under a large body, the httpx API's exact
request head and timeouts. Scripted receivers on 127.0.0.1, as in test_wire_defects.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator

import httpx
import pytest
from yarl import URL

from delivery.errors import InvalidEndpointURLError
from delivery.ssrf import AddressPolicy
from delivery.wire import KEEPALIVE_EXPIRY, MAX_HEAD_BYTES, WireResponse, WireTransport
from delivery.wire.connect import _Target
from tests.delivery.loopback import answers
from tests.delivery.scripted import OK, Monotonic, in_pieces, post_and_read, scripted, wire_with
from tests.helpers import LOOPBACK, until


async def read_all(response: WireResponse) -> bytes:
    body = bytearray()
    async for chunk in response.aiter_raw():
        body += chunk
    return bytes(body)


# -- what a broken answer is called ---------------------------------------------------


@pytest.mark.parametrize(
    "truncated",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nonly5",
        # Chunked bodies end at their last chunk, not at the close: cut inside a chunk,
        # or after a whole chunk with the last one missing.
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nonl",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n",
        # The last chunk without the blank line that ends the message.
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n",
    ],
    ids=["content-length", "chunked-mid-chunk", "chunked-no-last-chunk", "chunked-no-end"],
)
async def test_a_body_cut_by_the_close_is_a_protocol_error_mid_body(truncated: bytes) -> None:
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with scripted(truncated, close_after_each=True) as server:
        response = await wire.post(server.url, {}, b"{}", deadline=5.0)
        with pytest.raises(httpx.RemoteProtocolError) as caught:
            await read_all(response)
        await response.aclose()
        await wire.aclose()
    assert str(caught.value) == "the server closed the connection mid-body"
    assert not response.released


async def test_a_close_before_any_answer_says_no_response_came() -> None:
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with scripted(b"") as server:  # reads the request, closes without answering
        with pytest.raises(httpx.RemoteProtocolError) as caught:
            await wire.post(server.url, {}, b"{}", deadline=5.0)
        await wire.aclose()
    assert str(caught.value) == "the server closed the connection without sending a response"


@contextlib.asynccontextmanager
async def resetting_after(answer: bytes, reset: asyncio.Event) -> AsyncIterator[str]:
    """A receiver that writes `answer`, then, once `reset` is set, resets the connection
    (RST, not FIN)."""
    handlers: list[asyncio.Task[None]] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.append(task)
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        writer.write(answer)
        await writer.drain()
        await reset.wait()
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/hook"
    finally:
        reset.set()  # a test that failed before it lets the handler end
        server.close()
        await asyncio.gather(*handlers, return_exceptions=True)
        await server.wait_closed()


async def test_a_reset_mid_body_is_a_read_error_that_says_the_connection_was_lost() -> None:
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    reset = asyncio.Event()
    async with resetting_after(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nonly5", reset) as url:
        response = await wire.post(url, {}, b"{}", deadline=5.0)
        reset.set()  # the head is in: the reset comes mid-body
        with pytest.raises(httpx.ReadError) as caught:
            await read_all(response)
        await response.aclose()
        await wire.aclose()
    assert str(caught.value).startswith("connection lost: [Errno 104]")


# -- a blank line after an interim (1xx) answer ---------------------------------------

FINAL = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
HINTS = b"HTTP/1.1 103 Early Hints\r\n\r\n"


@pytest.mark.parametrize(
    "pieces",
    [
        # the blank line in the next read (the check joins this response's reads)
        [CONTINUE, b"\r\n" + FINAL],
        [CONTINUE, b"\n" + FINAL],  # a bare LF is a blank line too
        # after the second of two interim answers, not the first
        [CONTINUE + HINTS + b"\n" + FINAL],
        [CONTINUE, HINTS, b"\r\n" + FINAL],
    ],
)
async def test_a_blank_line_after_an_interim_answer_is_refused(pieces: list[bytes]) -> None:
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with in_pieces(*pieces) as url:
        with pytest.raises(httpx.RemoteProtocolError) as caught:
            await wire.post(url, {}, b"{}", deadline=5.0)
        await wire.aclose()
    assert str(caught.value) == ("malformed response: a blank line after an interim (1xx) response")


async def test_interim_answers_in_reads_of_their_own_are_skipped() -> None:
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with in_pieces(CONTINUE, HINTS, FINAL) as url:
        response = await wire.post(url, {}, b"{}", deadline=5.0)
        assert (response.status_code, await read_all(response)) == (200, b"")
        await response.aclose()
        await wire.aclose()


# -- connection reuse -----------------------------------------------------------------


async def test_an_idle_connection_expires_at_the_expiry_instant() -> None:
    clock = Monotonic()
    wire = wire_with(clock)
    async with scripted(OK, OK) as server:
        assert await post_and_read(wire, server.url)
        clock.now += KEEPALIVE_EXPIRY  # exactly: expired
        await post_and_read(wire, server.url)
        await wire.aclose()
    assert server.connections == 2


async def test_making_room_at_the_limit_keeps_the_other_idle_connections() -> None:
    """At the limit, one idle connection to another host is closed; the host's other
    idle connections stay pooled (and counted) and carry its next request."""
    wire = WireTransport(policy=AddressPolicy(LOOPBACK), max_connections=2)
    async with scripted(delay=0.05) as one, scripted() as two:
        both = await asyncio.gather(*(wire.post(one.url, {}, b"{}", deadline=5.0) for _ in "ab"))
        for response in both:
            await read_all(response)
            await response.aclose()
        assert [r.released for r in both] == [True, True]  # two idle connections to one
        response = await wire.post(two.url, {}, b"{}", deadline=5.0)  # closes one of them
        await read_all(response)
        await response.aclose()
        response = await wire.post(one.url, {}, b"{}", deadline=5.0)
        await read_all(response)
        await response.aclose()
        await wire.aclose()
    assert (one.connections, two.connections) == (2, 1)


async def test_a_body_not_being_read_pauses_the_socket_and_reading_resumes_it() -> None:
    """Past 256 KiB unread, the connection stops reading (bounded memory); as the caller
    reads, it resumes, the body arrives whole and the connection is reused."""
    size = 4 * 1024 * 1024
    big = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size + b"x" * size
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with scripted(big, OK) as server:
        response = await wire.post(server.url, {}, b"{}", deadline=5.0)
        for _ in range(250):  # until the high-water mark is passed (the box may be slow)
            if response._buffered > 256 * 1024:
                break
            await asyncio.sleep(0.02)
        # A window, not a wait: the reads a wire that did not pause would take meanwhile.
        await asyncio.sleep(0.1)
        assert 256 * 1024 < response._buffered <= 512 * 1024  # one read past the mark
        async with asyncio.timeout(10):
            assert len(await read_all(response)) == size
        await response.aclose()
        assert response.released
        again = await wire.post(server.url, {}, b"{}", deadline=5.0)
        assert await read_all(again) == b"ok"
        await again.aclose()
        await wire.aclose()
    assert server.connections == 1


# -- the httpx transport API ----------------------------------------------------------


async def test_the_httpx_api_writes_exactly_the_request_it_was_given() -> None:
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    odd = b"HTTP/1.1 404 Gone Fishing\r\nContent-Length: 0\r\n\r\n"
    async with scripted(odd) as server, httpx.AsyncClient(transport=wire) as client:
        request = client.build_request(
            "PUT", server.url, content=b"hello", headers={"X-Why": "a\tb"}
        )
        response = await client.send(request)
    assert (response.status_code, response.reason_phrase) == (404, "Gone Fishing")
    assert server.heads == [
        b"PUT /hook HTTP/1.1\r\n"
        + b"".join(name + b": " + value + b"\r\n" for name, value in request.headers.raw).replace(
            b"Content-Length: 5\r\n", b""
        )
        + b"Content-Length: 5\r\n\r\n"
    ]
    assert server.heads[0].count(b"Content-Length") == 1
    assert server.bodies == [b"hello"]


async def test_the_httpx_api_dials_a_name_in_origin_form() -> None:
    resolve, asked = answers(["127.0.0.1"])
    wire = WireTransport(policy=AddressPolicy(LOOPBACK), resolver=resolve)
    async with scripted() as server, httpx.AsyncClient(transport=wire) as client:
        response = await client.post(f"http://hook.test:{server.port}/hook?a=1", content=b"{}")
        again = await wire.post(f"http://hook.test:{server.port}/hook", {}, b"{}", deadline=5.0)
        await again.aclose()
    assert response.status_code == 200
    assert [head.split(b"\r\n")[0] for head in server.heads] == [
        b"POST /hook?a=1 HTTP/1.1",
        b"POST /hook HTTP/1.1",
    ]
    assert asked == ["hook.test"]  # the second request reuses the connection


async def test_the_httpx_api_names_the_bad_header_and_the_methods_it_sends() -> None:
    async with (
        scripted() as server,
        httpx.AsyncClient(transport=WireTransport(policy=AddressPolicy(LOOPBACK))) as client,
    ):
        request = client.build_request(
            "POST", server.url, content=b"{}", headers={"x-fine": "1", "x-evil": "a\x00b"}
        )
        with pytest.raises(httpx.LocalProtocolError) as bad_header:
            await client.send(request)
        with pytest.raises(httpx.LocalProtocolError) as bad_method:
            await client.request("PÖST", server.url)
    assert str(bad_header.value) == (
        "the request header 'x-evil' has a name that is not a token or a value with a "
        "control character (NUL, CR, LF, ...); fix the header"
    )
    assert str(bad_method.value) == (
        "this wire sends webhooks; the method 'PÖST' is not supported "
        "(use one of DELETE, GET, OPTIONS, PATCH, POST, PUT)"
    )
    assert server.bodies == []


@pytest.mark.parametrize(
    ("connect", "pool", "waited"),
    [(0.1, 0.2, "0.3"), (None, 0.2, "0.2"), (0.2, None, "0.2")],
)
async def test_the_httpx_api_waits_connect_plus_pool_for_a_connection(
    connect: float | None, pool: float | None, waited: str
) -> None:
    """With every connection busy, a request waits for one as long as its connect and
    pool timeouts together allow, then fails as a connect timeout (nothing was sent)."""
    wire = WireTransport(policy=AddressPolicy(LOOPBACK), max_connections=1)
    timeout = httpx.Timeout(5.0, connect=connect, pool=pool)
    async with scripted(delay=1.0) as server, httpx.AsyncClient(transport=wire) as client:
        busy = asyncio.create_task(wire.post(server.url, {}, b"{}", deadline=5.0))
        await until(lambda: server.bodies, "the first request to hold the only connection")
        async with asyncio.timeout(3):
            with pytest.raises(httpx.ConnectTimeout) as caught:
                await client.post(server.url, content=b"{}", timeout=timeout)
        busy.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await busy
    assert str(caught.value) == f"no connection to 127.0.0.1:{server.port} within {waited}s"
    assert len(server.bodies) == 1


async def test_eight_interim_answers_pass_and_a_ninth_is_refused() -> None:
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with scripted(CONTINUE * 8 + FINAL, CONTINUE * 9 + FINAL) as server:
        response = await wire.post(server.url, {}, b"{}", deadline=5.0)
        assert response.status_code == 200
        await read_all(response)
        await response.aclose()
        with pytest.raises(httpx.RemoteProtocolError, match=r"more than 8 interim \(1xx\)"):
            await wire.post(server.url, {}, b"{}", deadline=5.0)
        await wire.aclose()


async def test_a_server_keep_alive_timeout_of_two_seconds_keeps_one() -> None:
    """`timeout=2` less the second's margin leaves a second: kept (only no time is not)."""
    answer = b"HTTP/1.1 200 OK\r\nKeep-Alive: timeout=2\r\nContent-Length: 0\r\n\r\n"
    clock = Monotonic()
    wire = wire_with(clock)
    async with scripted(answer, answer) as server:
        assert await post_and_read(wire, server.url)
        clock.now += 0.5
        assert await post_and_read(wire, server.url)
        await wire.aclose()
    assert server.connections == 1


async def test_a_connection_whose_reading_is_paused_is_not_pooled() -> None:
    """Paused (the high-water mark), it would not notice the server's close or stray
    bytes while idle, nor read the next answer: it is closed, however the body ended."""
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with scripted(OK, OK) as server:
        response = await wire.post(server.url, {}, b"{}", deadline=5.0)
        assert await read_all(response) == b"ok"
        response._connection.pause_reading()  # as a large unread body leaves it
        await response.aclose()
        assert not response.released
        async with asyncio.timeout(3):
            assert await post_and_read(wire, server.url)
        await wire.aclose()
    assert server.connections == 2


async def test_the_httpx_api_bounds_each_body_read_by_the_read_timeout() -> None:
    stalled = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nonly5"
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with (
        scripted(stalled) as server,
        httpx.AsyncClient(transport=wire, timeout=httpx.Timeout(5, read=0.2)) as client,
    ):
        async with asyncio.timeout(3):
            with pytest.raises(httpx.ReadTimeout) as caught:
                await client.post(server.url, content=b"{}")
    assert str(caught.value) == "no body bytes within 0.2s"


@pytest.mark.parametrize(
    ("credentials", "says"),
    [
        (
            "",
            "the proxy 127.0.0.1:{port} requires credentials (407 Proxy Authentication "
            "Required); put them in the proxy URL: http://user:password@host:port",
        ),
        (
            "u:secret@",
            "the proxy 127.0.0.1:{port} refused the credentials in the proxy URL (407 Proxy "
            "Authentication Required); fix the user name or password",
        ),
    ],
)
async def test_a_proxy_refusing_credentials_says_what_to_fix(credentials: str, says: str) -> None:
    heard: list[bytes] = []
    writers: list[asyncio.StreamWriter] = []

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        heard.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 407 Proxy Authentication Required\r\n\r\n")
        with contextlib.suppress(ConnectionError):
            await writer.drain()
            await reader.read()
        writer.close()

    server = await asyncio.start_server(proxy, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    wire = WireTransport(
        policy=AddressPolicy(LOOPBACK), proxy=f"http://{credentials}127.0.0.1:{port}"
    )
    try:
        with pytest.raises(httpx.ConnectError) as caught:
            await wire.post("https://127.0.0.1:9/hook", {}, b"{}", deadline=5.0)
    finally:
        await wire.aclose()
        server.close()
        for writer in writers:
            writer.transport.abort()
        await server.wait_closed()
    assert str(caught.value) == says.format(port=port)
    assert (b"Proxy-Authorization" in heard[0]) is bool(credentials)


@pytest.mark.parametrize(
    ("codings", "says"),
    [
        (
            b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n",
            "'chunked' (a second one)",
        ),
        (b"Transfer-Encoding: Xchunked\r\n", "'Xchunked'"),
    ],
)
async def test_a_second_or_unknown_transfer_coding_is_refused(codings: bytes, says: str) -> None:
    answer = b"HTTP/1.1 200 OK\r\n" + codings + b"\r\n2\r\nok\r\n0\r\n\r\n"
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with scripted(answer) as server:
        with pytest.raises(httpx.RemoteProtocolError) as caught:
            await wire.post(server.url, {}, b"{}", deadline=5.0)
        await wire.aclose()
    assert str(caught.value) == f"malformed response: unsupported Transfer-Encoding {says}"


async def test_the_httpx_api_without_timeouts_waits_for_its_connection() -> None:
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with scripted() as server, httpx.AsyncClient(transport=wire, timeout=None) as client:
        response = await client.post(server.url, content=b"{}")
    assert response.status_code == 200


# -- trailers: the exact cap, framing refused -----------------------------------------

CHUNKED_OK = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n"


def trailer_lines(total: int) -> list[bytes]:
    """Trailer lines of `total` bytes in all, each counted as sent ("name: value" and
    its CRLF): 1 KiB each, the last one longer by what is left."""
    sizes = [1024] * (total // 1024)
    sizes[-1] += total % 1024
    return [b"x-t: " + b"v" * (size - 7) + b"\r\n" for size in sizes]


@pytest.mark.parametrize(
    ("total", "refused"), [(MAX_HEAD_BYTES, False), (MAX_HEAD_BYTES + 1, True)]
)
async def test_trailers_of_exactly_the_head_cap_pass_and_one_byte_more_is_refused(
    total: int, refused: bool
) -> None:
    """Counted as the bytes sent: a name, ": ", a value and CRLF. The first reads carry
    the body too, so the cap on bytes without a body byte is not what decides."""
    lines = trailer_lines(total)
    assert sum(map(len, lines)) == total
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    first, rest = b"".join(lines[:8]), b"".join(lines[8:]) + b"\r\n"
    async with in_pieces(CHUNKED_OK + first, rest) as url:
        response = await wire.post(url, {}, b"{}", deadline=5.0)
        if refused:
            with pytest.raises(httpx.RemoteProtocolError) as caught:
                await read_all(response)
            assert str(caught.value) == (
                f"malformed response: the response trailers are over {MAX_HEAD_BYTES} bytes"
            )
        else:
            assert await read_all(response) == b"ok"
        await response.aclose()
        await wire.aclose()


@pytest.mark.parametrize(
    ("trailer", "says"),
    [
        # llhttp refuses a Content-Length in a chunked message's trailers itself.
        (b"Content-Length: 5", "Content-Length can't be present with Transfer-Encoding"),
        (b"content-length: 5", "Content-Length can't be present with Transfer-Encoding"),
        (b"Transfer-Encoding: chunked", "a Transfer-Encoding trailer"),
        (b"transfer-encoding: chunked", "a transfer-encoding trailer"),
    ],
)
async def test_a_framing_trailer_is_refused_in_any_case(trailer: bytes, says: str) -> None:
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with scripted(CHUNKED_OK + trailer + b"\r\n\r\n") as server:
        response = await wire.post(server.url, {}, b"{}", deadline=5.0)
        with pytest.raises(httpx.RemoteProtocolError) as caught:
            async with asyncio.timeout(5):
                await read_all(response)
        await response.aclose()
        await wire.aclose()
    assert str(caught.value) == f"malformed response: {says}"


@pytest.mark.parametrize("control", [b"\x00", b"\x01", b"\x08", b"\x1f", b"\x7f"])
async def test_a_control_character_in_the_reason_phrase_is_refused(control: bytes) -> None:
    answer = b"HTTP/1.1 200 O" + control + b"K\r\nContent-Length: 2\r\n\r\nok"
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with scripted(answer) as server:
        with pytest.raises(httpx.RemoteProtocolError) as caught:
            async with asyncio.timeout(5):
                await wire.post(server.url, {}, b"{}", deadline=5.0)
        await wire.aclose()
    assert str(caught.value) == "malformed response: a control character in the reason phrase"


async def test_a_tab_and_bytes_past_ascii_in_the_reason_phrase_are_kept() -> None:
    answer = b"HTTP/1.1 200 O\tK \xe9\r\nContent-Length: 2\r\n\r\nok"
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with scripted(answer) as server:
        async with asyncio.timeout(5):
            response = await wire.post(server.url, {}, b"{}", deadline=5.0)
            assert await read_all(response) == b"ok"
        await response.aclose()
        await wire.aclose()
    assert (response.status_code, response.reason_phrase) == (200, "O\tK \xe9")


# -- where a response starts and what may follow it -----------------------------------


@pytest.mark.parametrize("blank", [b"\n", b"\r\n", b"\r"])
async def test_a_blank_line_before_the_status_line_is_refused(blank: bytes) -> None:
    """llhttp would skip it; a strict parser (h11) refuses it, and so does the wire."""
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with scripted(blank + OK) as server:
        with pytest.raises(httpx.RemoteProtocolError) as caught:
            async with asyncio.timeout(5):
                await wire.post(server.url, {}, b"{}", deadline=5.0)
        await wire.aclose()
    assert str(caught.value) == "malformed response: a blank line before the status line"


async def test_a_status_line_whose_first_byte_comes_alone_is_read() -> None:
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with in_pieces(OK[:1], OK[1:]) as url:
        async with asyncio.timeout(5):
            response = await wire.post(url, {}, b"{}", deadline=5.0)
            assert await read_all(response) == b"ok"
        await response.aclose()
        await wire.aclose()
    assert (response.status_code, response.released) == (200, True)


async def test_a_line_break_after_a_read_response_drops_its_connection() -> None:
    """A byte after the response, arriving in a read of its own once the body was read
    and before the response is closed: the connection is not pooled (llhttp alone
    would skip a line break between messages and keep the connection)."""
    go = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        writer.write(OK)
        await writer.drain()
        await go.wait()
        writer.write(b"\n")
        await writer.drain()
        with contextlib.suppress(ConnectionError):
            await reader.read()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/hook"
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with asyncio.timeout(5):
        response = await wire.post(url, {}, b"{}", deadline=5.0)
        assert await read_all(response) == b"ok"
        go.set()
        while not response._connection.closed:  # the stray byte arrives, then the abort
            await asyncio.sleep(0.01)
    await response.aclose()
    await wire.aclose()
    server.close()
    await server.wait_closed()
    assert not response.released


@pytest.mark.parametrize(
    "pieces",
    [
        [OK + b"\n"],  # one line feed after the body, in the body's read
        [OK + b"\r"],
        [OK[:-1], OK[-1:] + b"\n"],  # a read of two bytes: the body's last and a LF
        [OK[:-1], OK[-1:] + b"\r"],
    ],
)
async def test_a_lone_line_break_after_the_body_in_its_read_keeps_the_connection_from_reuse(
    pieces: list[bytes],
) -> None:
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with in_pieces(*pieces) as url:
        async with asyncio.timeout(5):
            response = await wire.post(url, {}, b"{}", deadline=5.0)
            assert await read_all(response) == b"ok"
        await response.aclose()
        await wire.aclose()
    assert (response.status_code, response.released) == (200, False)


async def test_garbage_where_the_status_line_starts_is_not_called_a_blank_line() -> None:
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with scripted(b"X" + OK) as server:
        with pytest.raises(httpx.RemoteProtocolError) as caught:
            async with asyncio.timeout(5):
                await wire.post(server.url, {}, b"{}", deadline=5.0)
        await wire.aclose()
    assert str(caught.value).startswith("malformed response: ")
    assert "blank line" not in str(caught.value)


def head_of(size: int) -> bytes:
    """The start of a response head, `size` bytes, not yet ended (one long header)."""
    start = b"HTTP/1.1 200 OK\r\nX-Long: "
    return start + b"a" * (size - len(start))


HEAD_END = b"\r\nContent-Length: 2\r\n\r\nok"


@pytest.mark.parametrize(
    ("pieces", "refused"),
    [
        ([head_of(MAX_HEAD_BYTES), HEAD_END], False),
        ([head_of(MAX_HEAD_BYTES + 1), HEAD_END], True),
        # Nine reads of 8 KiB, each far below the cap: it is their sum that counts.
        (
            [head_of(MAX_HEAD_BYTES + 8192)[i : i + 8192] for i in range(0, 73728, 8192)]
            + [HEAD_END],
            True,
        ),
    ],
)
async def test_the_head_cap_counts_every_read_before_the_head_is_complete(
    pieces: list[bytes], refused: bool
) -> None:
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with in_pieces(*pieces) as url:
        async with asyncio.timeout(5):
            if refused:
                with pytest.raises(httpx.RemoteProtocolError) as caught:
                    await wire.post(url, {}, b"{}", deadline=5.0)
                assert str(caught.value) == (
                    f"malformed response: the response head is over {MAX_HEAD_BYTES} bytes"
                )
            else:
                response = await wire.post(url, {}, b"{}", deadline=5.0)
                assert await read_all(response) == b"ok"
                await response.aclose()
        await wire.aclose()


CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
CHUNK_END = b"\r\nabc\r\n0\r\n\r\n"


@pytest.mark.parametrize(
    ("extension", "refused"),
    [
        ([b"3;e=" + b"a" * (MAX_HEAD_BYTES - 4)], False),
        ([b"3;e=" + b"a" * (MAX_HEAD_BYTES - 3)], True),
        # Nine reads of 8 KiB, none with a body byte: it is their sum that counts.
        ([b"3;e="] + [b"a" * 8192] * 9, True),
    ],
)
async def test_bytes_after_the_head_without_a_body_byte_are_capped_at_exactly_64_kib(
    extension: list[bytes], refused: bool
) -> None:
    """A chunk extension that goes on: no trailer and no body byte, only framing. The
    count starts again at each read with a body byte (the chunk before it)."""
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with in_pieces(CHUNKED_HEAD, b"2\r\nok\r\n", *extension, CHUNK_END) as url:
        async with asyncio.timeout(5):
            response = await wire.post(url, {}, b"{}", deadline=5.0)
            if refused:
                with pytest.raises(httpx.RemoteProtocolError) as caught:
                    await read_all(response)
                assert str(caught.value) == (
                    f"malformed response: over {MAX_HEAD_BYTES} bytes after the head without"
                    " a body byte (trailers or chunk framing)"
                )
            else:
                assert await read_all(response) == b"okabc"
            await response.aclose()
        await wire.aclose()


async def test_a_switch_of_protocols_is_refused_with_its_text() -> None:
    switching = b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: x\r\n\r\n"
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with scripted(switching) as server:
        with pytest.raises(httpx.RemoteProtocolError) as caught:
            async with asyncio.timeout(5):
                await wire.post(server.url, {}, b"{}", deadline=5.0)
        await wire.aclose()
    assert str(caught.value) == "the server switched protocols"


async def test_closing_a_response_twice_pools_its_connection_once() -> None:
    """A second `aclose` is a no-op: the connection is not handed back again (it would
    then serve two requests at once)."""
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with scripted(OK, OK, OK) as server:
        async with asyncio.timeout(5):
            response = await wire.post(server.url, {}, b"{}", deadline=5.0)
            assert await read_all(response) == b"ok"
            await response.aclose()
            await response.aclose()
            assert [len(idle) for idle in wire._pool._idle.values()] == [1]
            first, second = await asyncio.gather(
                wire.post(server.url, {}, b"{}", deadline=5.0),
                wire.post(server.url, {}, b"{}", deadline=5.0),
            )
            assert first._connection is not second._connection
            for response in (first, second):
                assert await read_all(response) == b"ok"
                await response.aclose()
        await wire.aclose()
    assert server.connections == 2


async def test_a_discarded_connection_frees_its_place_in_the_pool_once() -> None:
    """Discarded (stray bytes after the answer), the connection is forgotten twice: by
    the abort and when the loss is reported. It frees one place, not two: at a limit
    of one, a request while another waits for its answer still waits for a connection."""
    wire = WireTransport(policy=AddressPolicy(LOOPBACK), max_connections=1)
    async with scripted(OK + b"\r\n", OK, OK, delay=1.0) as server:
        async with asyncio.timeout(10):
            response = await wire.post(server.url, {}, b"{}", deadline=5.0)
            assert await read_all(response) == b"ok"
            await response.aclose()
            assert not response.released
            waiting = asyncio.create_task(wire.post(server.url, {}, b"{}", deadline=5.0))
            while len(server.heads) < 2:  # the second request is at the receiver
                await asyncio.sleep(0.01)
            with pytest.raises(httpx.ConnectTimeout):
                await wire.post(server.url, {}, b"{}", deadline=0.2)
            held = await waiting
            assert await read_all(held) == b"ok"
            await held.aclose()
        await wire.aclose()
    assert server.connections == 2


async def test_an_idle_connection_the_server_closed_leaves_the_pool() -> None:
    """Closed by its server while idle, a connection is taken out of the idle lists at
    once: at the limit, making room then closes a live idle connection, not the dead
    one (which frees nothing), and the new request gets its connection."""
    wire = WireTransport(policy=AddressPolicy(LOOPBACK), max_connections=2)
    async with (
        scripted(close_after_each=True) as closing,
        scripted() as two,
        scripted() as three,
        scripted() as four,
    ):
        async with asyncio.timeout(10):
            first = await wire.post(closing.url, {}, b"{}", deadline=5.0)
            await read_all(first)
            await first.aclose()
            assert first.released  # kept alive as far as the answer said
            while not first._connection.closed:  # then the server closes it
                await asyncio.sleep(0.01)
            for server in (two, three):
                response = await wire.post(server.url, {}, b"{}", deadline=5.0)
                await read_all(response)
                await response.aclose()
                assert response.released
            response = await wire.post(four.url, {}, b"{}", deadline=1.0)
            await read_all(response)
            await response.aclose()
        await wire.aclose()
    assert (two.connections, three.connections, four.connections) == (1, 1, 1)


async def test_a_request_that_waited_for_the_pool_reuses_the_connection_handed_back() -> None:
    """At a limit of one, the second request waits; when the first hands its
    connection back, the waiting request takes it (one connection in all), rather than
    closing it to open another."""
    wire = WireTransport(policy=AddressPolicy(LOOPBACK), max_connections=1)

    async def one_request() -> bytes:
        response = await wire.post(server.url, {}, b"{}", deadline=5.0)
        body = await read_all(response)
        await response.aclose()
        return body

    async with scripted(delay=0.05) as server:
        async with asyncio.timeout(10):
            assert list(await asyncio.gather(one_request(), one_request())) == [b"ok", b"ok"]
        await wire.aclose()
    assert server.connections == 1


@pytest.mark.parametrize("value", ["a\nb", "a\rb", "a\x00b", "a\r\nb"])
async def test_a_line_break_or_nul_in_a_request_header_is_refused_before_sending(
    value: str,
) -> None:
    """Any one of LF, CR or NUL alone is enough: nothing is sent."""
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with scripted() as server:
        with pytest.raises(InvalidEndpointURLError) as caught:
            await wire.post(server.url, {"x-custom": value}, b"{}", deadline=5.0)
        await wire.aclose()
    assert str(caught.value) == (
        "a request header contains a line break or NUL; fix the endpoint's headers"
    )
    assert server.connections == 0


@pytest.mark.parametrize(
    ("name", "named"),
    [
        ("Host", "Host"),
        ("content-length", "content-length"),
        ("Transfer-Encoding ", "Transfer-Encoding"),
    ],
)
async def test_a_header_the_wire_writes_itself_is_refused_by_name(name: str, named: str) -> None:
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with scripted() as server:
        with pytest.raises(InvalidEndpointURLError) as caught:
            await wire.post(server.url, {"x-a": "1", name: "2"}, b"{}", deadline=5.0)
        await wire.aclose()
    assert str(caught.value) == (
        f"a request header sets {named!r}, which the wire writes itself from the URL and the"
        " body; remove it from the headers"
    )
    assert server.connections == 0


async def test_a_status_below_100_is_refused_with_its_text() -> None:
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with scripted(b"HTTP/1.1 099 Odd\r\nContent-Length: 2\r\n\r\nok") as server:
        with pytest.raises(httpx.RemoteProtocolError) as caught:
            async with asyncio.timeout(5):
                await wire.post(server.url, {}, b"{}", deadline=5.0)
        await wire.aclose()
    assert str(caught.value) == "malformed response: 099 is not a status code"


@pytest.mark.parametrize(("version", "pooled"), [(b"1.1", True), (b"1.0", False)])
async def test_a_connection_header_keeps_only_an_http_1_1_connection(
    version: bytes, pooled: bool
) -> None:
    answer = (
        b"HTTP/" + version + b" 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok"
    )
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with scripted(answer) as server:
        async with asyncio.timeout(5):
            response = await wire.post(server.url, {}, b"{}", deadline=5.0)
            assert await read_all(response) == b"ok"
        await response.aclose()
        await wire.aclose()
    assert response.released is pooled


async def test_the_httpx_api_trace_hears_the_request_start_with_a_dict() -> None:
    """httpx's `trace` extension gets (event, info dict), as httpcore gives it."""
    heard: list[tuple[str, object]] = []

    async def trace(event: str, info: object) -> None:
        heard.append((event, info))

    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with scripted() as server, httpx.AsyncClient(transport=wire) as client:
        response = await client.post(server.url, content=b"{}", extensions={"trace": trace})
    assert response.status_code == 200
    assert heard == [("http11.send_request_headers.started", {})]


async def test_the_httpx_api_says_how_long_it_waited_for_the_head() -> None:
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with (
        scripted(delay=3.0) as server,
        httpx.AsyncClient(transport=wire, timeout=httpx.Timeout(5.0, read=0.2)) as client,
    ):
        with pytest.raises(httpx.ReadTimeout) as caught:
            async with asyncio.timeout(5):
                await client.post(server.url, content=b"{}")
    assert str(caught.value) == "no response within 0.2s"


@pytest.mark.parametrize(
    ("url", "host_header", "target"),
    [
        ("http://hook.test/x?y=1", "hook.test", b"/x?y=1"),
        ("https://hook.test", "hook.test", b"/"),
        ("http://hook.test:8080/x", "hook.test:8080", b"/x"),
        # A port is left out of Host only when it is the scheme's own.
        ("https://hook.test:80/x", "hook.test:80", b"/x"),
        ("http://hook.test:443/x", "hook.test:443", b"/x"),
        ("http://[::1]/x", "[::1]", b"/x"),
        ("https://[2001:db8::1]:8443/", "[2001:db8::1]:8443", b"/"),
    ],
)
def test_the_host_header_and_request_target_of_an_endpoint_url(
    url: str, host_header: str, target: bytes
) -> None:
    parsed = _Target(URL(url))
    assert (parsed.host_header, parsed.path) == (host_header, target)
    assert parsed.key == (url.startswith("https"), parsed.host, URL(url).port)
    assert parsed.literal is (":" in parsed.host)
