"""Egress through a real proxy: Debian's tinyproxy on 127.0.0.1 (issue 22, item 5).

Every proxy here is a tinyproxy process started from a generated configuration on a
free loopback port (.ci/run installs the package; without it these tests fail). The
proxy changes where bytes go, never what the SSRF guard allows: HTTPS goes through
`CONNECT` to the address the guard checked, plain HTTP in absolute form naming it, and
a refused target is refused before the proxy hears of it. Proxy credentials are a
secret: never logged, never in attempt rows, audit rows or API answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine
from standardwebhooks import Webhook

from delivery.http import (
    AttemptResult,
    DeliveryClient,
    OutgoingRequest,
    build_http_client,
    send_attempt,
)
from delivery.operator.api import create_app
from delivery.operator.cli import main
from delivery.policy import Outcome
from delivery.receiver import Behaviour, Receiver
from delivery.ssrf import AddressPolicy
from delivery.wire import WireTransport
from delivery.worker import Worker
from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox, generate_key
from outbox.endpoints import set_proxy
from outbox.errors import ConfigurationError, InvalidEndpointURLError
from outbox.relay import Relay
from outbox.settings import load_settings
from outbox.tokens import create_token
from outbox.urls import parse_proxy_url
from tests.delivery.loopback import StartReceiver, answers, tls_receiver_recording_sni
from tests.delivery.proxies import StartProxy, free_port
from tests.helpers import LOOPBACK, add_endpoint, rows, scalar

PASSWORD = "s3cret-proxy-pw"


def outgoing(url: str, proxy: str | None = None, deadline: float = 5.0) -> OutgoingRequest:
    return OutgoingRequest(
        delivery_id=1,
        url=url,
        message_id="msg_1",
        body=b'{"a":1}',
        keys=[b"k" * 32],
        timeout=deadline,
        proxy=proxy,
    )


async def attempt(client: httpx.AsyncClient, url: str, proxy: str | None = None) -> AttemptResult:
    return await send_attempt(client, outgoing(url, proxy), ManualClock())


# -- through the worker, end to end --------------------------------------------------------


async def test_a_signed_delivery_arrives_through_the_proxy(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    tinyproxy: StartProxy,
) -> None:
    proxy = tinyproxy(user="outbox", password=PASSWORD)
    created = add_endpoint(engine, box, receiver.route("/signed"))
    with engine.begin() as conn:
        publish(conn, "order.created", {"id": 1})
    async with build_http_client(
        max_connections=5, timeout=5, allowed_networks=LOOPBACK, proxy=proxy.url()
    ) as http:
        await Relay(async_engine, clock).run_until_idle()
        stats = await Worker(async_engine, http, box, clock).run_once()
    assert stats.succeeded == 1
    [request] = receiver.requests
    Webhook(created.secret).verify(request.body, request.headers)
    assert "proxy-authorization" not in request.headers  # the proxy consumed it
    # Plain HTTP: absolute form naming the checked address, not a name the proxy resolves.
    assert proxy.requests() == [f"POST http://127.0.0.1:{receiver.port}/signed HTTP/1.1"]


async def test_an_endpoints_own_proxy_overrides_the_default_one(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    tinyproxy: StartProxy,
) -> None:
    default, own = tinyproxy(), tinyproxy(user="partner", password=PASSWORD)
    special = add_endpoint(engine, box, receiver.route("/special"), "order.*")
    plain = add_endpoint(engine, box, receiver.route("/plain"), "order.*")
    with engine.begin() as conn:
        set_proxy(conn, box, special.endpoint.uid, own.url(), actor="test")
        publish(conn, "order.created", {"id": 1})
    async with build_http_client(
        max_connections=5, timeout=5, allowed_networks=LOOPBACK, proxy=default.url()
    ) as http:
        await Relay(async_engine, clock).run_until_idle()
        stats = await Worker(async_engine, http, box, clock).run_once()
    assert stats.succeeded == 2
    assert own.requests() == [f"POST http://127.0.0.1:{receiver.port}/special HTTP/1.1"]
    assert default.requests() == [f"POST http://127.0.0.1:{receiver.port}/plain HTTP/1.1"]
    for created, path in ((special, "/special"), (plain, "/plain")):
        [request] = receiver.received(path)
        Webhook(created.secret).verify(request.body, request.headers)


async def test_plain_http_names_the_checked_address_not_the_host(
    receiver: Receiver, tinyproxy: StartProxy
) -> None:
    """A name is resolved and checked here; the proxy is handed the checked address in
    absolute form, so its own DNS can never point the request somewhere else."""
    proxy = tinyproxy()
    resolve, asked = answers(["127.0.0.1"])
    wire = WireTransport(policy=AddressPolicy(LOOPBACK), resolver=resolve, proxy=proxy.url())
    async with DeliveryClient(transport=wire, proxy=wire.proxy) as client:
        result = await attempt(client, f"http://hook.test:{receiver.port}/named")
    assert result.outcome is Outcome.SUCCEEDED, result.error
    assert asked == ["hook.test"]
    assert proxy.requests() == [f"POST http://127.0.0.1:{receiver.port}/named HTTP/1.1"]
    assert len(receiver.received("/named")) == 1


# -- HTTPS through CONNECT ---------------------------------------------------------------


async def test_https_tunnels_to_the_checked_address_and_verifies_the_urls_host(
    start_receiver: StartReceiver, tmp_path: Path, tinyproxy: StartProxy
) -> None:
    receiver, client_ctx, sni = await tls_receiver_recording_sni(start_receiver, tmp_path)
    proxy = tinyproxy(connect_ports=(receiver.port,), user="outbox", password=PASSWORD)
    resolve, asked = answers(["127.0.0.2"])
    url = f"https://hook.test:{receiver.port}/hook"
    trusted = WireTransport(
        policy=AddressPolicy(["127.0.0.2/32"]),
        ssl_context=client_ctx,
        resolver=resolve,
        proxy=proxy.url(),
    )
    async with DeliveryClient(transport=trusted, proxy=trusted.proxy) as client:
        result = await attempt(client, url)
    assert result.outcome is Outcome.SUCCEEDED, result.error
    # The proxy was asked for the address the guard checked, never for the name.
    assert proxy.requests() == [f"CONNECT 127.0.0.2:{receiver.port} HTTP/1.1"]
    assert asked == ["hook.test"]
    assert sni == ["hook.test"]  # TLS end to end, for the URL's host
    assert [r.headers["host"] for r in receiver.requests] == [f"hook.test:{receiver.port}"]
    assert "proxy-authorization" not in receiver.requests[0].headers

    untrusted = WireTransport(
        policy=AddressPolicy(["127.0.0.2/32"]), resolver=resolve, proxy=proxy.url()
    )
    async with DeliveryClient(transport=untrusted, proxy=untrusted.proxy) as client:
        refused = await attempt(client, url)
    assert refused.outcome is Outcome.RETRYABLE
    assert "CERTIFICATE_VERIFY_FAILED" in (refused.error or "")
    assert len(receiver.requests) == 1


async def test_a_client_certificate_is_presented_end_to_end_through_the_tunnel(
    start_receiver: StartReceiver, tmp_path: Path, tinyproxy: StartProxy
) -> None:
    """Mutual TLS through an egress proxy: the TLS session, client certificate included,
    runs inside the CONNECT tunnel to the receiver; without one the receiver refuses."""
    from tests.delivery.pki import NOW, Authority, identity, mtls_server_context, trusting

    server_ca, client_ca = Authority("server CA"), Authority("partner client CA")
    receiver = await start_receiver(tls=mtls_server_context(tmp_path, server_ca, client_ca))
    proxy = tinyproxy(connect_ports=(receiver.port,))
    wire = WireTransport(
        policy=AddressPolicy(LOOPBACK), tls_factory=trusting(server_ca), proxy=proxy.url()
    )
    url = f"https://127.0.0.1:{receiver.port}/hook"
    async with DeliveryClient(transport=wire, proxy=wire.proxy) as client:
        presented = await send_attempt(
            client,
            dataclasses.replace(outgoing(url), client_certificate=identity(client_ca, "ep-a")),
            ManualClock(NOW),
        )
        without = await send_attempt(client, outgoing(url), ManualClock(NOW))
    assert presented.outcome is Outcome.SUCCEEDED, presented.error
    assert without.outcome is not Outcome.SUCCEEDED
    assert "presents none" in (without.error or ""), without.error
    assert len(receiver.requests) == 1
    assert proxy.requests() == [f"CONNECT 127.0.0.1:{receiver.port} HTTP/1.1"] * 2


async def test_a_blackholed_address_behind_the_proxy_costs_a_stagger(
    start_receiver: StartReceiver, tmp_path: Path, tinyproxy: StartProxy
) -> None:
    """Happy Eyeballs holds through the proxy too: while the proxy's connect to the first
    checked address hangs, a second CONNECT to the next one starts and wins."""
    from tests.delivery.loopback import blackhole

    receiver, client_ctx, sni = await tls_receiver_recording_sni(start_receiver, tmp_path)
    proxy = tinyproxy(connect_ports=(receiver.port,))
    resolve, _ = answers(["127.0.0.3", "127.0.0.2"])
    wire = WireTransport(
        policy=AddressPolicy(["127.0.0.0/8"]),
        ssl_context=client_ctx,
        resolver=resolve,
        proxy=proxy.url(),
    )
    with blackhole("127.0.0.3", receiver.port):
        async with DeliveryClient(transport=wire, proxy=wire.proxy) as client:
            result = await send_attempt(
                client, outgoing(f"https://hook.test:{receiver.port}/hook", deadline=3.0),
                ManualClock(),
            )  # fmt: skip
    assert result.outcome is Outcome.SUCCEEDED, result.error
    assert proxy.requests() == [
        f"CONNECT 127.0.0.3:{receiver.port} HTTP/1.1",
        f"CONNECT 127.0.0.2:{receiver.port} HTTP/1.1",
    ]
    assert sni == ["hook.test"]


async def test_direct_and_proxied_connections_pool_apart(
    receiver: Receiver, tinyproxy: StartProxy
) -> None:
    """An idle direct connection to the target is never used for a proxied request (and
    the other way round), nor one through another proxy or other credentials."""
    first, second = tinyproxy(), tinyproxy(user="a", password=PASSWORD)
    url = receiver.route("/pooled")
    async with build_http_client(max_connections=5, timeout=5, allowed_networks=LOOPBACK) as http:
        for proxy in (None, first.url(), None, second.url(), first.url(), None):
            result = await attempt(http, url, proxy)
            assert result.outcome is Outcome.SUCCEEDED, result.error
    target = f"POST http://127.0.0.1:{receiver.port}/pooled HTTP/1.1"
    assert first.requests() == [target, target]
    assert second.requests() == [target]
    assert len(receiver.requests) == 6


async def test_an_endpoint_proxy_holds_on_every_path_or_fails_clearly(
    receiver: Receiver, tinyproxy: StartProxy
) -> None:
    """Through a client with an event hook (httpx's full path, the wire's transport API)
    the endpoint's proxy is still used; on the httpx transport, which has no proxy
    support, the attempt fails as retryable and says so instead of going direct."""
    proxy = tinyproxy()
    url = receiver.route("/hooked")
    seen: list[str] = []

    async def hook(request: httpx.Request) -> None:
        seen.append(request.url.path)

    async with build_http_client(max_connections=2, timeout=5, allowed_networks=LOOPBACK) as http:
        http.event_hooks["request"] = [hook]
        hooked = await attempt(http, url, proxy.url())
    assert hooked.outcome is Outcome.SUCCEEDED, hooked.error
    assert seen == ["/hooked"]
    assert proxy.requests() == [f"POST http://127.0.0.1:{receiver.port}/hooked HTTP/1.1"]
    async with build_http_client(
        max_connections=2, timeout=5, allowed_networks=LOOPBACK, transport="httpx"
    ) as direct:
        refused = await attempt(direct, url, proxy.url())
    assert refused.outcome is Outcome.RETRYABLE
    assert "only the wire transport" in (refused.error or "")
    assert len(receiver.received("/hooked")) == 1


def test_https_through_the_proxy_on_uvloop(tmp_path: Path, tinyproxy: StartProxy) -> None:
    """`outbox run` uses uvloop when installed: the tunnel's TLS upgrade works there too."""
    import uvloop

    from tests.delivery.loopback import Receiver as TLSReceiver
    from tests.delivery.loopback import tls_contexts

    async def run() -> tuple[list[Outcome], list[str]]:
        server_ctx, client_ctx = tls_contexts("hook.test", tmp_path)
        receiver = TLSReceiver(host="127.0.0.2")
        handlers: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            handlers[task] = writer
            try:
                await receiver.handle(reader, writer)
            finally:
                handlers.pop(task, None)

        server = await asyncio.start_server(handle, "127.0.0.2", 0, ssl=server_ctx)
        port = server.sockets[0].getsockname()[1]
        proxy = tinyproxy(connect_ports=(port,))
        resolve, _ = answers(["127.0.0.2"])
        wire = WireTransport(
            policy=AddressPolicy(["127.0.0.2/32"]),
            ssl_context=client_ctx,
            resolver=resolve,
            proxy=proxy.url(),
        )
        try:
            async with DeliveryClient(transport=wire, proxy=wire.proxy) as client:
                results = [
                    await attempt(client, f"https://hook.test:{port}/hook") for _ in range(3)
                ]
        finally:
            server.close()
            await server.wait_closed()
            # 3.11's wait_closed does not wait for handlers, and a handler may still be
            # closing its TLS through the tunnel: uvloop refuses to close a loop under an
            # open transport (EBUSY), so let them finish, and abort what would not.
            if handlers:
                await asyncio.wait(list(handlers), timeout=5)
            for task, writer in list(handlers.items()):
                writer.transport.abort()
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        return [r.outcome for r in results], proxy.requests()

    outcomes, lines = uvloop.run(run())
    assert outcomes == [Outcome.SUCCEEDED] * 3
    assert lines and all(line.startswith("CONNECT 127.0.0.2:") for line in lines)


