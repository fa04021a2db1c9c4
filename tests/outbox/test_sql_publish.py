"""outbox_publish(): publishing from any language through plain SQL, in the caller's own
transaction, with publish()'s rules where SQL can enforce them; the relay checks the schema
and rejects (visibly, replayably) an event whose payload breaks it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.operator.cli import main
from delivery.receiver import Receiver
from outbox.catalogue import RejectedEvent, add_event_type, list_rejected
from outbox.clock import ManualClock
from outbox.crypto import SecretBox, generate_key
from outbox.relay import Relay, RelayConfig
from outbox.tenants import create_tenant
from tests.helpers import add_endpoint, rows, scalar
from tests.operator_helpers import deliver

CALL = text(
    "SELECT outbox_publish(:tenant, :type, CAST(:payload AS jsonb), :key, :ordering, :prio)"
)


def nested(levels: int) -> dict[str, object]:
    """A payload `levels` containers deep (itself the first); the string at the bottom
    holds brackets, which are not levels."""
    inner: object = "]]{"
    for _ in range(levels - 1):
        inner = [inner]
    return {"d": inner}


SCHEMA = {"type": "object", "required": ["id"], "properties": {"id": {"type": "integer"}}}


def call(
    conn: object,
    event_type: str = "order.created",
    payload: object = None,
    *,
    tenant: str | None = None,
    key: str | None = None,
    ordering: str | None = None,
    priority: int | None = None,
) -> str:
    params = {
        "tenant": tenant,
        "type": event_type,
        "payload": json.dumps({"id": 1} if payload is None else payload),
        "key": key,
        "ordering": ordering,
        "prio": priority,
    }
    return str(conn.execute(CALL, params).scalar_one())  # type: ignore[attr-defined]


def test_committed_is_kept_rolled_back_is_gone(engine: Engine) -> None:
    with engine.begin() as conn:
        kept = call(conn, key="k-1", ordering="o-1", priority=7)
    with engine.connect() as conn:
        conn.begin()
        call(conn, "order.cancelled")
        conn.rollback()
    assert kept.startswith("msg_") and len(kept) == 36
    events = rows(
        engine,
        "SELECT message_id, event_type, payload, idempotency_key, ordering_key, priority,"
        " validate_pending FROM outbox_events",
    )
    assert events == [
        {
            "message_id": kept,
            "event_type": "order.created",
            "payload": {"id": 1},
            "idempotency_key": "k-1",
            "ordering_key": "o-1",
            "priority": 7,
            "validate_pending": True,
        }
    ]


def test_idempotency_is_per_tenant_and_unknown_tenants_are_refused(engine: Engine) -> None:
    with engine.begin() as conn:
        create_tenant(conn, "acme")
        first = call(conn, key="same")
        assert call(conn, key="same", payload={"id": 1}) == first
        other = call(conn, key="same", tenant="acme")
        assert other != first
    with engine.begin() as conn, pytest.raises(DBAPIError) as refused:
        call(conn, tenant="nobody")
    assert "unknown tenant 'nobody'" in str(refused.value)
    assert "outbox tenants add" in str(refused.value)  # the HINT says how to fix it
    assert scalar(engine, "SELECT count(*) FROM outbox_events") == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"event_type": "order created"}, "event type 'order created' is invalid"),
        ({"event_type": "delivery.dead"}, "operational event"),
        ({"payload": [1, 2]}, "payload must be a JSON object, not array"),
        ({"payload": {"blob": "x" * 70_000}}, "over the 65536-byte limit"),
        ({"key": ""}, "keys must be non-empty"),
        ({"priority": 101}, "priority 101 is outside -100..100"),
        ({"payload": nested(65)}, "payload nests deeper than 64 levels"),
    ],
)
def test_bad_input_is_refused_with_a_clear_error(
    engine: Engine, kwargs: dict[str, object], message: str
) -> None:
    with engine.begin() as conn, pytest.raises(DBAPIError) as refused:
        call(conn, **kwargs)  # type: ignore[arg-type]
    assert message in str(refused.value)
    assert scalar(engine, "SELECT count(*) FROM outbox_events") == 0


def test_archived_types_are_refused(engine: Engine) -> None:
    with engine.begin() as conn:
        add_event_type(conn, "order.created", schema=SCHEMA, actor="t")
        conn.execute(text("UPDATE event_types SET status = 'archived'"))
    with engine.begin() as conn, pytest.raises(DBAPIError, match="is archived"):
        call(conn)


async def test_the_relay_delivers_valid_events_and_rejects_broken_ones_visibly(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    add_endpoint(engine, box, receiver.route("/hook"), "order.*")
    with engine.begin() as conn:
        add_event_type(conn, "order.created", schema=SCHEMA, actor="t")
        good = call(conn, payload={"id": 1})
        bad = call(conn, payload={"id": "one"})
        unknown = call(conn, "order.unknown", payload={"anything": True})
    result = await Relay(async_engine, clock).run_until_idle()
    assert result.rejected == 1
    await deliver(async_engine, box, clock)
    sent = {json.loads(r.body)["data"].get("id") for r in receiver.received("/hook")}
    assert sent == {1, None}  # the good one and the unknown type (default mode accepts)
    assert len(receiver.received("/hook")) == 2
    rejected = rows(engine, "SELECT message_id, rejected_reason FROM outbox_events"
                            " WHERE rejected_at IS NOT NULL")  # fmt: skip
    assert [r["message_id"] for r in rejected] == [bad]
    assert "at $.id: 'one' is not of type 'integer' (rule 'type')" in rejected[0]["rejected_reason"]
    assert good != unknown

    # Visible through the CLI, and replayable once the schema is fixed.
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    monkeypatch.setenv("OUTBOX_SECRET_KEYS", generate_key("cli"))
    cli = CliRunner()
    listed = cli.invoke(main, ["events", "rejected", "--json"], catch_exceptions=False)
    assert [item["message_id"] for item in json.loads(listed.output)] == [bad]
    no_reason = cli.invoke(main, ["events", "requeue", bad])
    assert no_reason.exit_code == 2  # --reason is required
    again = cli.invoke(
        main, ["events", "requeue", bad, "--reason", "still broken"], catch_exceptions=False
    )
    assert again.exit_code == 0
    assert (await Relay(async_engine, clock).run_until_idle()).rejected == 1  # same schema
    loose = {"type": "object", "properties": {"id": {"type": ["integer", "string"]}}}
    (tmp_path / "v2.json").write_text(json.dumps(loose))
    updated = cli.invoke(
        main, ["event-types", "update", "order.created", "--schema", str(tmp_path / "v2.json")]
    )
    assert updated.exit_code == 0, updated.output
    cli.invoke(main, ["events", "requeue", bad, "--reason", "schema v2"], catch_exceptions=False)
    assert (await Relay(async_engine, clock).run_until_idle()).rejected == 0
    await deliver(async_engine, box, clock)
    assert "one" in {json.loads(r.body)["data"].get("id") for r in receiver.received("/hook")}
    assert scalar(engine, "SELECT count(*) FROM audit_log WHERE action = 'event.requeue'") == 2


async def test_strict_relay_rejects_unknown_types_from_sql(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock
) -> None:
    with engine.begin() as conn:
        call(conn, "never.catalogued")
    relay = Relay(async_engine, clock, RelayConfig(event_types_mode="strict"))
    assert (await relay.run_until_idle()).rejected == 1
    reason = scalar(engine, "SELECT rejected_reason FROM outbox_events")
    assert "not in the catalogue" in reason


def test_depth_is_counted_like_publish(engine: Engine) -> None:
    """64 levels pass (brackets inside strings are not levels); max_payload_depth raises
    the limit up to 256 (the server's ceiling) and refuses values outside 1..256; NULL
    means the default, 64 (migration 0021: it used to be refused)."""
    deeper = CALL.text.replace(":prio)", ":prio, 65536, :depth)")
    with engine.begin() as conn:
        call(conn, payload=nested(64))
        conn.execute(
            text(deeper),
            {"tenant": None, "type": "order.created", "payload": json.dumps(nested(65)),
             "key": None, "ordering": None, "prio": None, "depth": 65},
        )  # fmt: skip
    outside = "outside 1..256 .the server's ceiling"
    for depth, payload, message in [
        (0, {}, outside),
        (257, {}, outside),
        (None, nested(65), "nests deeper than 64 levels"),
    ]:
        with engine.begin() as conn, pytest.raises(DBAPIError, match=message):
            conn.execute(
                text(deeper),
                {"tenant": None, "type": "order.created", "payload": json.dumps(payload),
                 "key": None, "ordering": None, "prio": None, "depth": depth},
            )  # fmt: skip
    assert scalar(engine, "SELECT count(*) FROM outbox_events") == 2


async def test_a_payload_too_deep_to_read_is_rejected_alone(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    """A row nested deeper than Python's JSON decoder allows (written before the function
    checked depth, or by hand) is rejected with a reason; the events around it go out."""
    add_endpoint(engine, box, receiver.route("/hook"), "order.*")
    with engine.begin() as conn:
        call(conn, payload={"id": 1})
        deep = call(conn, payload={"id": 2})
        call(conn, payload={"id": 3})
        conn.execute(
            text("UPDATE outbox_events SET payload = CAST(:deep AS jsonb) WHERE message_id = :id"),
            {"deep": '{"d": ' + "[" * 3000 + "]" * 3000 + "}", "id": deep},
        )
    assert (await Relay(async_engine, clock).run_until_idle()).rejected == 1
    await deliver(async_engine, box, clock)
    assert sorted(json.loads(r.body)["data"]["id"] for r in receiver.received("/hook")) == [1, 3]
    [rejected] = list_rejected_now(engine)
    assert rejected.message_id == deep and rejected.payload is None
    assert "nests too deeply to be read back" in rejected.reason


def list_rejected_now(engine: Engine) -> list[RejectedEvent]:
    with engine.connect() as conn:
        return list_rejected(conn)
