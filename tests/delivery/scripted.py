"""Scripted receivers that write exact bytes, and the wire driven by hand, for the wire tests.

`scripted` answers each request with the next scripted reply; `in_pieces` writes one
answer in several reads; `attempt` sends one signed POST through `send_attempt`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

from delivery.http import AttemptResult, DeliveryClient, OutgoingRequest, send_attempt
from delivery.ssrf import AddressPolicy
from delivery.wire import WireTransport
from outbox.clock import ManualClock
from tests.helpers import LOOPBACK

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
HANG_UP = b""  # an answer of nothing: close the connection after reading the request


@dataclass
class Scripted:
    """A loopback server answering each request with the next scripted bytes."""

    answers: list[bytes]
    delay: float = 0.0
    close_after_each: bool = False
    connections: int = 0
    open_now: int = 0
    most_open: int = 0
    bodies: list[bytes] = field(default_factory=list)
    heads: list[bytes] = field(default_factory=list)
    port: int = 0
    handlers: set[asyncio.Task[None]] = field(default_factory=set)
    writers: list[asyncio.StreamWriter] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        self.open_now += 1
        self.most_open = max(self.most_open, self.open_now)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                self.heads.append(head)
                self.bodies.append(await reader.readexactly(length))
                await asyncio.sleep(self.delay)
                answer = self.answers.pop(0) if self.answers else OK
                if answer == HANG_UP:
                    return
                writer.write(answer)
                await writer.drain()
                if self.close_after_each:
                    return
        finally:
            self.open_now -= 1
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


@contextlib.asynccontextmanager
async def scripted(*replies: bytes, **kwargs: object) -> AsyncIterator[Scripted]:
    server = Scripted(list(replies), **kwargs)  # type: ignore[arg-type]
    listening = await asyncio.start_server(server.serve, "127.0.0.1", 0)
    server.port = listening.sockets[0].getsockname()[1]
    try:
        yield server
    finally:
        listening.close()
        for writer in server.writers:
            writer.transport.abort()
        await asyncio.gather(*server.handlers, return_exceptions=True)
        await listening.wait_closed()


async def attempt(
    http: httpx.AsyncClient, url: str, body: bytes = b'{"a":1}', body_cap: int = 64 * 1024
) -> AttemptResult:
    request = OutgoingRequest(
        delivery_id=1, url=url, message_id="msg_1", body=body, keys=[b"k" * 32], timeout=5.0
    )
    return await send_attempt(http, request, ManualClock(), body_cap=body_cap, excerpt_bytes=64)


@contextlib.asynccontextmanager
async def in_pieces(*pieces: bytes, pause: float = 0.02) -> AsyncIterator[str]:
    """A receiver that reads one request and writes its answer in `pieces`, one read each."""
    handlers: list[asyncio.Task[None]] = []
    writers: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.append(task)
        writers.append(writer)
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        await reader.readexactly(length)
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(pause)
        with contextlib.suppress(ConnectionError):
            await reader.read()  # until the client closes

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/hook"
    finally:
        server.close()
        for writer in writers:
            writer.transport.abort()
        await asyncio.gather(*handlers, return_exceptions=True)
        await server.wait_closed()


class Monotonic:
    """A monotonic clock the test moves (the pool's idle expiry), so nothing sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def wire_with(clock: Monotonic) -> WireTransport:
    wire = WireTransport(policy=AddressPolicy(LOOPBACK))
    wire._pool._monotonic = clock  # the pool's clock; production's is time.monotonic
    return wire


async def post_and_read(wire: WireTransport, url: str) -> bool:
    """One POST read to its end; True when its connection went back to the pool."""
    response = await wire.post(url, {}, b"{}", deadline=5.0)
    async for _ in response.aiter_raw():
        pass
    await response.aclose()
    return response.released


def pooled(through: httpx.AsyncClient | WireTransport) -> int:
    """Connections the wire holds open: a server's close shows here once the connection
    has seen it (the pool forgets it then)."""
    wire = through.delivery_transport if isinstance(through, DeliveryClient) else through
    assert isinstance(wire, WireTransport)
    return wire._pool._open