# -- the SSRF guard runs first -----------------------------------------------------------


async def test_a_private_target_is_refused_with_a_proxy_set(
    start_receiver: StartReceiver, tinyproxy: StartProxy
) -> None:
    """Loopback is allowed for the proxy (operator configuration, not checked) but not
    for targets; only 127.0.0.2 is. Refused targets never reach the proxy."""
    allowed = await start_receiver("127.0.0.2")
    loopback = await start_receiver("127.0.0.1")
    proxy = tinyproxy(connect_ports=(allowed.port, loopback.port))
    resolve, _ = answers(["10.0.0.5"])
    wire = WireTransport(
        policy=AddressPolicy(["127.0.0.2/32"]), resolver=resolve, proxy=proxy.url()
    )
    async with DeliveryClient(transport=wire, proxy=wire.proxy) as client:
        control = await attempt(client, f"http://127.0.0.2:{allowed.port}/hook")
        assert control.outcome is Outcome.SUCCEEDED, control.error
        for url in (
            f"http://127.0.0.1:{loopback.port}/hook",
            f"https://127.0.0.1:{loopback.port}/hook",
            f"http://intranet.test:{loopback.port}/hook",  # resolves to 10.0.0.5
            f"https://intranet.test:{loopback.port}/hook",
            f"http://[::ffff:127.0.0.1]:{loopback.port}/hook",
        ):
            refused = await attempt(client, url)
            assert refused.outcome is Outcome.PERMANENT, (url, refused.error)
            assert "refused to connect" in (refused.error or "")
    assert proxy.requests() == [f"POST http://127.0.0.2:{allowed.port}/hook HTTP/1.1"]
    assert loopback.requests == []


