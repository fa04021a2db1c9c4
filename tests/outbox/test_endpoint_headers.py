"""Custom endpoint headers: sent, stored encrypted, never logged, never over our own."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine
from standardwebhooks import Webhook

from delivery.http import build_http_client
from delivery.operator.cli import main
from delivery.receiver import Receiver
from delivery.worker import Worker
from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox, generate_key
from outbox.errors import EndpointError
from outbox.headers import get_headers, set_headers
from outbox.relay import Relay
from tests.helpers import LOOPBACK, add_endpoint, rows, scalar

TOKEN = "Bearer partner-token-7f3a9c"


async def test_custom_headers_are_sent_but_never_stored_or_recorded_in_plaintext(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    created = add_endpoint(engine, box, receiver.route("/auth"))
    uid = created.endpoint.uid
    with engine.begin() as conn:
        set_headers(conn, box, uid, {"Authorization": TOKEN, "X-Tenant": "acme"}, actor="t")
        publish(conn, "order.created", {"id": 1})
    async with build_http_client(max_connections=5, timeout=5, allowed_networks=LOOPBACK) as http:
        await Relay(async_engine, clock).run_until_idle()
        stats = await Worker(async_engine, http, box, clock).run_once()
    assert stats.succeeded == 1
    [request] = receiver.requests
    assert request.headers["authorization"] == TOKEN
    assert request.headers["x-tenant"] == "acme"
    Webhook(created.secret).verify(request.body, request.headers)

    stored = scalar(engine, "SELECT custom_headers FROM endpoints")
    assert TOKEN not in stored and "partner-token" not in stored
    attempt = rows(engine, "SELECT request_headers FROM delivery_attempts")[0]
    assert attempt["request_headers"]["authorization"] == "[redacted]"
    assert "partner-token" not in json.dumps(attempt["request_headers"])
    audit = rows(engine, "SELECT details FROM audit_log WHERE action = 'endpoint.headers'")
    assert audit[0]["details"] == {"names": ["authorization", "x-tenant"]}


async def test_each_attempt_row_records_its_own_endpoints_header_names(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    """Two endpoints with different custom headers, two events, one batch: each attempt
    row names its own endpoint's headers (redacted) and its own delivery's webhook-id.
    The worker works out an endpoint's parts once per batch and writes the batch's rows
    in one document: neither may hand one row's headers to another."""
    names: dict[str, str] = {}
    for name in ("a", "b"):
        uid = add_endpoint(engine, box, receiver.route(f"/{name}")).endpoint.uid
        with engine.begin() as conn:
            set_headers(conn, box, uid, {f"X-Only-{name}": f"secret-{name}"}, actor="t")
        names[uid] = name
    with engine.begin() as conn:
        messages = [publish(conn, "order.created", {"id": n}) for n in (1, 2)]
    async with build_http_client(max_connections=5, timeout=5, allowed_networks=LOOPBACK) as http:
        await Relay(async_engine, clock).run_until_idle()
        stats = await Worker(async_engine, http, box, clock).run_once()
    assert stats.succeeded == 4
    attempts = rows(
        engine,
        """SELECT e.uid, ev.message_id, a.request_headers FROM delivery_attempts a
           JOIN deliveries d ON d.id = a.delivery_id JOIN endpoints e ON e.id = d.endpoint_id
           JOIN outbox_events ev ON ev.id = d.event_id""",
    )
    assert sorted((names[a["uid"]], a["message_id"]) for a in attempts) == sorted(
        (name, message) for name in "ab" for message in messages
    )
    for attempt in attempts:
        name, other = names[attempt["uid"]], "b" if names[attempt["uid"]] == "a" else "a"
        headers = attempt["request_headers"]
        assert headers[f"x-only-{name}"] == "[redacted]"
        assert f"x-only-{other}" not in headers
        assert headers["webhook-id"] == attempt["message_id"]
        assert "secret-" not in json.dumps(headers)


@pytest.mark.parametrize(
    "name",
    [
        "webhook-signature",
        "Webhook-Id",
        "Host",
        "Content-Type",
        "Transfer-Encoding",
        "Connection",
        "Content-Length",
        "webhook-anything",
    ],
)
def test_reserved_headers_cannot_be_set(engine: Engine, box: SecretBox, name: str) -> None:
    uid = add_endpoint(engine, box, "https://partner.example/h").endpoint.uid
    with engine.begin() as conn, pytest.raises(EndpointError, match="sender owns it"):
        set_headers(conn, box, uid, {name: "x"}, actor="t")
    assert scalar(engine, "SELECT custom_headers FROM endpoints") is None


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("X-Bad", "one\r\nInjected: yes", "one line"),
        ("Bad Name", "x", "not a valid header name"),
        ("X-Long", "x" * 5000, "one line"),
    ],
)
def test_malformed_headers_are_refused(
    engine: Engine, box: SecretBox, name: str, value: str, message: str
) -> None:
    uid = add_endpoint(engine, box, "https://partner.example/h").endpoint.uid
    with engine.begin() as conn, pytest.raises(EndpointError, match=message):
        set_headers(conn, box, uid, {name: value}, actor="t")


def test_cli_shows_names_only_and_key_rotation_keeps_headers(
    engine: Engine, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, new = generate_key("old"), generate_key("new")
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    monkeypatch.setenv("OUTBOX_SECRET_KEYS", old)
    cli = CliRunner()
    added = json.loads(
        cli.invoke(
            main, ["endpoints", "add", "https://p.example/h", "--events", "*", "--json"]
        ).output
    )
    uid = added["id"]
    result = cli.invoke(
        main, ["endpoints", "headers", uid, "--set", f"Authorization: {TOKEN}", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == {"id": uid, "headers": ["authorization"]}
    assert "partner-token" not in cli.invoke(main, ["endpoints", "headers", uid]).output
    refused = cli.invoke(main, ["endpoints", "headers", uid, "--set", "Host: evil.example"])
    assert refused.exit_code == 1 and "sender owns it" in refused.output

    monkeypatch.setenv("OUTBOX_SECRET_KEYS", f"{new},{old}")
    assert cli.invoke(main, ["keys", "rotate"]).exit_code == 0
    assert scalar(engine, "SELECT custom_headers FROM endpoints").startswith("v1:new:")
    with engine.connect() as conn:
        assert get_headers(conn, SecretBox.from_setting(new), uid) == {"authorization": TOKEN}

    cleared = cli.invoke(main, ["endpoints", "headers", uid, "--clear", "--json"])
    assert json.loads(cleared.output)["headers"] == []
