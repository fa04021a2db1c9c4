"""Fixtures of the delivery tests: raw loopback receivers and a client on our own wire."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator

import httpx
import pytest

from delivery.http import build_http_client
from tests.delivery.loopback import Receiver, StartReceiver
from tests.delivery.proxies import tinyproxy  # noqa: F401  (a fixture: real tinyproxy processes)
from tests.helpers import LOOPBACK


@pytest.fixture
async def start_receiver() -> AsyncIterator[StartReceiver]:
    started: list[Receiver] = []

    async def start(
        host: str = "127.0.0.1", port: int = 0, tls: ssl.SSLContext | None = None, **kw: object
    ) -> Receiver:
        receiver = Receiver(host=host, **kw)  # type: ignore[arg-type]
        receiver.server = await asyncio.start_server(receiver.handle, host, port, ssl=tls)
        receiver.port = receiver.server.sockets[0].getsockname()[1]
        started.append(receiver)
        return receiver

    yield start
    for receiver in started:
        assert receiver.server is not None
        receiver.server.close()
        await receiver.server.wait_closed()


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with build_http_client(
        max_connections=10, timeout=5, transport="wire", allowed_networks=LOOPBACK
    ) as client:
        yield client