# -- proxy failures are clear, retryable, and say nothing of the credentials ----------------


async def test_proxy_credentials_required_wrong_and_right(
    start_receiver: StartReceiver, tinyproxy: StartProxy
) -> None:
    receiver = await start_receiver("127.0.0.1")
    proxy = tinyproxy(connect_ports=(receiver.port,), user="outbox", password=PASSWORD)
    async with build_http_client(max_connections=5, timeout=5, allowed_networks=LOOPBACK) as http:
        for scheme in ("http", "https"):
            url = f"{scheme}://127.0.0.1:{receiver.port}/hook"
            missing = await attempt(http, url, proxy.url(anonymous=True))
            wrong = await attempt(http, url, proxy.url(password="not-" + PASSWORD))
            for result in (missing, wrong):
                assert result.outcome is not Outcome.SUCCEEDED, (scheme, result.error)
                assert f"the proxy 127.0.0.1:{proxy.port}" in (result.error or "")
                assert PASSWORD not in (result.error or "")
            if scheme == "https":  # CONNECT: the wire reads the proxy's answer, a 407
                for result in (missing, wrong):
                    assert result.outcome is Outcome.RETRYABLE, result.error
                assert "requires credentials" in (missing.error or "")
                assert "refused the credentials" in (wrong.error or "")
            # Plain HTTP: tinyproxy answers 407 and closes without reading the body, so
            # the connection is reset before the answer can be read: it may be anything
            # (ambiguous, retried), and the error names the proxy. A proxy that lets the
            # 407 be read gets a retryable "407 from the egress proxy" (send_attempt).
        # Right credentials over plain HTTP (the TLS receiver is the HTTPS case above).
        right = await attempt(http, f"http://127.0.0.1:{receiver.port}/hook", proxy.url())
    assert right.outcome is Outcome.SUCCEEDED, right.error
    assert len(receiver.requests) == 1


