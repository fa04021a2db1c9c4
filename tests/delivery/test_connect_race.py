"""Happy Eyeballs in the wire (issue 22, defect 7): a name's checked addresses are raced,
not tried one after another under one deadline.

The blackhole is loopback-only: a listening socket whose accept queue is full drops
every further SYN (Linux, tcp_abort_on_overflow=0), so a connect to it hangs like one
to an address that drops packets. Nothing here sends traffic off 127.0.0.0/8.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import httpx
import pytest

from delivery.http import DeliveryClient, OutgoingRequest, send_attempt
from delivery.policy import Outcome
from delivery.ssrf import AddressPolicy
from delivery.wire import WireTransport
from delivery.wire.connect import _close_connection
from delivery.wire.connection import _Connection
from outbox.clock import ManualClock
from tests.delivery.loopback import StartReceiver, answers, blackhole, tls_receiver_recording_sni


async def deliver(wire: WireTransport, url: str, deadline: float) -> Outcome:
    async with DeliveryClient(transport=wire, proxy=None) as client:
        request = OutgoingRequest(
            delivery_id=1,
            url=url,
            message_id="msg_1",
            body=b"{}",
            keys=[b"k" * 32],
            timeout=deadline,
        )
        result = await send_attempt(client, request, ManualClock())
    assert result.error is None, result.error
    return result.outcome


async def test_a_blackholed_first_address_costs_a_stagger_not_the_deadline(
    start_receiver: StartReceiver,
) -> None:
    receiver = await start_receiver("127.0.0.1")
    resolve, asked = answers(["127.0.0.2", "127.0.0.1"])  # the blackhole first
    wire = WireTransport(policy=AddressPolicy(["127.0.0.0/8"]), resolver=resolve)
    with blackhole("127.0.0.2", receiver.port):
        # Tried one after another, the first address would eat the whole deadline.
        outcome = await deliver(wire, f"http://hook.test:{receiver.port}/hook", deadline=3.0)
    assert outcome is Outcome.SUCCEEDED
    assert asked == ["hook.test"]
    assert len(receiver.requests) == 1


async def test_a_first_address_that_stalls_tls_loses_and_is_closed(
    start_receiver: StartReceiver, tmp_path: Path
) -> None:
    """The race covers the TLS handshake too: a server that accepts TCP and never
    answers the ClientHello loses to the next address, and its connection is closed."""
    receiver, client_ctx, sni = await tls_receiver_recording_sni(start_receiver, tmp_path)
    stalled: list[asyncio.StreamReader] = []
    closed = asyncio.Event()

    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stalled.append(reader)
        while await reader.read(65536):
            pass  # swallow the ClientHello, answer nothing
        closed.set()
        writer.close()

    server = await asyncio.start_server(stall, "127.0.0.1", receiver.port)
    resolve, _ = answers(["127.0.0.1", "127.0.0.2"])
    wire = WireTransport(
        policy=AddressPolicy(["127.0.0.0/8"]), resolver=resolve, ssl_context=client_ctx
    )
    try:
        outcome = await deliver(wire, f"https://hook.test:{receiver.port}/hook", deadline=3.0)
        assert outcome is Outcome.SUCCEEDED
        assert len(stalled) == 1  # the first address was tried first
        async with asyncio.timeout(3):
            await closed.wait()  # the loser was cancelled and its connection closed
    finally:
        server.close()
        await server.wait_closed()
    assert sni == ["hook.test"]
    assert len(receiver.requests) == 1


async def test_a_refused_address_hands_over_at_once_and_all_failures_are_named() -> None:
    """A failure starts the next address without waiting out the stagger (here far
    longer than the test allows), and the error names every address tried."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]  # bound, not listening: connects are refused
    resolve, _ = answers(["127.0.0.1", "127.0.0.2", "127.0.0.3"])
    wire = WireTransport(
        policy=AddressPolicy(["127.0.0.0/8"]), resolver=resolve, connect_stagger=60.0
    )
    try:
        async with asyncio.timeout(5):
            with pytest.raises(httpx.ConnectError) as failed:
                await wire.post(f"http://hook.test:{port}/", {}, b"{}", deadline=30.0)
    finally:
        holder.close()
        await wire.aclose()
    message = str(failed.value)
    assert message.startswith(f"cannot connect to hook.test:{port} (")
    for address in ("127.0.0.1", "127.0.0.2", "127.0.0.3"):
        assert f"{address}: " in message


async def test_a_loser_that_connected_anyway_is_closed_and_frees_no_place_in_the_pool() -> None:
    """Both addresses connect in the same turn of the loop: one wins, the other is closed
    and, never counted by the pool, does not lower its count (a pool that counted one
    connection too few would open one more than its limit). No receiver produces that
    turn on demand, so the race runs here on real connections with a scripted order."""
    accepted: list[asyncio.StreamWriter] = []
    handlers: list[asyncio.Task[None]] = []
    closed = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)
        handlers.append(asyncio.current_task())  # type: ignore[arg-type]
        await reader.read()  # until the client closes
        closed.set()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    wire = WireTransport(policy=AddressPolicy(["127.0.0.0/8"]), connect_stagger=0.01)
    key = (False, "127.0.0.1", port)
    first_up, second_up = asyncio.Event(), asyncio.Event()

    async def open_one(address: str) -> _Connection:
        if address == "second":
            await first_up.wait()
        _, connection = await asyncio.get_running_loop().create_connection(
            lambda: _Connection(wire._pool, key), "127.0.0.1", port
        )
        if address == "first":
            first_up.set()
            await second_up.wait()  # done in the turn after the second one
        else:
            second_up.set()
        return connection

    winner: _Connection | None = None
    try:
        async with asyncio.timeout(5):
            winner = await wire._pool.acquire(
                key,
                lambda: wire._first_to_connect(
                    ["first", "second"], open_one, "the test", _close_connection
                ),
            )
            await closed.wait()  # the loser's connection was closed
        assert len(accepted) == 2
        assert not winner.closed
        assert wire._pool._open == 1
    finally:
        if winner is not None:
            winner.abort()
        await wire.aclose()
        server.close()
        for writer in accepted:
            writer.transport.abort()
        await asyncio.gather(*handlers, return_exceptions=True)
        await server.wait_closed()
