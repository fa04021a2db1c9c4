"""Strict operator input: every case from issue 14's "Why" answers 400 (or 413), not 500.

The API and the CLI share one validation layer (delivery.operator.validation), so
each case is driven through both doors where both take it, and a refused call
must leave the database as it was.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.operator.api import AdminConfig, create_app
from delivery.operator.cli import main
from outbox.clock import ManualClock
from outbox.crypto import SecretBox, generate_key
from outbox.relay import Relay
from outbox.tokens import create_token
from tests.helpers import add_endpoint, scalar
from tests.operator_helpers import publish_many

KEY = generate_key("strict")
FULL_WIDTH_ONE = "\uff11"  # FULLWIDTH DIGIT ONE: Python int() reads it as 1


@pytest.fixture
def cli_box() -> SecretBox:
    return SecretBox.from_setting(KEY)


@pytest.fixture
async def dead_ids(
    engine: Engine, async_engine: AsyncEngine, cli_box: SecretBox, clock: ManualClock
) -> list[int]:
    """Two dead deliveries (ids 1 and 2), made without HTTP."""
    add_endpoint(engine, cli_box, "https://partner.example/hooks", "*")
    publish_many(engine, "order.created", 2)
    await Relay(async_engine, clock).run_until_idle()
    with engine.begin() as conn:
        found = conn.execute(
            text("UPDATE deliveries SET state = 'dead', completed_at = now() RETURNING id")
        ).scalars()
        return sorted(int(i) for i in found)


@pytest.fixture
async def client(
    engine: Engine, async_engine: AsyncEngine, cli_box: SecretBox, clock: ManualClock
) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(async_engine, cli_box, clock=clock, config=AdminConfig())
    with engine.begin() as conn:
        _, secret = create_token(conn, name="oncall", role="operator", actor="test")
    transport = httpx.ASGITransport(app=app, client=("10.9.9.9", 1234))
    async with httpx.AsyncClient(
        transport=transport,
        base_url="http://admin",
        headers={"authorization": f"Bearer {secret}"},
    ) as http:
        yield http


def _state(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(text("SELECT id, state, replay_of FROM deliveries ORDER BY id")).all()
        )


@pytest.mark.parametrize(
    "name", ["endpoint", "event_type", "error", "message_id", "state", "since", "until", "before"]
)
async def test_nul_in_any_delivery_filter_is_400(
    client: httpx.AsyncClient, dead_ids: list[int], name: str
) -> None:
    answer = await client.get("/v1/deliveries", params={name: "a\x00b"})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"].startswith(name)


@pytest.mark.parametrize("name", ["actor", "action", "target"])
async def test_nul_in_audit_filters_is_400(client: httpx.AsyncClient, name: str) -> None:
    answer = await client.get("/v1/audit", params={name: "x\x00"})
    assert answer.status_code == 400 and "NUL" in answer.json()["error"]


@pytest.mark.parametrize(
    ("path", "params", "message"),
    [
        ("/v1/deliveries", {"before": "99999999999999999999999"}, "before: Input should be less"),
        ("/v1/deliveries", {"limit": "0"}, "limit: Input should be greater than or equal to 1"),
        ("/v1/deliveries", {"limit": "1001"}, "limit: Input should be less"),
        ("/v1/deliveries", {"limit": "5.0"}, "limit: must be a whole number"),
        ("/v1/deliveries", {"before": "1" + FULL_WIDTH_ONE}, "before: must be a whole number"),
        ("/v1/deliveries", {"state": "lost"}, "state[0]: Input should be 'scheduled'"),
        ("/v1/deliveries", {"since": "yesterday"}, "since: must be an ISO 8601 time"),
        ("/v1/stats", {"window": "-1"}, "window: Input should be greater than 0"),
        ("/v1/stats", {"window": "0"}, "window: Input should be greater than 0"),
        ("/v1/stats", {"window": "99999999999999999999"}, "window: Input should be less"),
        ("/v1/stats", {"window": "nan"}, "window: must be a number"),
        ("/v1/audit", {"limit": "0"}, "limit: Input should be greater"),
        ("/v1/audit", {"before": "-5"}, "before: Input should be greater"),
    ],
)
async def test_out_of_range_or_malformed_query_values_are_400(
    client: httpx.AsyncClient, path: str, params: dict[str, str], message: str
) -> None:
    answer = await client.get(path, params=params)
    assert answer.status_code == 400, answer.text
    assert message in answer.json()["error"]


async def test_full_width_digit_id_does_not_find_delivery_one(
    engine: Engine, client: httpx.AsyncClient, dead_ids: list[int]
) -> None:
    assert dead_ids[0] == 1
    before = _state(engine)
    shown = await client.get(f"/v1/deliveries/{FULL_WIDTH_ONE}")
    assert shown.status_code == 400 and "digits 0-9" in shown.json()["error"]
    discarded = await client.post(f"/v1/deliveries/{FULL_WIDTH_ONE}/discard", json={"reason": "no"})
    assert discarded.status_code == 400
    too_big = await client.get("/v1/deliveries/99999999999999999999999")
    assert too_big.status_code == 400
    assert _state(engine) == before


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/deliveries/1/replay", {"reason": ["x"]}, "reason: must be a string, not a list"),
        ("/v1/deliveries/1/replay", {"reason": "r", "force": "yes"}, "force: Input should be"),
        ("/v1/deliveries/1/replay", {"reason": "r", "agian": True}, "agian: unknown field"),
        ("/v1/deliveries/1/replay", {"reason": "nul\x00"}, "reason: contains a NUL"),
        ("/v1/replays", {"reason": "r", "rate_per_minute": 1e-300}, "rate_per_minute: Input"),
        ("/v1/replays", {"reason": "r", "ids": [1.5]}, "ids[0]: must be a whole number"),
        ("/v1/replays", {"reason": "r", "ids": [True]}, "ids[0]: must be a whole number, not"),
        ("/v1/replays", {"reason": "r", "ids": ["1"], "filter": {}}, 'give "ids" or "filter"'),
        ("/v1/replays", {"reason": "r", "max_count": 0}, "max_count: Input should be greater"),
        ("/v1/replays", {"reason": "r", "filter": {"error": "a\x00"}}, "filter.error: contains"),
        ("/v1/replays", {"reason": "r", "filter": {"state": ["nope"]}}, "filter.state[0]"),
        ("/v1/discards", {"ids": [1.5], "reason": "r"}, "ids[0]: must be a whole number"),
        ("/v1/discards", {"ids": [], "reason": "r"}, "ids: List should have at least 1 item"),
        ("/v1/discards", {"ids": [2**63], "reason": "r"}, "ids[0]: Input should be less"),
        ("/v1/discards", {"ids": "1", "reason": "r"}, "ids: Input should be a valid list"),
    ],
)
async def test_bad_bodies_are_400_and_change_nothing(
    engine: Engine,
    client: httpx.AsyncClient,
    dead_ids: list[int],
    path: str,
    body: dict[str, Any],
    message: str,
) -> None:
    before = _state(engine)
    answer = await client.post(path, json=body)
    assert answer.status_code == 400, answer.text
    assert message in answer.json()["error"]
    assert _state(engine) == before
    assert scalar(engine, "SELECT count(*) FROM audit_log WHERE action LIKE 'delivery%'") == 0


async def test_endpoint_bodies_are_strict_too(
    engine: Engine, client: httpx.AsyncClient, dead_ids: list[int]
) -> None:
    uid = scalar(engine, "SELECT uid FROM endpoints")
    cases = [
        (f"/v1/endpoints/{uid}/rotate-secret", {"grace_seconds": 1e300}, "grace_seconds: Input"),
        (f"/v1/endpoints/{uid}/rotate-secret", {"grace_seconds": -1}, "grace_seconds: Input"),
        (f"/v1/endpoints/{uid}/disable", {"reason": {"why": 1}}, "reason: must be a string"),
        ("/v1/endpoints", {"url": "https://a.example/", "event_types": [1]}, "event_types"),
        ("/v1/endpoints", {"url": "https://a.example/\x00", "event_types": "*"}, "url: contains"),
    ]
    secret_before = scalar(engine, "SELECT signing_secret FROM endpoints")
    for path, body, message in cases:
        answer = await client.post(path, json=body)
        assert answer.status_code == 400, (path, answer.text)
        assert message in answer.json()["error"], answer.text
    patched = await client.patch(f"/v1/endpoints/{uid}", json={"max_attempts": True})
    assert patched.status_code == 400 and "max_attempts: must be a whole number" in patched.text
    patched = await client.patch(f"/v1/endpoints/{uid}", json={"timeout_seconds": 1e300})
    assert patched.status_code == 400 and "timeout_seconds: Input should be less" in patched.text
    maybe = await client.delete(f"/v1/endpoints/{uid}", params={"reason": "r", "force": "maybe"})
    assert maybe.status_code == 400 and "force: must be true or false" in maybe.text
    nul_uid = await client.post("/v1/endpoints/ep%00x/enable", json={})
    assert nul_uid.status_code == 400 and "uid: contains a NUL" in nul_uid.text
    assert scalar(engine, "SELECT count(*) FROM endpoints") == 1
    assert scalar(engine, "SELECT signing_secret FROM endpoints") == secret_before


async def test_a_300_mb_body_is_refused_413_without_being_read(
    engine: Engine, client: httpx.AsyncClient, dead_ids: list[int]
) -> None:
    chunk = b" " * (1024 * 1024)
    sent = 0

    async def body() -> AsyncIterator[bytes]:
        nonlocal sent
        for _ in range(300):
            sent += 1
            yield chunk

    started = time.monotonic()
    # Declared length: refused before a byte of the body is read.
    declared = await client.post(
        "/v1/replays",
        content=body(),
        headers={"content-length": str(300 * len(chunk)), "content-type": "application/json"},
    )
    assert declared.status_code == 413, declared.text
    assert "OUTBOX_ADMIN_MAX_BODY_BYTES" in declared.json()["error"]
    assert sent <= 1
    # Chunked (no length): refused at the first chunk past the 1 MiB cap.
    sent = 0
    chunked = await client.post("/v1/replays", content=body())
    assert chunked.status_code == 413
    assert sent <= 3
    assert time.monotonic() - started < 5
    assert scalar(engine, "SELECT count(*) FROM deliveries") == 2
    # Under the cap a body is read as usual.
    ok = await client.post("/v1/replays", json={"reason": "r", "ids": [1], "dry_run": True})
    assert ok.status_code == 200


# --- the CLI: the same rules through the same models --------------------------------


@pytest.fixture
def outbox(database_url: str) -> Any:
    runner = CliRunner()
    env = {"OUTBOX_DATABASE_URL": database_url, "OUTBOX_SECRET_KEYS": KEY}

    def invoke(*args: str) -> Any:
        return runner.invoke(main, list(args), env=env, catch_exceptions=False)

    return invoke


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("deliveries", "show", FULL_WIDTH_ONE), "id: must be a whole number"),
        (("deliveries", "show", "99999999999999999999999"), "id: Input should be less"),
        (("deliveries", "list", "--limit", "0"), "limit: Input should be greater"),
        (("deliveries", "list", "--before", "99999999999999999999999"), "before: Input"),
        (("deliveries", "list", "--endpoint", "ep\x00"), "endpoint: contains a NUL"),
        (("deliveries", "list", "--error", "\x00"), "error: contains a NUL"),
        (("deliveries", "list", "--message-id", "m\x1b[2J"), "message_id: contains a control"),
        (("deliveries", "list", "--state", "lost"), "state[0]: Input should be"),
        (("replay", "1.5", "--reason", "r"), "ids[0]: must be a whole number"),
        (("replay", "--state", "dead", "--rate", "1e-300", "--reason", "r"), "rate_per_minute"),
        (("replay", "--state", "dead", "--max", "0", "--reason", "r"), "max_count"),
        (("replay", "1", "--reason", "r\x00"), "reason: contains a NUL"),
        (("replay", "1", "--reason", "r", "--actor", "a\x00"), "--actor: contains a NUL"),
        (("discard", FULL_WIDTH_ONE, "--reason", "r"), "ids[0]: must be a whole number"),
        (("audit", "--limit", "0"), "limit: Input should be greater"),
        (("audit", "--actor", "x\x00"), "actor: contains a NUL"),
        (("stats", "--window", "0"), "window: Input should be greater than 0"),
        (("stats", "--window", "-1"), "is not a duration"),
        (("stats", "--window", "99999999999d"), "longer than 3650 days"),
        (("stats", "--window", "1" + FULL_WIDTH_ONE + "h"), "is not a duration"),
    ],
)
def test_cli_refuses_the_same_input_in_one_line(
    engine: Engine, dead_ids: list[int], outbox: Any, args: tuple[str, ...], message: str
) -> None:
    before = _state(engine)
    result = outbox(*args)
    assert result.exit_code != 0
    assert message in result.output, result.output
    assert "Traceback" not in result.output
    assert _state(engine) == before


def test_cli_endpoint_update_and_rotation_are_strict(
    engine: Engine, dead_ids: list[int], outbox: Any
) -> None:
    uid = scalar(engine, "SELECT uid FROM endpoints")
    bad = [
        (("endpoints", "update", uid, "--max-attempts", FULL_WIDTH_ONE), "max_attempts: must"),
        (("endpoints", "update", uid, "--timeout", "1e300"), "timeout_seconds: Input"),
        (("endpoints", "update", uid, "--description", "a\x00"), "description: contains"),
        (("endpoints", "rotate-secret", uid, "--grace", "3000d"), "grace_seconds: Input"),
    ]
    for args, message in bad:
        result = outbox(*args)
        assert result.exit_code != 0 and message in result.output, (args, result.output)
    assert scalar(engine, "SELECT max_attempts FROM endpoints") is None


# --- search by message id -------------------------------------------------------------


async def test_search_by_message_id_in_api_and_cli(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    cli_box: SecretBox,
    client: httpx.AsyncClient,
    outbox: Any,
) -> None:
    add_endpoint(engine, cli_box, "https://a.example/hooks", "*")
    add_endpoint(engine, cli_box, "https://b.example/hooks", "*")
    first, second = publish_many(engine, "order.created", 2)
    await Relay(async_engine, clock).run_until_idle()
    wanted = {
        int(row[0])
        for row in engine.connect().execute(
            text(
                "SELECT d.id FROM deliveries d JOIN outbox_events e ON e.id = d.event_id"
                " WHERE e.message_id = :m"
            ),
            {"m": second},
        )
    }
    assert len(wanted) == 2
    found = (await client.get("/v1/deliveries", params={"message_id": second})).json()
    assert {item["id"] for item in found["items"]} == wanted
    assert {item["message_id"] for item in found["items"]} == {second}
    listed = json.loads(outbox("deliveries", "list", "--message-id", second, "--json").output)
    assert {item["id"] for item in listed["items"]} == wanted
    none = (await client.get("/v1/deliveries", params={"message_id": "msg_nope"})).json()
    assert none["items"] == []
    assert first != second


# --- the SSRF guard's warning when an endpoint is saved ----------------------------------


async def test_endpoint_add_and_update_warn_when_the_guard_will_refuse(
    engine: Engine,
    async_engine: AsyncEngine,
    cli_box: SecretBox,
    clock: ManualClock,
    client: httpx.AsyncClient,
    outbox: Any,
) -> None:
    private = await client.post(
        "/v1/endpoints", json={"url": "http://10.1.2.3/hooks", "event_types": ["*"]}
    )
    assert private.status_code == 200  # a warning, not an error
    [warning] = private.json()["warnings"]
    assert "10.1.2.3" in warning and "private" in warning
    assert "OUTBOX_ALLOWED_NETWORKS" in warning
    public = await client.post(
        "/v1/endpoints", json={"url": "https://93.184.216.34/hooks", "event_types": ["*"]}
    )
    assert public.json()["warnings"] == []
    uid = public.json()["id"]
    moved = await client.patch(f"/v1/endpoints/{uid}", json={"url": "http://169.254.169.254/"})
    assert moved.status_code == 200 and "link-local" in moved.json()["warnings"][0]
    renamed = await client.patch(f"/v1/endpoints/{uid}", json={"description": "x"})
    assert renamed.json()["warnings"] == []

    # The guard's own allowed networks silence it.
    allowing = create_app(
        async_engine, cli_box, clock=clock, config=AdminConfig(allowed_networks=("10.0.0.0/8",))
    )
    transport = httpx.ASGITransport(app=allowing)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://admin", headers=client.headers
    ) as other:
        allowed = await other.post(
            "/v1/endpoints", json={"url": "http://10.1.2.4/hooks", "event_types": ["*"]}
        )
    assert allowed.json()["warnings"] == []

    # The CLI resolves names with the same policy: localhost is loopback.
    added = outbox("endpoints", "add", "http://localhost:9/hooks", "--events", "*")
    assert added.exit_code == 0
    assert "warning: localhost resolves to" in added.output and "loopback" in added.output
    as_json = outbox("endpoints", "add", "http://127.0.0.1:9/h", "--events", "*", "--json")
    assert "loopback" in json.loads(as_json.stdout)["warnings"][0]
    quiet = outbox("endpoints", "add", "https://93.184.216.34/h", "--events", "*")
    assert quiet.exit_code == 0 and "warning" not in quiet.output


async def test_a_real_server_answers_a_300_mb_upload_413_before_it_arrives(
    engine: Engine, async_engine: AsyncEngine, cli_box: SecretBox, clock: ManualClock
) -> None:
    """Over a socket, as an operator's curl would: the answer comes while it still sends."""
    import asyncio

    from delivery.operator.api import serve

    with engine.begin() as conn:
        _, secret = create_token(conn, name="oncall", role="operator", actor="test")
    stop, started = asyncio.Event(), asyncio.Event()
    port: list[int] = []

    def on_started(bound: int) -> None:
        port.append(bound)
        started.set()

    app = create_app(async_engine, cli_box, clock=clock)
    task = asyncio.create_task(
        serve(app, host="127.0.0.1", port=0, stop=stop, on_started=on_started)
    )
    try:
        await asyncio.wait_for(started.wait(), timeout=10)
        reader, writer = await asyncio.open_connection("127.0.0.1", port[0])
        total = 300 * 1024 * 1024
        writer.write(
            (
                "POST /v1/replays HTTP/1.1\r\nhost: admin\r\ncontent-type: application/json\r\n"
                f"authorization: Bearer {secret}\r\ncontent-length: {total}\r\n\r\n"
            ).encode()
        )
        started_at = time.monotonic()
        sent, chunk = 0, b" " * (256 * 1024)
        answer = asyncio.ensure_future(reader.readline())
        while not answer.done() and sent < total:
            try:
                writer.write(chunk)
                await asyncio.wait_for(writer.drain(), timeout=1)
            except (ConnectionError, TimeoutError):
                break
            sent += len(chunk)
        status_line = await asyncio.wait_for(answer, timeout=5)
        elapsed = time.monotonic() - started_at
        writer.close()
        assert status_line.startswith(b"HTTP/1.1 413"), status_line
        assert sent < 64 * 1024 * 1024  # answered long before the 300 MB were sent
        assert elapsed < 5
    finally:
        stop.set()
        await task