async def test_the_oauth_token_request_takes_the_same_egress_path_as_the_delivery(
    receiver: Receiver, tinyproxy: StartProxy
) -> None:
    """A network that lets out only its proxy: the token request goes through the default
    proxy (OUTBOX_HTTP_PROXY) or the endpoint's own, like the POST; the SSRF guard still
    refuses a private token URL before the proxy hears of it."""
    from outbox.endpoint_auth import check_oauth_client

    default, own = tinyproxy(), tinyproxy(user="partner", password=PASSWORD)
    issuer = await Receiver().start()  # the token endpoint: another host than the receiver
    try:
        token = b'{"access_token": "tok-via-proxy", "expires_in": 300}'
        token_url = issuer.route("/token", Behaviour(status=200, body=token))
        oauth, _ = check_oauth_client(token_url, "partner-app", "client-s3cret", None)
        request = dataclasses.replace(outgoing(receiver.route("/hook")), oauth=oauth)
        sent = [
            f"POST http://127.0.0.1:{issuer.port}/token HTTP/1.1",
            f"POST http://127.0.0.1:{receiver.port}/hook HTTP/1.1",
        ]
        # (the client's default proxy, the endpoint's own, the one both requests take)
        for default_url, proxy, via in (
            (default.url(), None, default),
            (default.url(), own.url(), own),
            (None, own.url(), own),
        ):
            async with build_http_client(
                max_connections=2, timeout=5, allowed_networks=LOOPBACK, proxy=default_url
            ) as http:  # a new client: a new token cache, so the token is fetched again
                result = await send_attempt(
                    http, dataclasses.replace(request, proxy=proxy), ManualClock()
                )
            assert result.outcome is Outcome.SUCCEEDED, result.error
            assert via.requests()[-2:] == sent
        assert len(default.requests()) == 2 and len(own.requests()) == 4
        assert [r.headers["authorization"] for r in receiver.received("/hook")] == [
            "Bearer tok-via-proxy"
        ] * 3

        # The httpx transport cannot send through a proxy: no token request goes direct.
        async with build_http_client(
            max_connections=2, timeout=5, allowed_networks=LOOPBACK, transport="httpx"
        ) as http:
            direct = await send_attempt(
                http, dataclasses.replace(request, proxy=own.url()), ManualClock()
            )
        assert direct.outcome is Outcome.RETRYABLE
        assert "only the wire transport" in (direct.error or ""), direct.error
        assert len(issuer.received("/token")) == 3

        # Loopback not allowed: the private token URL is refused here, proxy or not.
        for proxy in (None, own.url()):
            async with build_http_client(max_connections=2, timeout=5, proxy=default.url()) as http:
                refused = await send_attempt(
                    http,
                    dataclasses.replace(request, url="https://partner.example/hook", proxy=proxy),
                    ManualClock(),
                )
            assert refused.outcome is Outcome.PERMANENT, refused.error
            assert "token endpoint" in (refused.error or "")
            assert "is refused" in (refused.error or ""), refused.error
        assert (len(default.requests()), len(own.requests())) == (2, 4)  # nothing more came
        assert len(issuer.received("/token")) == 3
    finally:
        await issuer.stop()


