"""A small, fast HTTP/1.1 receiver on loopback for the demo, the tests and the benchmark.

It records every request and answers per path with a configurable behaviour, so
one process can play a healthy partner, a failing one and a slow one at once.
It is a test double for partners, not a production server.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ReceivedRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    received_at: float  # time.time() on arrival, for latency measurements


@dataclass(slots=True)
class Behaviour:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    delay: float = 0.0  # seconds before answering (a slow or hanging partner)
    reset: bool = False  # read the request, then drop the connection without answering
    trickle_interval: float | None = None  # send the body one byte per interval
    raw: bytes | None = None  # send exactly these bytes as the response, then close


Handler = Callable[[ReceivedRequest], Awaitable[Behaviour] | Behaviour]

_REASONS = {
    200: "OK",
    201: "Created",
    204: "No Content",
    301: "Moved Permanently",
    302: "Found",
    400: "Bad Request",
    404: "Not Found",
    408: "Request Timeout",
    410: "Gone",
    425: "Too Early",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
}


class Receiver:
    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, *, tls: ssl.SSLContext | None = None
    ) -> None:
        """`tls` (a server context) serves HTTPS, with keep-alive as over plain HTTP."""
        self.host = host
        self.port = port
        self.tls = tls
        self.requests: list[ReceivedRequest] = []
        self.routes: dict[str, Behaviour | Handler] = {}
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

    @property
    def base_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    def route(
        self, path: str, behaviour: Behaviour | Handler | None = None, **kwargs: object
    ) -> str:
        """Set how `path` answers; returns its full URL."""
        self.routes[path] = behaviour if behaviour is not None else Behaviour(**kwargs)  # type: ignore[arg-type]
        return self.url(path)

    def received(self, path: str | None = None) -> list[ReceivedRequest]:
        return [r for r in self.requests if path is None or r.path == path]

    async def start(self) -> Receiver:
        self._server = await asyncio.start_server(self._serve, self.host, self.port, ssl=self.tls)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            # Closing the sockets (rather than cancelling handlers) ends each connection
            # cleanly, including one a slow behaviour is still sleeping in.
            for task, writer in list(self._connections.items()):
                writer.transport.abort()
                task.cancel()
            for task in list(self._connections):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> Receiver:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    break
                self.requests.append(request)
                behaviour = await self._behaviour_for(request)
                if behaviour.reset:
                    writer.transport.abort()
                    break
                if behaviour.delay:
                    await asyncio.sleep(behaviour.delay)
                if behaviour.raw is not None:
                    writer.write(behaviour.raw)
                    await writer.drain()
                    break
                await _write_response(writer, behaviour)
                if request.headers.get("connection", "").lower() == "close":
                    break
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError, ssl.SSLError):
            pass
        finally:
            self._connections.pop(task, None)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _behaviour_for(self, request: ReceivedRequest) -> Behaviour:
        configured = self.routes.get(request.path, Behaviour())
        if isinstance(configured, Behaviour):
            return configured
        produced = configured(request)
        if isinstance(produced, Behaviour):
            return produced
        return await produced


async def _read_request(reader: asyncio.StreamReader) -> ReceivedRequest | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    arrived = time.time()
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0") or 0)
    body = await reader.readexactly(length) if length else b""
    return ReceivedRequest(method, path, headers, body, arrived)


async def _write_response(writer: asyncio.StreamWriter, behaviour: Behaviour) -> None:
    reason = _REASONS.get(behaviour.status, "Status")
    head = [f"HTTP/1.1 {behaviour.status} {reason}", f"Content-Length: {len(behaviour.body)}"]
    head += [f"{name}: {value}" for name, value in behaviour.headers.items()]
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
    if behaviour.trickle_interval is None:
        # Large bodies go out in chunks, so a client that stops reading holds this
        # server to one chunk of buffer instead of a copy of the whole body.
        view = memoryview(behaviour.body)
        for start in range(0, len(view), 64 * 1024):
            writer.write(view[start : start + 64 * 1024])
            await writer.drain()
        await writer.drain()
        return
    await writer.drain()
    for byte in behaviour.body:
        writer.write(bytes([byte]))
        await writer.drain()
        await asyncio.sleep(behaviour.trickle_interval)