async def test_a_nul_anywhere_is_refused_on_every_route(
    engine: Engine, client: httpx.AsyncClient
) -> None:
    """Routes without a model of their own (tenants, tokens) still never reach PostgreSQL
    with a NUL, which it cannot store (it answered 500 before)."""
    tenants = scalar(engine, "SELECT count(*) FROM tenants")
    cases = [
        ("/v1/tenants", {"id": "t1", "name": "a\x00"}, "name: contains a NUL"),
        ("/v1/tenants", {"id": "t2", "metadata": {"deep": ["ok", "\x00"]}}, "metadata.deep[1]"),
        ("/v1/tokens", {"name": "x\x00", "role": "viewer"}, "name: contains a NUL"),
    ]
    for path, body, message in cases:
        answer = await client.post(path, json=body)
        assert answer.status_code == 400, (path, answer.text)
        assert message in answer.json()["error"]
    listed = await client.get("/v1/tenants", params={"after": "\x00"})
    assert listed.status_code == 400 and "after: contains a NUL" in listed.text
    assert scalar(engine, "SELECT count(*) FROM tenants") == tenants
    assert scalar(engine, "SELECT count(*) FROM admin_tokens") == 1


def test_cli_output_never_passes_control_characters_to_the_terminal(
    engine: Engine, dead_ids: list[int], outbox: Any
) -> None:
    """A hostile receiver's text (reason phrase, error) cannot rewrite the operator's screen."""
    hostile = "500 \x1b[2J\x1b]0;pwned\x07 Server Error"
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE deliveries SET final_reason = :r, last_error = :r"), {"r": hostile}
        )
    for args in (("deliveries", "show", str(dead_ids[0])), ("deliveries", "list")):
        result = outbox(*args)
        assert result.exit_code == 0, result.output
        assert "\x1b" not in result.output and "\x07" not in result.output
        assert "Server Error" in result.output


async def test_tenant_routes_refuse_a_zero_limit_and_unclear_flags(
    client: httpx.AsyncClient,
) -> None:
    zero = await client.get("/v1/tenants", params={"limit": "0"})
    assert zero.status_code == 400 and "limit" in zero.json()["error"]
    full_width = await client.get("/v1/tenants", params={"limit": FULL_WIDTH_ONE})
    assert full_width.status_code == 400 and "digits 0-9" in full_width.json()["error"]
    unclear = await client.get("/v1/tenants", params={"enabled": "maybe"})
    assert unclear.status_code == 400 and "enabled: must be true or false" in unclear.text
    assert (await client.get("/v1/tenants", params={"enabled": "false"})).status_code == 200
    kept = await client.delete("/v1/tenants/default", params={"reason": "r", "force": "perhaps"})
    assert kept.status_code == 400 and "force: must be true or false" in kept.text
