"""The benchmark's receiver: a bare asyncio HTTP/1.1 server in its own process.

Why a separate process and a raw protocol: the receiver must never be what limits
the measurement, and it must not share the GIL with the worker it measures. It
parses just enough HTTP (request line, Content-Length, `webhook-id`), answers
`200` with an empty body on a kept-alive connection, and notes the arrival time of
every request with `time.time()` so latencies can be taken against the producer's
scheduled publish times (same host, same clock).

Paths:
    /_count     -> {"count": n, "unsigned": u}   requests so far (control, not counted)
    /_arrivals  -> [[webhook-id, unix time], ...] and forgets them (control)
    /_wait/N    -> as /_count, once the count reaches N or after WAIT_SECONDS (control):
                   a caller waits on the arrivals themselves instead of polling
    /slow/...   -> answered after SLOW_DELAY seconds (keeps deliveries in flight)
    /wait/MS/...-> answered after MS milliseconds (a partner with that latency)
    anything    -> 200 at once

Run it as `python -m bench.receiver [--port N] [--slow-delay S]`; it prints its port.
It runs on uvloop when that is installed, so that it stays the cheap side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from collections.abc import Callable
from typing import cast

_OK = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
# The longest a /_wait/N answer is held back: its caller checks its own deadline between.
WAIT_SECONDS = 1.0


class State:
    def __init__(self, slow_delay: float) -> None:
        self.ids: list[str] = []
        self.times: list[float] = []
        self.count = 0
        self.unsigned = 0
        self.slow_delay = slow_delay
        # /_wait/N callers not answered yet: (N, answer)
        self.waiters: list[tuple[int, Callable[[], None]]] = []

    def wake(self) -> None:
        """Answer the /_wait callers whose count is reached."""
        for answer in [answer for target, answer in self.waiters if target <= self.count]:
            answer()


def _header(head: bytes, name: bytes) -> bytes | None:
    at = head.find(b"\r\n" + name + b":")
    if at < 0:
        return None
    start = at + len(name) + 3
    end = head.find(b"\r\n", start)
    return head[start : end if end >= 0 else len(head)].strip()


class HttpProtocol(asyncio.Protocol):
    def __init__(self, state: State) -> None:
        self.state = state
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses; they have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        arrived = time.time()
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buffer[:end]).lower() + b"\r\n"
            length = int(_header(head, b"content-length") or 0)
            if len(self.buffer) < end + 4 + length:
                return
            del self.buffer[: end + 4 + length]
            self._answer(head, arrived)

    def _answer(self, head: bytes, arrived: float) -> None:
        assert self.transport is not None
        path = head[head.find(b" ") + 1 : head.find(b" ", head.find(b" ") + 1)]
        if path.startswith(b"/_wait/"):
            self._wait(int(path.split(b"/")[2]))
            return
        if path.startswith(b"/_"):
            self.transport.write(self._control(path))
            return
        state = self.state
        state.count += 1
        if state.waiters:
            state.wake()
        webhook_id = _header(head, b"webhook-id")
        if webhook_id is not None:
            state.ids.append(webhook_id.decode())
            state.times.append(arrived)
        if _header(head, b"webhook-signature") is None:
            state.unsigned += 1
        if path.startswith(b"/slow"):
            asyncio.get_running_loop().call_later(state.slow_delay, self._write_ok)
        elif path.startswith(b"/wait/"):
            millis = int(path.split(b"/")[2])
            asyncio.get_running_loop().call_later(millis / 1000, self._write_ok)
        else:
            self.transport.write(_OK)

    def _wait(self, target: int) -> None:
        """Answer /_wait/N (the count) once `target` requests arrived, or after WAIT_SECONDS."""
        state = self.state
        if state.count >= target:
            self._write_control(b"/_count")
            return

        def answer() -> None:
            if waiter in state.waiters:
                state.waiters.remove(waiter)
                timer.cancel()
                self._write_control(b"/_count")

        waiter = (target, answer)
        timer = asyncio.get_running_loop().call_later(WAIT_SECONDS, answer)
        state.waiters.append(waiter)

    def _write_control(self, path: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(self._control(path))

    def _write_ok(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(_OK)

    def _control(self, path: bytes) -> bytes:
        state = self.state
        if path.startswith(b"/_arrivals"):
            body = json.dumps(list(zip(state.ids, state.times, strict=True))).encode()
            state.ids, state.times = [], []
        else:
            body = json.dumps({"count": state.count, "unsigned": state.unsigned}).encode()
        return (
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )


async def serve(port: int, slow_delay: float) -> None:
    state = State(slow_delay)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: HttpProtocol(state), "127.0.0.1", port, backlog=2048, reuse_address=True
    )
    print(server.sockets[0].getsockname()[1], flush=True)
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--slow-delay", type=float, default=3.0)
    args = parser.parse_args()
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(args.port, args.slow_delay))
    else:
        uvloop.run(serve(args.port, args.slow_delay))


if __name__ == "__main__":
    main()
