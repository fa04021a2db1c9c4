"""Authenticated delivery (issue 25, item 4): mutual TLS and OAuth2 client credentials,
against real parts on 127.0.0.1 — a TLS receiver that requires a client certificate from
its own test CA, and a token endpoint issuing tokens with `expires_in`."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import json
import ssl
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.http import DeliveryClient, OutgoingRequest, build_http_client, send_attempt
from delivery.oauth import TokenError, parse_token_response
from delivery.policy import Outcome
from delivery.receiver import Behaviour, Receiver
from delivery.ssrf import AddressPolicy
from delivery.wire import WireTransport
from delivery.worker import Worker
from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.endpoint_auth import (
    OAuthClient,
    check_client_certificate,
    check_oauth_client,
    set_endpoint_auth,
)
from outbox.errors import EndpointError
from outbox.relay import Relay
from tests.delivery.pki import NOW, Authority, identity, mtls_server_context, trusting
from tests.helpers import LOOPBACK, add_endpoint, rows

CLIENT_SECRET = "oauth-client-s3cret"


# -- real servers on 127.0.0.1 --------------------------------------------------------------


@dataclass
class Seen:
    target: str
    headers: dict[str, str]
    body: bytes
    peer: str | None  # the client certificate's common name, if one was presented


Answer = Callable[[Seen], tuple[int, bytes]]


@dataclass
class Server:
    """A keep-alive HTTP/1.1 server (plain or TLS): records requests, answers via `answer`."""

    answer: Answer
    seen: list[Seen] = field(default_factory=list)
    connections: int = 0
    port: int = 0

    def url(self, path: str, *, tls: bool) -> str:
        return f"{'https' if tls else 'http'}://127.0.0.1:{self.port}{path}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        peer = writer.get_extra_info("peercert")
        name = None
        if peer:
            name = dict(pair[0] for pair in peer["subject"]).get("commonName")
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line, *lines = head.decode("latin-1").split("\r\n")
                headers = {}
                for item in lines:
                    if item:
                        key, _, value = item.partition(":")
                        headers[key.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                seen = Seen(line.split(" ")[1], headers, body, name)
                self.seen.append(seen)
                status, content = self.answer(seen)
                writer.write(
                    f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(content)}\r\n\r\n".encode()
                    + content
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                await writer.wait_closed()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Any]]:
    servers: list[asyncio.Server] = []

    async def start(answer: Answer, tls: ssl.SSLContext | None = None) -> Server:
        server = Server(answer)
        running = await asyncio.start_server(server.handle, "127.0.0.1", 0, ssl=tls)
        server.port = running.sockets[0].getsockname()[1]
        servers.append(running)
        return server

    yield start
    for running in servers:
        running.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(running.wait_closed(), 5)


def ok(_: Seen) -> tuple[int, bytes]:
    return 200, b"ok"


def outgoing(url: str, timeout: float = 5.0, **kw: Any) -> OutgoingRequest:
    return OutgoingRequest(
        delivery_id=1, url=url, message_id="msg_1", body=b'{"a":1}', keys=[b"k" * 32],
        timeout=timeout, **kw,
    )  # fmt: skip


@pytest.fixture
def pki() -> tuple[Authority, Authority, Authority]:
    """(the server's CA, the CA the receiver trusts for clients, another CA)."""
    return Authority("server CA"), Authority("partner client CA"), Authority("rogue CA")


def wire_client(server_ca: Authority) -> DeliveryClient:
    wire = WireTransport(policy=AddressPolicy(LOOPBACK), tls_factory=trusting(server_ca))
    return DeliveryClient(transport=wire, proxy=None)


# -- mutual TLS ----------------------------------------------------------------------------


async def test_mtls_delivery_arrives_with_the_right_certificate_and_fails_clearly_without(
    serve: Callable[..., Any], tmp_path: Path, pki: tuple[Authority, Authority, Authority]
) -> None:
    server_ca, client_ca, rogue = pki
    receiver = await serve(ok, mtls_server_context(tmp_path, server_ca, client_ca))
    url = receiver.url("/hook", tls=True)
    async with wire_client(server_ca) as client:
        right = await send_attempt(
            client, outgoing(url, client_certificate=identity(client_ca, "endpoint-a")),
            ManualClock(NOW),
        )  # fmt: skip
        assert right.outcome is Outcome.SUCCEEDED, right.error
        assert [s.peer for s in receiver.seen] == ["endpoint-a"]

        without = await send_attempt(client, outgoing(url), ManualClock(NOW))
        other_ca = await send_attempt(
            client,
            outgoing(url, client_certificate=identity(rogue, "endpoint-r")),
            ManualClock(NOW),
        )
        clock = ManualClock(NOW + dt.timedelta(hours=7))  # past endpoint-a's expiry
        expired = await send_attempt(
            client, outgoing(url, client_certificate=identity(client_ca, "endpoint-a")), clock
        )
    assert expired.outcome is Outcome.RETRYABLE
    assert "client certificate expired at" in (expired.error or "")
    for failed in (without, other_ca):
        assert failed.outcome is not Outcome.SUCCEEDED
        assert failed.status_code is None
        assert "certificate" in (failed.error or "").lower(), failed.error
    assert [s.peer for s in receiver.seen] == ["endpoint-a"]


async def test_a_pooled_connection_is_never_reused_for_another_endpoints_certificate(
    serve: Callable[..., Any],
    tmp_path: Path,
    pki: tuple[Authority, Authority, Authority],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server_ca, client_ca, _ = pki
    receiver = await serve(ok, mtls_server_context(tmp_path, server_ca, client_ca))
    url = receiver.url("/hook", tls=True)
    a, b = identity(client_ca, "endpoint-a"), identity(client_ca, "endpoint-b")
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    async with wire_client(server_ca) as client:
        for who in (a, a, b, a, None):
            await send_attempt(client, outgoing(url, client_certificate=who), ManualClock(NOW))
    # Keep-alive: A's second request reused A's connection; B got its own, and a request
    # with no certificate never rode on A's (it failed instead of arriving as A).
    assert [s.peer for s in receiver.seen] == [
        "endpoint-a",
        "endpoint-a",
        "endpoint-b",
        "endpoint-a",
    ]
    # Two handshakes completed (A's and B's); the one without a certificate was refused.
    assert receiver.connections == 2
    assert list(temporary.iterdir()) == []  # the PEM files were removed once loaded


@pytest.mark.parametrize(
    ("certificate", "key", "says"),
    [
        (b"\x30\x82\x01\x0a" + bytes(300), None, "not PEM"),
        ("hello, not a certificate", None, "not PEM"),
        ("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n", None, "not a PEM X.509"),
        ("-----BEGIN CERTIFICATE-----\n" + "A" * 70_000, None, "the limit is 65536"),
        (
            None,
            "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
            "not an unencrypted PEM",
        ),
        (None, "other", "does not match"),
        ("expired", None, "expired at"),
    ],
)
def test_a_bad_certificate_or_key_is_refused_when_set(
    certificate: str | bytes | None, key: str | None, says: str
) -> None:
    ca = Authority("partner client CA")
    good_cert, good_key = ca.issue("endpoint-a")
    if certificate == "expired":
        certificate, key = ca.issue("old", expires=NOW - dt.timedelta(days=1))
    if key == "other":
        key = ca.issue("endpoint-b")[1]
    with pytest.raises(EndpointError, match=says) as caught:
        check_client_certificate(certificate or good_cert, key or good_key, now=NOW)
    assert "PRIVATE KEY-----" not in str(caught.value)


# -- OAuth2 client credentials --------------------------------------------------------------


@dataclass
class TokenEndpoint:
    """Issues tok1, tok2, ... with `expires_in`, after checking HTTP Basic client auth."""

    expires_in: int = 120
    issued: list[str] = field(default_factory=list)
    failure: tuple[int, bytes] | None = None

    def __call__(self, seen: Seen) -> tuple[int, bytes]:
        if self.failure is not None:
            return self.failure
        basic = base64.b64encode(f"partner-app:{CLIENT_SECRET}".encode()).decode()
        form = dict(pair.split("=", 1) for pair in seen.body.decode().split("&"))
        if seen.headers.get("authorization") != f"Basic {basic}":
            return 401, b'{"error": "invalid_client"}'
        if form.get("grant_type") != "client_credentials" or form.get("scope") != "webhooks":
            return 400, b'{"error": "invalid_request"}'
        self.issued.append(f"tok{len(self.issued) + 1}")
        body = {"access_token": self.issued[-1], "token_type": "Bearer"}
        return 200, json.dumps({**body, "expires_in": self.expires_in}).encode()


@dataclass
class BearerReceiver:
    valid: set[str]

    def __call__(self, seen: Seen) -> tuple[int, bytes]:
        token = seen.headers.get("authorization", "").removeprefix("Bearer ")
        return (200, b"ok") if token in self.valid else (401, b"no")


def oauth(token_url: str, secret: str = CLIENT_SECRET) -> OAuthClient:
    return check_oauth_client(token_url, "partner-app", secret, "webhooks")[0]


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with build_http_client(
        max_connections=10, timeout=5, allowed_networks=LOOPBACK
    ) as client:
        yield client


async def test_bearer_token_is_cached_refreshed_before_expiry_and_once_on_401(
    serve: Callable[..., Any], http: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG")
    issuer = TokenEndpoint(expires_in=120)
    tokens = await serve(issuer)
    bearer = BearerReceiver(set())
    receiver = await serve(
        lambda seen: bearer(seen) if (bearer.valid.update(issuer.issued) or True) else (0, b"")
    )
    clock = ManualClock(NOW)
    request = outgoing(
        receiver.url("/hook", tls=False), oauth=oauth(tokens.url("/token", tls=False))
    )
    first = await send_attempt(http, request, clock)
    second = await send_attempt(http, request, clock)
    assert (first.outcome, second.outcome) == (Outcome.SUCCEEDED, Outcome.SUCCEEDED)
    assert issuer.issued == ["tok1"]  # cached across deliveries
    clock.advance(89)
    await send_attempt(http, request, clock)
    assert issuer.issued == ["tok1"]
    clock.advance(2)  # within 30 s of expiry: refreshed
    await send_attempt(http, request, clock)
    assert issuer.issued == ["tok1", "tok2"]
    assert [s.headers["authorization"] for s in receiver.seen] == ["Bearer tok1"] * 3 + [
        "Bearer tok2"
    ]

    # The receiver revokes tok2: its 401 refreshes the token once and retries once.
    receiver.answer = BearerReceiver({"tok3"})
    revoked = await send_attempt(http, request, clock)
    assert revoked.outcome is Outcome.SUCCEEDED, revoked.error
    assert issuer.issued == ["tok1", "tok2", "tok3"]
    assert [s.headers["authorization"] for s in receiver.seen[-2:]] == [
        "Bearer tok2",
        "Bearer tok3",
    ]
    # A fresh token refused again is the receiver's answer: no loop.
    receiver.answer = BearerReceiver(set())
    refused = await send_attempt(http, request, clock)
    assert refused.status_code == 401 and issuer.issued == ["tok1", "tok2", "tok3", "tok4"]
    assert refused.request_headers["authorization"] == "[redacted]"
    for text in (caplog.text, json.dumps([str(first), str(refused), str(request)])):
        assert CLIENT_SECRET not in text
        assert "tok4" not in text and "tok1" not in text


@pytest.mark.parametrize(
    ("failure", "outcome", "says"),
    [
        ((500, b"oops"), Outcome.RETRYABLE, "answered HTTP 500"),
        ((401, b'{"error": "invalid_client"}'), Outcome.RETRYABLE, "HTTP 401 (invalid_client)"),
        ((200, b"<html>"), Outcome.RETRYABLE, "not JSON"),
        ((200, b'{"token_type": "Bearer"}'), Outcome.RETRYABLE, "without an access_token"),
        (
            (200, b'{"access_token": "' + b"x" * 200_000 + b'"}'),
            Outcome.RETRYABLE,
            "more than 65536 bytes",
        ),
    ],
)
async def test_a_failing_token_endpoint_is_a_clear_error_on_the_attempt(
    serve: Callable[..., Any],
    http: httpx.AsyncClient,
    failure: tuple[int, bytes],
    outcome: Outcome,
    says: str,
) -> None:
    tokens = await serve(TokenEndpoint(failure=failure))
    receiver = await serve(ok)
    request = outgoing(
        receiver.url("/hook", tls=False), oauth=oauth(tokens.url("/token", tls=False))
    )
    result = await send_attempt(http, request, ManualClock(NOW))
    assert result.outcome is outcome
    assert says in (result.error or ""), result.error
    assert "no OAuth access token" in (result.error or "")
    assert CLIENT_SECRET not in (result.error or "")
    assert receiver.seen == []


async def test_an_unreachable_token_endpoint_is_retryable(
    serve: Callable[..., Any], http: httpx.AsyncClient
) -> None:
    receiver = await serve(ok)
    request = outgoing(receiver.url("/hook", tls=False), oauth=oauth("http://127.0.0.1:9/token"))
    result = await send_attempt(http, request, ManualClock(NOW))
    assert result.outcome is Outcome.RETRYABLE
    assert "unreachable" in (result.error or ""), result.error
    assert receiver.seen == []


async def test_the_token_and_the_post_share_the_attempts_one_deadline(
    receiver: Receiver, http: httpx.AsyncClient
) -> None:
    """An attempt's timeout covers its token fetch too: a slow token endpoint leaves the
    POST only what is left (else an attempt could take several timeouts and outlive its
    lease), and one that hangs is cut at the deadline with a clear, retryable error."""
    token = json.dumps({"access_token": "tok-slow", "expires_in": 300}).encode()
    # The delays are the scenario: a slow token endpoint and partner, a hanging one.
    slow_token = receiver.route("/slow-token", Behaviour(body=token, delay=0.3))
    hanging = receiver.route("/hanging-token", Behaviour(body=token, delay=5))
    slow_hook = receiver.route("/slow-hook", Behaviour(delay=0.3))
    late = await send_attempt(
        http, outgoing(slow_hook, oauth=oauth(slow_token), timeout=0.45), ManualClock(NOW)
    )
    assert late.outcome is Outcome.AMBIGUOUS, late.error  # sent, cut before its answer
    assert "passed waiting for the response" in (late.error or ""), late.error
    cut = await send_attempt(
        http, outgoing(slow_hook, oauth=oauth(hanging), timeout=0.2), ManualClock(NOW)
    )
    assert cut.outcome is Outcome.RETRYABLE
    assert "no OAuth access token:" in (cut.error or "") and "0.2s" in (cut.error or ""), cut.error
    assert len(receiver.received("/slow-hook")) == 1  # the hanging token sent nothing


async def test_the_ssrf_guard_applies_to_the_token_url(serve: Callable[..., Any]) -> None:
    issuer = TokenEndpoint()
    tokens = await serve(issuer)
    request = outgoing("https://partner.example/hook", oauth=oauth(tokens.url("/token", tls=False)))
    async with build_http_client(max_connections=2, timeout=5) as guarded:
        result = await send_attempt(guarded, request, ManualClock(NOW))
    assert result.outcome is Outcome.PERMANENT
    assert "is refused" in (result.error or "") and "127.0.0.1" in (result.error or "")
    assert tokens.seen == []


async def test_a_redirecting_token_endpoint_is_not_followed(
    serve: Callable[..., Any], http: httpx.AsyncClient
) -> None:
    tokens = await serve(TokenEndpoint(failure=(302, b"")))
    receiver = await serve(ok)
    request = outgoing(
        receiver.url("/hook", tls=False), oauth=oauth(tokens.url("/token", tls=False))
    )
    result = await send_attempt(http, request, ManualClock(NOW))
    assert "HTTP 302" in (result.error or "") and len(tokens.seen) == 1


# -- through the worker, end to end ---------------------------------------------------------


async def test_worker_delivers_with_mtls_and_oauth_and_keeps_secrets_out_of_rows(
    engine: Engine,
    async_engine: AsyncEngine,
    box: SecretBox,
    serve: Callable[..., Any],
    tmp_path: Path,
    pki: tuple[Authority, Authority, Authority],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("DEBUG")
    server_ca, client_ca, _ = pki
    (tmp_path / "ca.pem").write_text(server_ca.pem)
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))  # the worker's trust store
    issuer = TokenEndpoint()
    tokens = await serve(issuer)
    receiver = await serve(
        lambda seen: BearerReceiver(set(issuer.issued))(seen),
        mtls_server_context(tmp_path, server_ca, client_ca),
    )
    cert, key = client_ca.issue("endpoint-a")
    endpoint = add_endpoint(engine, box, receiver.url("/hook", tls=True), "order.*")
    checked, summary = check_client_certificate(cert, key, now=NOW)
    client, shown = check_oauth_client(
        tokens.url("/token", tls=False), "partner-app", CLIENT_SECRET, "webhooks"
    )
    clock = ManualClock(NOW)
    with engine.begin() as conn:
        auth = set_endpoint_auth(
            conn, box, endpoint.endpoint.uid, client_certificate=checked,
            certificate_summary=summary, oauth=client, oauth_summary=shown, actor="t",
        )  # fmt: skip
        publish(conn, "order.created", {"id": 1})
        publish(conn, "order.created", {"id": 2})
    assert auth.client_certificate is not None
    assert auth.client_certificate["subject"] == "CN=endpoint-a"
    async with build_http_client(max_connections=5, timeout=5, allowed_networks=LOOPBACK) as http:
        await Relay(async_engine, clock).run_until_idle()
        stats = await Worker(async_engine, http, box, clock).run_once()
    assert stats.succeeded == 2
    assert [s.peer for s in receiver.seen] == ["endpoint-a", "endpoint-a"]
    assert issuer.issued == ["tok1"]
    stored = json.dumps(
        [
            rows(engine, f"SELECT * FROM {t}")
            for t in ("endpoints", "delivery_attempts", "audit_log")
        ],
        default=str,
    )
    pem_body = key.splitlines()[1]
    for where, text in (("database", stored), ("logs", caplog.text)):
        assert CLIENT_SECRET not in text, where
        assert pem_body not in text, where
        assert "tok1" not in text, where
    [audit] = rows(engine, "SELECT details FROM audit_log WHERE action = 'endpoint.auth'")
    assert audit["details"]["oauth"]["client_id"] == "partner-app"
    assert audit["details"]["client_certificate"]["subject"] == "CN=endpoint-a"


async def test_a_refused_certificate_and_a_failing_token_endpoint_are_clear_errors_on_the_delivery(
    engine: Engine,
    async_engine: AsyncEngine,
    box: SecretBox,
    serve: Callable[..., Any],
    tmp_path: Path,
    pki: tuple[Authority, Authority, Authority],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through the worker: a certificate the receiver does not trust and a token endpoint
    that refuses the client end the attempt, not the worker; each delivery waits for its
    retry with an error that says what to fix (and the attempt row says it too)."""
    server_ca, client_ca, rogue = pki
    (tmp_path / "ca.pem").write_text(server_ca.pem)
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))
    mtls = await serve(ok, mtls_server_context(tmp_path, server_ca, client_ca))
    plain = await serve(ok)
    tokens = await serve(TokenEndpoint(failure=(401, b'{"error": "invalid_client"}')))
    untrusted = add_endpoint(engine, box, mtls.url("/hook", tls=True), "order.*").endpoint.uid
    refused = add_endpoint(engine, box, plain.url("/hook", tls=False), "order.*").endpoint.uid
    checked, summary = check_client_certificate(*rogue.issue("endpoint-r"), now=NOW)
    client, shown = check_oauth_client(
        tokens.url("/token", tls=False), "partner-app", CLIENT_SECRET, "webhooks"
    )
    clock = ManualClock(NOW)
    with engine.begin() as conn:
        set_endpoint_auth(
            conn, box, untrusted, client_certificate=checked, certificate_summary=summary,
            actor="t",
        )  # fmt: skip
        set_endpoint_auth(conn, box, refused, oauth=client, oauth_summary=shown, actor="t")
        publish(conn, "order.created", {"id": 1})
    async with build_http_client(max_connections=5, timeout=5, allowed_networks=LOOPBACK) as http:
        await Relay(async_engine, clock).run_until_idle()
        stats = await Worker(async_engine, http, box, clock).run_once()
    assert stats.succeeded == 0 and stats.claimed == 2
    found = {
        r["uid"]: r
        for r in rows(
            engine,
            "SELECT e.uid, d.state, d.last_error, a.error AS attempt_error FROM deliveries d "
            "JOIN endpoints e ON e.id = d.endpoint_id "
            "JOIN delivery_attempts a ON a.delivery_id = d.id",
        )
    }
    assert {uid: r["state"] for uid, r in found.items()} == {
        untrusted: "scheduled",
        refused: "scheduled",
    }
    certificate_error = found[untrusted]["last_error"]
    assert "client certificate" in certificate_error, certificate_error
    assert "issued by the CA the receiver trusts" in certificate_error, certificate_error
    token_error = found[refused]["last_error"]
    assert token_error.startswith("no OAuth access token: the OAuth token endpoint http://")
    assert "answered HTTP 401 (invalid_client)" in token_error
    assert "check the endpoint's OAuth client id and secret" in token_error
    for r in found.values():
        assert r["attempt_error"] == r["last_error"]
        assert CLIENT_SECRET not in r["last_error"]
    assert mtls.seen == [] and plain.seen == []


# -- the admin API and the CLI --------------------------------------------------------------


async def test_admin_api_sets_shows_and_clears_auth_within_the_callers_tenant(
    engine: Engine, async_engine: AsyncEngine, box: SecretBox, clock: ManualClock
) -> None:
    from delivery.operator.api import create_app
    from outbox.tenants import create_tenant
    from outbox.tokens import create_token

    with engine.begin() as conn:
        create_tenant(conn, "seller-a")
        create_tenant(conn, "seller-b")
        _, scoped = create_token(conn, name="a", role="operator", actor="test", tenant="seller-a")
    mine = add_endpoint(engine, box, "https://a.example/h", tenant="seller-a").endpoint.uid
    theirs = add_endpoint(engine, box, "https://b.example/h", tenant="seller-b").endpoint.uid
    cert, key = Authority("partner client CA").issue("endpoint-a")
    body = {
        "client_certificate": cert,
        "client_key": key,
        "oauth": {
            "token_url": "https://auth.partner.example/token",
            "client_id": "partner-app",
            "client_secret": CLIENT_SECRET,
            "scope": "webhooks",
        },
        "reason": "partner asked",
    }
    app = create_app(async_engine, box, clock=clock)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://admin",
        headers={"authorization": f"Bearer {scoped}"},
    ) as api:  # fmt: skip
        made = await api.patch(f"/v1/endpoints/{mine}/auth", json=body)
        assert made.status_code == 200, made.text
        shown = await api.patch(f"/v1/endpoints/{mine}/auth", json={})
        other = await api.patch(f"/v1/endpoints/{theirs}/auth", json=body)
        bad = await api.patch(
            f"/v1/endpoints/{mine}/auth",
            json={"client_certificate": "not a certificate", "client_key": key},
        )
        cleared = await api.patch(f"/v1/endpoints/{mine}/auth", json={"oauth": None})
    assert made.json() == shown.json()
    assert made.json()["client_certificate"]["subject"] == "CN=endpoint-a"
    assert made.json()["oauth"] == {
        "token_url": "https://auth.partner.example/token",
        "client_id": "partner-app",
        "scope": "webhooks",
    }
    assert other.status_code == 404
    assert bad.status_code == 400 and "not PEM" in bad.json()["error"]
    assert cleared.json()["oauth"] is None and cleared.json()["client_certificate"] is not None
    for answer in (made, shown, other, bad, cleared):
        assert CLIENT_SECRET not in answer.text and "PRIVATE KEY" not in answer.text
    stored = json.dumps(rows(engine, "SELECT * FROM endpoints"), default=str)
    assert CLIENT_SECRET not in stored and "PRIVATE KEY" not in stored
    audit = rows(engine, "SELECT target_id, reason FROM audit_log WHERE action = 'endpoint.auth'")
    assert [(a["target_id"], a["reason"]) for a in audit] == [
        (mine, "partner asked"),
        (mine, None),
    ]


def test_cli_set_auth_reads_files_and_never_prints_secrets(
    database_url: str, tmp_path: Path
) -> None:
    from click.testing import CliRunner

    from delivery.operator.cli import main
    from outbox.crypto import generate_key

    env = {
        "OUTBOX_DATABASE_URL": database_url,
        "OUTBOX_SECRET_KEYS": generate_key("cli"),
        "USER": "night",
    }
    runner = CliRunner()

    def outbox(*args: str, ok: bool = True) -> Any:
        result = runner.invoke(main, [*args], env=env, catch_exceptions=False)
        assert (result.exit_code == 0) is ok, result.output
        assert CLIENT_SECRET not in result.output and "PRIVATE KEY" not in result.output
        return json.loads(result.output) if ok and "--json" in args else result.output

    added = outbox("endpoints", "add", "https://partner.example/h", "--events", "*", "--json")
    cert, key = Authority("partner client CA").issue("endpoint-a")
    (tmp_path / "cert.pem").write_text(cert)
    (tmp_path / "key.pem").write_text(key)
    (tmp_path / "secret").write_text(CLIENT_SECRET + "\n")
    (tmp_path / "cert.der").write_bytes(b"\x30\x82" + bytes(500))
    (tmp_path / "huge.pem").write_bytes(b"-----BEGIN CERTIFICATE-----\n" + b"A" * 1_000_000)
    uid = added["id"]
    shown = outbox(
        "endpoints", "set-auth", uid, "--client-cert", str(tmp_path / "cert.pem"),
        "--client-key", str(tmp_path / "key.pem"),
        "--oauth-token-url", "https://auth.partner.example/token",
        "--oauth-client-id", "partner-app",
        "--oauth-client-secret-file", str(tmp_path / "secret"), "--json",
    )  # fmt: skip
    assert shown["client_certificate"]["subject"] == "CN=endpoint-a"
    assert shown["oauth"]["client_id"] == "partner-app"
    assert "CN=endpoint-a" in outbox("endpoints", "set-auth", uid)
    not_pem = outbox(
        "endpoints", "set-auth", uid, "--client-cert", str(tmp_path / "cert.der"),
        "--client-key", str(tmp_path / "key.pem"), ok=False,
    )  # fmt: skip
    assert "not PEM" in not_pem
    huge = outbox(
        "endpoints", "set-auth", uid, "--client-cert", str(tmp_path / "huge.pem"),
        "--client-key", str(tmp_path / "key.pem"), ok=False,
    )  # fmt: skip
    assert "over 65536 bytes" in huge
    cleared = outbox("endpoints", "set-auth", uid, "--clear", "--json")
    assert cleared == {"id": uid, "client_certificate": None, "oauth": None}


# -- the token answer, against the RFC 6749 rules --------------------------------------------

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["access_token", "expires_in", "token_type", "error"]),
        _JSON | st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E)),
    )
)
def test_token_answers_parse_as_the_rfc_says(answer: dict[str, Any]) -> None:
    token = answer.get("access_token")
    usable = isinstance(token, str) and token != "" and all(0x21 <= ord(c) <= 0x7E for c in token)
    expires = answer.get("expires_in", 60)
    if isinstance(expires, str) and expires.isascii() and expires.isdigit():
        expires = int(expires)
    valid_life = not isinstance(expires, bool) and isinstance(expires, (int, float)) and expires > 0
    body = json.dumps(answer).encode()
    if not usable:
        with pytest.raises(TokenError):
            parse_token_response(200, body, "it")
        return
    got, lifetime = parse_token_response(200, body, "it")
    assert got == token
    assert lifetime == (min(float(expires), 86_400.0) if valid_life else 60.0)


@settings(max_examples=300, deadline=None)
@given(st.integers(100, 599), st.binary(max_size=300))
def test_any_token_answer_is_a_token_or_a_token_error(status: int, body: bytes) -> None:
    try:
        token, lifetime = parse_token_response(status, body, "it")
    except TokenError as exc:
        assert str(exc).startswith("it ")
    else:
        assert status == 200 and token and 0 < lifetime <= 86_400


async def test_concurrent_attempts_share_one_token_fetch(
    serve: Callable[..., Any], http: httpx.AsyncClient
) -> None:
    issuer = TokenEndpoint()
    tokens = await serve(issuer)
    receiver = await serve(lambda seen: BearerReceiver(set(issuer.issued))(seen))
    request = outgoing(
        receiver.url("/hook", tls=False), oauth=oauth(tokens.url("/token", tls=False))
    )
    clock = ManualClock(NOW)
    results = await asyncio.gather(*(send_attempt(http, request, clock) for _ in range(8)))
    assert {r.outcome for r in results} == {Outcome.SUCCEEDED}
    assert issuer.issued == ["tok1"] and len(tokens.seen) == 1


@pytest.mark.parametrize(
    ("token_url", "client_id", "secret", "says"),
    [
        ("ftp://auth.example/token", "app", "s", "the OAuth token URL"),
        ("https://user:pw@auth.example/token", "app", "s", "the OAuth token URL"),
        ("https://auth.example/token", "", "s", "client id is empty"),
        ("https://auth.example/token", "app", "  ", "client secret is empty"),
        ("https://auth.example/token", "app\r\nx: y", "s", "without control characters"),
        ("https://auth.example/token", "app", "s" * 5000, "at most 2048"),
    ],
)
def test_hostile_oauth_settings_are_refused_when_set(
    token_url: str, client_id: str, secret: str, says: str
) -> None:
    with pytest.raises(EndpointError, match=says) as caught:
        check_oauth_client(token_url, client_id, secret, None)
    assert "s" * 50 not in str(caught.value)  # the secret is never echoed


def test_a_client_certificate_on_a_plain_http_endpoint_is_refused(
    engine: Engine, box: SecretBox
) -> None:
    plain = add_endpoint(engine, box, "http://partner.example/h").endpoint.uid
    checked, summary = check_client_certificate(
        *Authority("partner client CA").issue("endpoint-a"), now=NOW
    )
    with engine.begin() as conn, pytest.raises(EndpointError, match="over HTTPS only"):
        set_endpoint_auth(
            conn, box, plain, client_certificate=checked, certificate_summary=summary, actor="t"
        )
    assert rows(engine, "SELECT client_certificate FROM endpoints") == [
        {"client_certificate": None}
    ]


def test_key_rotation_reencrypts_the_certificate_and_oauth_client(engine: Engine) -> None:
    from outbox.crypto import generate_key, key_parts
    from outbox.endpoint_auth import decrypt_client_certificate, decrypt_oauth_client
    from outbox.endpoints import check_keys_cover_stored_secrets, reencrypt_secrets

    old = generate_key("old")
    box = SecretBox.from_setting(old)
    uid = add_endpoint(engine, box, "https://partner.example/h").endpoint.uid
    checked, summary = check_client_certificate(
        *Authority("partner client CA").issue("endpoint-a"), now=NOW
    )
    client, shown = check_oauth_client(
        "https://auth.example/token", "partner-app", CLIENT_SECRET, None
    )
    with engine.begin() as conn:
        set_endpoint_auth(
            conn, box, uid, client_certificate=checked, certificate_summary=summary,
            oauth=client, oauth_summary=shown, actor="t",
        )  # fmt: skip
    new = generate_key("new")
    with engine.begin() as conn:
        reencrypt_secrets(conn, SecretBox.from_setting(f"{new},{old}"), actor="t")
    only_new = SecretBox.from_setting(new)
    [row] = rows(engine, "SELECT client_certificate, oauth_client FROM endpoints")
    assert key_parts(row["client_certificate"])[1] == key_parts(row["oauth_client"])[1] == "new"
    assert decrypt_client_certificate(only_new, uid, row["client_certificate"]) == checked
    assert decrypt_oauth_client(only_new, uid, row["oauth_client"]) == client
    with engine.connect() as conn:
        check_keys_cover_stored_secrets(conn, only_new)
