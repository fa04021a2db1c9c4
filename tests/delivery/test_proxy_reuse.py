"""When the wire reuses a connection through an egress proxy (issue 22, items 5 and 8).

Debian's tinyproxy answers a plain-HTTP (absolute-form) request with the upstream's
status line, `Connection` and `Keep-Alive` stripped and nothing in their place (no
`Connection: close`, no `Proxy-Connection`), and closes the connection about 50 us after
the last body byte: by HTTP/1.1's default the connection stays open, and it never
does. A request written onto it straight after is lost with the connection (an
ambiguous attempt, and a duplicate when it is retried). So a plain-HTTP connection to
a forward proxy is kept only when the response says `keep-alive` explicitly, and every
idle connection is checked for a close (or stray bytes) already received before a
request is written onto it, as curl, urllib3 and httpcore do. A CONNECT tunnel is the
origin's connection end to end and keeps being reused.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import httpx
import pytest

from delivery.http import DeliveryClient, OutgoingRequest, build_http_client, send_attempt
from delivery.policy import Outcome
from delivery.receiver import Receiver
from delivery.ssrf import AddressPolicy
from delivery.wire import WireTransport
from outbox.clock import ManualClock
from tests.delivery.loopback import answers, tls_contexts
from tests.delivery.proxies import StartProxy
from tests.delivery.scripted import scripted
from tests.helpers import LOOPBACK

# Back to back, without the fix, about half of these were lost (ambiguous) through tinyproxy.
BURST = 20


async def burst(http: httpx.AsyncClient, url: str, count: int = BURST) -> list[str]:
    """`count` attempts to `url`, one right after the other; each one's error or 'ok'."""
    errors = []
    for n in range(count):
        request = OutgoingRequest(
            delivery_id=n,
            url=url,
            message_id=f"msg_{n}",
            body=b'{"a":1}',
            keys=[b"k" * 32],
            timeout=5.0,
        )
        result = await send_attempt(http, request, ManualClock())
        errors.append("ok" if result.outcome is Outcome.SUCCEEDED else f"{result.error}")
    return errors


def arrived_once(receiver: Receiver, path: str, count: int = BURST) -> bool:
    """Every attempt's message arrived exactly once."""
    ids = Counter(request.headers["webhook-id"] for request in receiver.received(path))
    return ids == Counter(f"msg_{n}" for n in range(count))


async def test_back_to_back_plain_http_through_tinyproxy_all_arrive_once(
    receiver: Receiver, tinyproxy: StartProxy
) -> None:
    proxy = tinyproxy()
    url = receiver.route("/burst")
    async with build_http_client(
        max_connections=5, timeout=5, allowed_networks=LOOPBACK, proxy=proxy.url()
    ) as http:
        errors = await burst(http, url)
    assert errors == ["ok"] * BURST, Counter(errors)
    assert arrived_once(receiver, "/burst")
    assert len(proxy.requests()) == BURST


async def test_https_through_tinyproxy_keeps_reusing_its_tunnel(
    tmp_path: Path, tinyproxy: StartProxy
) -> None:
    """The tunnel carries TLS to the receiver, which keeps the connection alive: one
    CONNECT serves the whole burst."""
    server_tls, client_tls = tls_contexts("hook.test", tmp_path)
    async with Receiver("127.0.0.2", tls=server_tls) as receiver:
        proxy = tinyproxy(connect_ports=(receiver.port,))
        resolve, _ = answers(["127.0.0.2"])
        wire = WireTransport(
            policy=AddressPolicy(["127.0.0.2/32"]),
            ssl_context=client_tls,
            resolver=resolve,
            proxy=proxy.url(),
        )
        async with DeliveryClient(transport=wire, proxy=wire.proxy) as http:
            errors = await burst(http, f"https://hook.test:{receiver.port}/tunnel")
    assert errors == ["ok"] * BURST, Counter(errors)
    assert arrived_once(receiver, "/tunnel")
    assert proxy.requests() == [f"CONNECT 127.0.0.2:{receiver.port} HTTP/1.1"]


def answer(said: bytes, version: bytes = b"1.1") -> bytes:
    return b"HTTP/%s 200 OK\r\nContent-Length: 2\r\n%s\r\nok" % (version, said)


@pytest.mark.parametrize(
    ("reply", "connections"),
    [
        (answer(b"Connection: keep-alive\r\n"), 1),
        (answer(b"Proxy-Connection: Keep-Alive\r\n"), 1),
        (answer(b"Connection: Keep-Alive\r\nKeep-Alive: timeout=30\r\n"), 1),
        (answer(b""), 3),  # HTTP/1.1's default, what tinyproxy sends: no promise from a proxy
        (answer(b"Connection: x-trace\r\n"), 3),
        (answer(b"Connection: keep-alive, close\r\n"), 3),
        (answer(b"Connection: keep-alive\r\nProxy-Connection: close\r\n"), 3),
        (answer(b"Proxy-Connection: keep-alive\r\n", version=b"1.0"), 3),
    ],
)
async def test_a_forward_proxy_connection_is_kept_only_when_said_keep_alive(
    reply: bytes, connections: int
) -> None:
    """A scripted forward proxy that in truth keeps every connection open: the wire
    reuses one only on the proxy's explicit word."""
    async with (
        scripted(reply, reply, reply) as proxy,
        build_http_client(
            max_connections=5,
            timeout=5,
            allowed_networks=LOOPBACK,
            proxy=f"http://127.0.0.1:{proxy.port}",
        ) as http,
    ):
        errors = await burst(http, "http://127.0.0.1:9/hook", count=3)
    assert errors == ["ok"] * 3
    assert proxy.connections == connections
    assert [head.split(b" ")[1] for head in proxy.heads] == [b"http://127.0.0.1:9/hook"] * 3


async def test_an_idle_connection_the_server_closed_is_not_written_onto() -> None:
    """A server that answers HTTP/1.1 without `Connection: close` and then closes (as
    tinyproxy does, here without a proxy): its close is in before the next request, which
    goes out on a new connection instead of being lost."""
    async with (
        scripted(close_after_each=True) as server,
        build_http_client(max_connections=5, timeout=5, allowed_networks=LOOPBACK) as http,
    ):
        errors = await burst(http, server.url)
    assert errors == ["ok"] * BURST, Counter(errors)
    assert len(server.bodies) == BURST
    assert server.connections == BURST


@pytest.mark.parametrize(
    "said", [b"Connection: keep-alive\r\n", b"Proxy-Connection: keep-alive\r\n"]
)
async def test_an_http_1_0_answer_is_never_kept_whatever_it_says(said: bytes) -> None:
    """llhttp keeps an HTTP/1.0 connection on either header (it reads `Proxy-Connection`
    as `Connection`); h11, the reference, keeps none, so neither does the wire."""
    reply = answer(said, version=b"1.0")
    async with (
        scripted(reply, reply, reply) as server,
        build_http_client(max_connections=5, timeout=5, allowed_networks=LOOPBACK) as http,
    ):
        errors = await burst(http, server.url, count=3)
    assert errors == ["ok"] * 3
    assert server.connections == 3


def test_the_close_is_seen_on_uvloop_too() -> None:
    """`outbox run` uses uvloop when installed: its transports give the socket too."""
    import uvloop

    async def run() -> tuple[list[str], int]:
        async with (
            scripted(close_after_each=True) as server,
            build_http_client(max_connections=5, timeout=5, allowed_networks=LOOPBACK) as http,
        ):
            return await burst(http, server.url), server.connections

    errors, connections = uvloop.run(run())
    assert errors == ["ok"] * BURST, Counter(errors)
    assert connections == BURST