async def test_a_refused_tunnel_and_an_unreachable_proxy_are_retryable(
    receiver: Receiver, tinyproxy: StartProxy
) -> None:
    proxy = tinyproxy(connect_ports=(443,))  # not the receiver's port
    closed = free_port()
    https = receiver.url("/hook").replace("http://", "https://")
    async with build_http_client(max_connections=5, timeout=5, allowed_networks=LOOPBACK) as http:
        refused = await attempt(http, https, proxy.url())
        unreachable = await attempt(http, receiver.url("/hook"), f"http://127.0.0.1:{closed}")
    assert refused.outcome is Outcome.RETRYABLE
    assert f"the proxy 127.0.0.1:{proxy.port} refused CONNECT (403" in (refused.error or "")
    assert "ConnectPort" in (refused.error or "")
    assert unreachable.outcome is Outcome.RETRYABLE
    assert f"cannot connect to the proxy 127.0.0.1:{closed}" in (unreachable.error or "")
    assert receiver.requests == []


async def test_credentials_never_reach_logs_rows_or_answers(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    tinyproxy: StartProxy,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("DEBUG")
    proxy = tinyproxy(user="outbox", password=PASSWORD)
    failing = add_endpoint(engine, box, receiver.route("/a"), "order.*")
    working = add_endpoint(engine, box, receiver.route("/b"), "order.*")
    with engine.begin() as conn:
        set_proxy(conn, box, failing.endpoint.uid, proxy.url(password="x" + PASSWORD), actor="t")
        set_proxy(conn, box, working.endpoint.uid, proxy.url(), actor="t", reason="partner")
        publish(conn, "order.created", {"id": 1})
    async with build_http_client(max_connections=5, timeout=5, allowed_networks=LOOPBACK) as http:
        await Relay(async_engine, clock).run_until_idle()
        stats = await Worker(async_engine, http, box, clock).run_once()
    assert (stats.succeeded, stats.scheduled) == (1, 1)
    [error] = [
        r["error"] for r in rows(engine, "SELECT error FROM delivery_attempts") if r["error"]
    ]
    assert f"the proxy 127.0.0.1:{proxy.port}" in error  # where it failed, not with what

    app = create_app(async_engine, box, clock=clock)
    with engine.begin() as conn:
        _, secret = create_token(conn, name="ops", role="operator", actor="test")
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://admin",
        headers={"authorization": f"Bearer {secret}"},
    ) as api:  # fmt: skip
        listed = (await api.get("/v1/endpoints")).json()
        shown = (
            await api.patch(f"/v1/endpoints/{working.endpoint.uid}", json={"description": "p"})
        ).json()
    assert shown["proxy"] == f"127.0.0.1:{proxy.port}"
    assert {e["id"]: e["proxy"] for e in listed["items"]} == {
        failing.endpoint.uid: f"127.0.0.1:{proxy.port}",
        working.endpoint.uid: f"127.0.0.1:{proxy.port}",
    }

    stored = json.dumps(
        [
            rows(engine, "SELECT * FROM endpoints"),
            rows(engine, "SELECT * FROM deliveries"),
            rows(engine, "SELECT * FROM delivery_attempts"),
            rows(engine, "SELECT * FROM audit_log"),
        ],
        default=str,
    )
    for where, text in (
        ("database", stored),
        ("logs", caplog.text),
        ("API", json.dumps([listed, shown])),
    ):
        assert PASSWORD not in text, where
        assert "outbox:" not in text, where  # user:password
    audit = rows(
        engine, "SELECT details, reason FROM audit_log WHERE action = 'endpoint.proxy' ORDER BY id"
    )
    assert [(a["details"], a["reason"]) for a in audit] == [
        ({"proxy": f"127.0.0.1:{proxy.port}"}, None),
        ({"proxy": f"127.0.0.1:{proxy.port}"}, "partner"),
    ]


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (b"HTTP/1.1 200 OK\r\n" + b"x-pad: y\r\n" * 3000, "over 16384 bytes"),
        (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "not HTTP/1.1"),
        (b"HTTP/1.1 200 Connection established\r\n\r\nEARLY", "before TLS started"),
        (b"", "closed the connection during CONNECT"),
        (b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 3\r\n\r\nbad", "502 Bad Gateway"),
    ],
)
async def test_a_hostile_proxy_answer_to_connect_is_a_clear_connect_failure(
    answer: bytes, says: str
) -> None:
    """A scripted "proxy" (not tinyproxy: these are the answers a broken one gives)."""
    heard: list[bytes] = []
    writers: list[asyncio.StreamWriter] = []

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        heard.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(answer)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
            if answer:
                await reader.read()  # hold the connection until the client gives up
        writer.close()

    server = await asyncio.start_server(proxy, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    wire = WireTransport(
        policy=AddressPolicy(LOOPBACK), proxy=f"http://u:{PASSWORD}@127.0.0.1:{port}"
    )
    try:
        async with DeliveryClient(transport=wire, proxy=wire.proxy) as client:
            result = await attempt(client, "https://127.0.0.1:9/hook")
    finally:
        server.close()
        for writer in writers:
            writer.transport.abort()
        await server.wait_closed()
        await asyncio.sleep(0)
    assert result.outcome is Outcome.RETRYABLE
    assert says in (result.error or ""), result.error
    assert PASSWORD not in (result.error or "")
    [request] = heard
    assert request.startswith(b"CONNECT 127.0.0.1:9 HTTP/1.1\r\nHost: 127.0.0.1:9\r\n")
    assert b"Proxy-Authorization: Basic " in request


# -- the CLI and the admin API -------------------------------------------------------------


def test_cli_sets_shows_and_removes_an_endpoints_proxy(database_url: str) -> None:
    key = generate_key("cli")
    env = {"OUTBOX_DATABASE_URL": database_url, "OUTBOX_SECRET_KEYS": key, "USER": "night"}
    runner = CliRunner()

    def outbox(*args: str) -> Any:
        result = runner.invoke(main, [*args, "--json"], env=env, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        assert PASSWORD not in result.output
        return json.loads(result.output)

    url = f"http://outbox:{PASSWORD}@proxy.internal:3128"
    added = outbox("endpoints", "add", "https://partner.example/h", "--events", "*", "--proxy", url)
    assert added["proxy"] == "proxy.internal:3128"
    moved = outbox("endpoints", "update", added["id"], "--proxy", "http://10.1.2.3:8080")
    assert moved["proxy"] == "10.1.2.3:8080"
    assert outbox("endpoints", "update", added["id"], "--no-proxy")["proxy"] is None
    [listed] = outbox("endpoints", "list")
    assert listed["proxy"] is None

    bad = runner.invoke(
        main,
        ["endpoints", "update", added["id"], "--proxy", f"socks5://u:{PASSWORD}@h:1"],
        env=env,
    )
    assert bad.exit_code != 0
    assert "must start with http://" in bad.output
    assert PASSWORD not in bad.output
    refused = runner.invoke(
        main,
        ["endpoints", "add", "https://other.example/h", "--events", "*", "--proxy", "http://p"],
        env=env,
    )
    assert refused.exit_code != 0 and "needs the proxy's port" in refused.output
    assert [e["url"] for e in outbox("endpoints", "list")] == ["https://partner.example/h"]


async def test_admin_api_sets_and_clears_a_proxy_within_the_callers_tenant(
    engine: Engine, async_engine: AsyncEngine, box: SecretBox, clock: ManualClock
) -> None:
    from outbox.tenants import create_tenant

    with engine.begin() as conn:
        create_tenant(conn, "seller-a")
        create_tenant(conn, "seller-b")
        _, root = create_token(conn, name="root", role="operator", actor="test")
        _, scoped = create_token(conn, name="a", role="operator", actor="test", tenant="seller-a")
    b_uid = add_endpoint(engine, box, "https://b.example/h", tenant="seller-b").endpoint.uid
    app = create_app(async_engine, box, clock=clock)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://admin"
    ) as api:
        made = await api.post(
            "/v1/endpoints",
            json={
                "url": "https://partner.example/h",
                "event_types": ["*"],
                "proxy": f"http://outbox:{PASSWORD}@127.0.0.1:3128",
            },
            headers={"authorization": f"Bearer {root}"},
        )
        assert made.status_code == 200, made.text
        assert made.json()["proxy"] == "127.0.0.1:3128"
        uid = made.json()["id"]
        cleared = await api.patch(
            f"/v1/endpoints/{uid}",
            json={"proxy": None, "reason": "direct again"},
            headers={"authorization": f"Bearer {root}"},
        )
        assert cleared.status_code == 200 and cleared.json()["proxy"] is None
        junk = await api.patch(
            f"/v1/endpoints/{uid}",
            json={"proxy": f"http://u:{PASSWORD}@h"},
            headers={"authorization": f"Bearer {root}"},
        )
        assert junk.status_code == 400 and "port" in junk.json()["error"]
        assert PASSWORD not in junk.text
        other = await api.patch(
            f"/v1/endpoints/{b_uid}",
            json={"proxy": "http://127.0.0.1:3128"},
            headers={"authorization": f"Bearer {scoped}"},
        )
        assert other.status_code == 404
        assert PASSWORD not in made.text
    assert scalar(engine, "SELECT proxy_host FROM endpoints WHERE uid = :u", u=b_uid) is None


# -- the setting and the URL rules -------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("https://proxy:3128", "must start with http://"),
        ("socks5://proxy:1080", "must start with http://"),
        (f"http://u:{PASSWORD}@proxy", "needs the proxy's port"),
        ("http://proxy:0", "needs the proxy's port"),
        ("http://proxy:99999", "invalid port"),
        ("http://proxy:3128/path", "without a path"),
        ("http://proxy:3128?x=1", "without a path"),
        ("http://:3128", "no host"),
        ("http://pro xy:3128", "whitespace"),
        ("http://u%0d%0aX-Injected:1:p@proxy:3128", "line break"),
        ("http://" + "a" * 3000 + ":1", "over 2048"),
        ("http://[fe80::1%25eth0]:3128", "zone"),
    ],
)
def test_hostile_proxy_urls_are_refused_without_echoing_them(value: str, message: str) -> None:
    with pytest.raises(InvalidEndpointURLError, match=message) as refused:
        parse_proxy_url(value)
    assert PASSWORD not in str(refused.value)


