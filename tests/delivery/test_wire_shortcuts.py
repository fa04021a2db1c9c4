"""The wire's per-attempt shortcuts behave as the general paths they replace.

`WireResponse.read_capped` (what `send_attempt` reads a body with, instead of an async
generator) against `aiter_raw` read the way `send_attempt` used to read it, as a
property over any split of the body into reads, arriving before or during the read;
`post`'s `on_send` (a plain call where httpx's trace needs a coroutine) fires once,
before the request's bytes go out, and never for a request that sends nothing; and
the reuse check's poller, kept per connection, still sees a close or stray bytes that
arrived after an earlier check.
"""

from __future__ import annotations

import asyncio
import socket

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from delivery.errors import AddressRefusedError
from delivery.ssrf import AddressPolicy
from delivery.wire import WireResponse, WireTransport
from delivery.wire.connection import _READ_HIGH_WATER, _Connection, _Pool
from tests.delivery.scripted import scripted
from tests.helpers import LOOPBACK


class _Flow:
    """What a response asks of its connection while it is read: pause and resume (pure
    bookkeeping here: no socket)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def pause_reading(self) -> None:
        self.calls.append("pause")

    def resume_reading(self) -> None:
        self.calls.append("resume")


async def _read(chunks: list[bytes], ahead: int, cap: int, *, reference: bool) -> tuple:
    """Feed `ahead` chunks before reading starts and the rest while it waits; read with
    `read_capped` or, for the reference, `aiter_raw` as send_attempt read it before."""
    flow = _Flow()
    loop = asyncio.get_running_loop()
    response = WireResponse(flow, loop.create_future())  # type: ignore[arg-type]
    for chunk in chunks[:ahead]:
        response.body_received(chunk)

    async def feed_rest() -> None:
        for chunk in chunks[ahead:]:
            await asyncio.sleep(0)
            response.body_received(chunk)
        await asyncio.sleep(0)
        response.finished()

    feeder = asyncio.create_task(feed_rest())
    if reference:
        body = bytearray()
        async for chunk in response.aiter_raw():
            body += chunk
            if len(body) >= cap:
                break
    else:
        body = await response.read_capped(cap)
    await feeder
    return bytes(body), response._buffered, flow.calls, list(response._chunks)


_SIZES = (1, 7, 100, _READ_HIGH_WATER // 4, _READ_HIGH_WATER // 2 + 1)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.sampled_from(_SIZES), max_size=8),
    ahead=st.integers(0, 8),
    cap=st.sampled_from((1, 64, 1024, 64 * 1024, _READ_HIGH_WATER * 2)),
)
def test_read_capped_reads_what_the_async_iteration_read(
    sizes: list[int], ahead: int, cap: int
) -> None:
    chunks = [bytes([65 + i]) * size for i, size in enumerate(sizes)]
    got = asyncio.run(_read(chunks, ahead, cap, reference=False))
    expected = asyncio.run(_read(chunks, ahead, cap, reference=True))
    assert got == expected


def test_read_capped_raises_the_connections_error() -> None:
    async def main() -> None:
        import httpx

        response = WireResponse(_Flow(), asyncio.get_running_loop().create_future())  # type: ignore[arg-type]
        response._head.set_result(None)
        response.body_received(b"part")
        response.failed(httpx.ReadError("connection lost"))
        try:
            await response.read_capped(1024)
        except httpx.ReadError as exc:
            assert "connection lost" in str(exc)
        else:
            raise AssertionError("no error")

    asyncio.run(main())


async def test_the_reuse_check_sees_a_close_after_an_earlier_check() -> None:
    """The poller kept from the first check must see what came in after it: the peer's
    close, before the event loop has handled it (no await in between)."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    transport, connection = await loop.create_connection(
        lambda: _Connection(_Pool(1), (False, "127.0.0.1", 1)), sock=ours
    )
    try:
        connection.expiry, connection.idle_since = 10.0, 0.0
        assert connection.usable(1.0)
        assert connection.usable(1.0)  # still nothing came in
        theirs.close()
        assert not connection.usable(1.0)
    finally:
        transport.abort()


async def test_the_reuse_check_sees_stray_bytes_after_an_earlier_check() -> None:
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    transport, connection = await loop.create_connection(
        lambda: _Connection(_Pool(1), (False, "127.0.0.1", 1)), sock=ours
    )
    try:
        connection.expiry, connection.idle_since = 10.0, 0.0
        assert connection.usable(1.0)
        theirs.send(b"H")
        assert not connection.usable(1.0)
    finally:
        transport.abort()
        theirs.close()


async def test_on_send_fires_once_before_the_request_goes_out() -> None:
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    async with scripted() as server:
        seen: list[int] = []
        response = await wire.post(
            server.url, {}, b"{}", deadline=5.0, on_send=lambda: seen.append(len(server.heads))
        )
        await response.read_capped(1024)
        await response.aclose()
        assert seen == [0]  # called once, before the receiver had the request
        assert len(server.heads) == 1
    await wire.aclose()


async def test_on_send_does_not_fire_for_a_request_that_sends_nothing() -> None:
    wire = WireTransport(policy=AddressPolicy(()))  # loopback refused by the guard
    seen: list[str] = []
    with pytest.raises(AddressRefusedError):
        await wire.post(
            "http://127.0.0.1:9/hook", {}, b"{}", deadline=5.0, on_send=lambda: seen.append("x")
        )
    assert seen == []
    await wire.aclose()