def test_the_setting_is_validated_kept_secret_and_needs_the_wire(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OUTBOX_HTTP_PROXY", f"http://u:{PASSWORD}@proxy")
    with pytest.raises(ConfigurationError, match=r"OUTBOX_HTTP_PROXY: .*port") as bad:
        load_settings()
    assert PASSWORD not in str(bad.value)
    monkeypatch.setenv("OUTBOX_HTTP_PROXY", f"http://u:{PASSWORD}@proxy:3128")
    settings = load_settings()
    assert settings.http_proxy is not None
    assert PASSWORD not in repr(settings) and PASSWORD not in str(settings.model_dump())
    monkeypatch.setenv("OUTBOX_HTTP_TRANSPORT", "httpx")
    with pytest.raises(ConfigurationError, match="needs OUTBOX_HTTP_TRANSPORT=wire"):
        load_settings()
    client = build_http_client(max_connections=1, timeout=1, proxy=f"http://u:{PASSWORD}@p:1")
    assert isinstance(client, DeliveryClient) and client.proxy == "p:1"


def test_key_rotation_re_encrypts_the_proxy_and_start_up_checks_its_key(engine: Engine) -> None:
    from outbox.endpoints import check_keys_cover_stored_secrets, decrypt_proxy, reencrypt_secrets
    from outbox.errors import SecretKeyError

    old, new = generate_key("old"), generate_key("new")
    url = f"http://outbox:{PASSWORD}@127.0.0.1:3128"
    new_only = SecretBox.from_setting(new)
    uid = add_endpoint(engine, new_only, "https://partner.example/h").endpoint.uid
    with engine.begin() as conn:
        # The proxy is the only secret under the old key: start-up must still notice.
        set_proxy(conn, SecretBox.from_setting(old), uid, url, actor="t")
    with engine.begin() as conn, pytest.raises(SecretKeyError, match="'old'"):
        check_keys_cover_stored_secrets(conn, new_only)
    with engine.begin() as conn:
        reencrypt_secrets(conn, SecretBox.from_setting(f"{new},{old}"), actor="t")
    stored = scalar(engine, "SELECT proxy_url FROM endpoints")
    assert stored.startswith("v1:new:") and PASSWORD not in stored
    assert decrypt_proxy(new_only, uid, stored) == url
    with engine.begin() as conn:
        check_keys_cover_stored_secrets(conn, new_only)


@pytest.mark.slow  # a real `outbox run`
async def test_outbox_run_sends_through_OUTBOX_HTTP_PROXY_in_every_process(
    engine: Engine, database_url: str, receiver: Receiver, tinyproxy: StartProxy
) -> None:
    """The setting reaches the wire of each supervised process, and nothing it prints
    (at DEBUG) carries the proxy's password."""
    import signal
    import sys

    proxy = tinyproxy(user="outbox", password=PASSWORD)
    key = generate_key("run")
    created = add_endpoint(engine, SecretBox.from_setting(key), receiver.route("/run"))
    with engine.begin() as conn:
        for i in range(6):
            publish(conn, "order.created", {"i": i})
    env = {
        **os.environ,
        "OUTBOX_DATABASE_URL": database_url,
        "OUTBOX_SECRET_KEYS": key,
        "OUTBOX_ALLOWED_NETWORKS": "127.0.0.0/8",
        "OUTBOX_HTTP_PROXY": proxy.url(),
        "OUTBOX_PROCESSES": "2",
        "OUTBOX_LOG_LEVEL": "DEBUG",
        "OUTBOX_WORKER_POLL_INTERVAL": "0.1",
        "OUTBOX_RELAY_POLL_INTERVAL": "0.1",
    }
    run = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "from delivery.operator.cli import main; main()", "run",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        async with asyncio.timeout(60):
            while scalar(engine, "SELECT count(*) FROM deliveries WHERE state = 'succeeded'") < 6:
                await asyncio.sleep(0.1)
    finally:
        run.send_signal(signal.SIGTERM)
        stdout, stderr = await asyncio.wait_for(run.communicate(), timeout=30)
    assert run.returncode == 0, stderr.decode()
    assert len(receiver.received("/run")) == 6
    for request in receiver.received("/run"):
        Webhook(created.secret).verify(request.body, request.headers)
    assert proxy.requests() == [f"POST http://127.0.0.1:{receiver.port}/run HTTP/1.1"] * 6
    printed = (stdout + stderr).decode()
    assert PASSWORD not in printed and "outbox:" not in printed
