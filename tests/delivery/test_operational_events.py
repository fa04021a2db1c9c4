"""Operational events: the service publishes its own trouble through its own pipeline, to
the owning tenant, and storms stay bounded."""

from __future__ import annotations

import datetime as dt
import json
from collections import Counter

import pytest
from click.testing import CliRunner
from jsonschema import Draft202012Validator
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.health import HealthConfig
from delivery.http import build_http_client
from delivery.operational import DEAD_EVENTS_PER_MINUTE
from delivery.operator.cli import main
from delivery.receiver import Receiver
from delivery.worker import Worker, WorkerConfig
from outbox import PublishError, publish
from outbox.catalogue import add_event_type
from outbox.clock import ManualClock
from outbox.crypto import SecretBox, generate_key
from outbox.endpoints import secret_columns, set_failure_policy
from outbox.relay import Relay, RelayConfig
from outbox.tenants import create_tenant
from outbox.webhook_contract import OPERATIONAL_SCHEMAS
from outbox.workflows import set_workflow
from tests.helpers import LOOPBACK, add_endpoint, rows, scalar
from tests.operator_helpers import deliver

OPS = "endpoint.*,delivery.dead,tenant.disabled"


def op_events(engine: Engine, event_type: str | None = None) -> list[dict[str, object]]:
    return rows(
        engine,
        "SELECT o.event_type, o.payload, t.uid AS tenant FROM outbox_events o"
        " JOIN tenants t ON t.id = o.tenant_id"
        " WHERE o.event_type IN ('endpoint.disabled', 'endpoint.breaker_opened',"
        " 'endpoint.recovered', 'delivery.dead', 'tenant.disabled')"
        " AND (CAST(:t AS text) IS NULL OR o.event_type = :t) ORDER BY o.id",
        t=event_type,
    )


async def run_worker(
    async_engine: AsyncEngine, box: SecretBox, clock: ManualClock, **health: object
) -> None:
    config = WorkerConfig(lease_seconds=30, health=HealthConfig(**health))  # type: ignore[arg-type]
    async with build_http_client(max_connections=50, timeout=5, allowed_networks=LOOPBACK) as http:
        worker = Worker(async_engine, http, box, clock, config)
        while (await worker.run_once()).claimed:
            pass


def check_documented(engine: Engine) -> int:
    """Every operational event written so far matches the schema the OpenAPI export
    documents for it, with no undocumented field."""
    checked = 0
    for event in op_events(engine):
        _, properties = OPERATIONAL_SCHEMAS[str(event["event_type"])]
        strict = {"type": "object", "properties": properties, "additionalProperties": False}
        Draft202012Validator(strict).validate(event["payload"])
        checked += 1
    return checked


def test_applications_cannot_publish_operational_types(engine: Engine) -> None:
    with engine.begin() as conn, pytest.raises(PublishError, match="operational event"):
        publish(conn, "endpoint.disabled", {})


async def test_a_disabled_endpoint_is_reported_to_its_own_tenant_only(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    receiver: Receiver,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    key = generate_key("ops")
    box = SecretBox.from_setting(key)
    with engine.begin() as conn:
        create_tenant(conn, "acme")
        create_tenant(conn, "globex")
    partner = add_endpoint(engine, box, receiver.route("/acme-partner"), "order.*", tenant="acme")
    add_endpoint(engine, box, receiver.route("/acme-ops"), OPS, tenant="acme")
    add_endpoint(engine, box, receiver.route("/acme-all"), "*", tenant="acme")
    add_endpoint(engine, box, receiver.route("/globex-ops"), OPS, tenant="globex")

    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    monkeypatch.setenv("OUTBOX_SECRET_KEYS", key)
    result = CliRunner().invoke(
        main,
        ["endpoints", "disable", partner.endpoint.uid, "--reason", "partner is migrating"],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    await Relay(async_engine, clock).run_until_idle()
    await run_worker(async_engine, box, clock)

    [received] = receiver.received("/acme-ops")
    event = json.loads(received.body)
    assert event["type"] == "endpoint.disabled"
    assert event["data"]["endpoint_id"] == partner.endpoint.uid
    assert event["data"]["reason"] == "partner is migrating"
    assert receiver.received("/globex-ops") == []  # another tenant learns nothing
    assert receiver.received("/acme-all") == []  # '*' means application events only
    assert check_documented(engine) == 1


async def test_breaker_opened_then_recovered(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox,
    receiver: Receiver,
) -> None:  # fmt: skip
    flaky = add_endpoint(engine, box, receiver.route("/flaky", status=503), "order.*")
    add_endpoint(engine, box, receiver.route("/ops"), OPS)
    with engine.begin() as conn:
        for n in range(5):
            publish(conn, "order.created", {"n": n})
    await Relay(async_engine, clock).run_until_idle()
    await run_worker(async_engine, box, clock, failure_threshold=3)
    [opened] = op_events(engine, "endpoint.breaker_opened")
    assert opened["payload"]["endpoint_id"] == flaky.endpoint.uid  # type: ignore[index]
    assert "503" in str(opened["payload"]["last_failure"])  # type: ignore[index]

    receiver.route("/flaky", status=200)
    clock.advance(300)
    await run_worker(async_engine, box, clock, failure_threshold=3)
    [recovered] = op_events(engine, "endpoint.recovered")
    assert recovered["payload"]["endpoint_id"] == flaky.endpoint.uid  # type: ignore[index]
    await Relay(async_engine, clock).run_until_idle()
    await run_worker(async_engine, box, clock, failure_threshold=3)
    kinds = [json.loads(r.body)["type"] for r in receiver.received("/ops")]
    assert kinds.count("endpoint.breaker_opened") == 1
    assert kinds.count("endpoint.recovered") == 1
    assert check_documented(engine) == 2


def test_a_disabled_tenant_is_reported(
    engine: Engine, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with engine.begin() as conn:
        create_tenant(conn, "acme")
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    monkeypatch.setenv("OUTBOX_SECRET_KEYS", generate_key("ops"))
    result = CliRunner().invoke(
        main, ["tenants", "disable", "acme", "--reason", "unpaid"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    [event] = op_events(engine, "tenant.disabled")
    assert event["tenant"] == "acme"
    assert event["payload"]["tenant_id"] == "acme"  # type: ignore[index]
    assert event["payload"]["reason"] == "unpaid"  # type: ignore[index]
    assert check_documented(engine) == 1
    # Whoever disables it (SQL by hand included), the trigger reports it, once per change.
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE tenants SET enabled = true, disabled_reason = NULL WHERE uid = 'acme'")
        )
        conn.execute(
            text("UPDATE tenants SET enabled = false, disabled_reason = 'again',"
                 " disabled_at = now() + interval '1 minute' WHERE uid = 'acme'")
        )  # fmt: skip
    assert [e["payload"]["reason"] for e in op_events(engine, "tenant.disabled")] == [  # type: ignore[index]
        "unpaid",
        "again",
    ]


async def test_a_storm_of_100_failing_endpoints_produces_a_bounded_number_of_events(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    endpoints = 100
    per_endpoint = 5  # the fifth failure in a row also opens the breaker (threshold 5)
    url = receiver.route("/down", status=500)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO endpoints (uid, tenant_id, url, event_types, signing_secret)"
                " SELECT 'ep_storm_' || n, (SELECT id FROM tenants WHERE uid = 'default'),"
                " :url, ARRAY['order.*'], :secret FROM generate_series(1, :count) n"
            ),
            {"url": url, "secret": "placeholder", "count": endpoints},
        )
    # Real encrypted secrets (the worker decrypts them), written like create_endpoint does.
    with engine.begin() as conn:
        for row in conn.execute(text("SELECT uid FROM endpoints")).all():
            columns = secret_columns(box, row.uid, "whsec_" + "A" * 43 + "=")
            conn.execute(
                text("UPDATE endpoints SET signing_secret = :s WHERE uid = :uid"),
                {"s": columns["signing_secret"], "uid": row.uid},
            )
        for n in range(per_endpoint):
            publish(conn, "order.created", {"n": n})
    relay = Relay(async_engine, clock, RelayConfig(default_max_attempts=1))
    await relay.run_until_idle()
    await run_worker(async_engine, box, clock)
    dead = scalar(engine, "SELECT count(*) FROM deliveries WHERE state = 'dead'")
    assert dead == endpoints * per_endpoint

    counts = Counter(str(e["event_type"]) for e in op_events(engine))
    assert counts["endpoint.breaker_opened"] == endpoints  # one per endpoint, not per failure
    assert counts["delivery.dead"] == endpoints * DEAD_EVENTS_PER_MINUTE  # the rest held back
    # After the minute, one summary per endpoint carries the rest.
    clock.advance(61)
    await Relay(async_engine, clock, RelayConfig(default_max_attempts=1)).run_once()
    summaries = [
        e["payload"] for e in op_events(engine, "delivery.dead")
        if e["payload"].get("summary")  # type: ignore[union-attr]
    ]  # fmt: skip
    assert len(summaries) == endpoints
    assert {s["count"] for s in summaries} == {per_endpoint - DEAD_EVENTS_PER_MINUTE}  # type: ignore[index]
    total = len(op_events(engine))
    assert total == endpoints * (1 + DEAD_EVENTS_PER_MINUTE + 1)  # not 100 x 6 deaths + trips
    # A second flush finds nothing more to say.
    await Relay(async_engine, clock).run_once()
    assert len(op_events(engine)) == total
    assert check_documented(engine) == total


async def test_an_operational_endpoint_that_is_down_feeds_no_loop(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox,
    receiver: Receiver,
) -> None:  # fmt: skip
    add_endpoint(engine, box, receiver.route("/partner", status=404), "order.*")
    add_endpoint(engine, box, receiver.route("/ops-down", status=404), "delivery.dead")
    with engine.begin() as conn:
        publish(conn, "order.created", {"id": 1})
    for _ in range(3):
        await Relay(async_engine, clock).run_until_idle()
        await run_worker(async_engine, box, clock)
    # The partner's dead delivery is reported once; the report's own death is not.
    assert len(receiver.received("/ops-down")) == 1
    assert len(op_events(engine, "delivery.dead")) == 1
    assert scalar(engine, "SELECT count(*) FROM deliveries WHERE state = 'dead'") == 2


async def test_dead_summaries_name_each_owner_and_reach_that_owners_watcher(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    """One unowned endpoint fails three workflows' events past the storm bound: the
    held-back deaths are summarised per owner (the event type's; null when nobody owns
    it), and a watcher that takes billing's operational events only gets billing's."""
    with engine.begin() as conn:
        for name, owner in (("invoice.paid", "billing"), ("shipping.sent", "shipping")):
            add_event_type(conn, name, schema={}, actor="t")
            set_workflow(conn, name, actor="t", owner=owner)
    add_endpoint(engine, box, receiver.route("/bad", status=400), "*")
    billing = add_endpoint(engine, box, receiver.route("/ops-billing"), "delivery.dead")
    add_endpoint(engine, box, receiver.route("/ops-all"), "delivery.dead")
    with engine.begin() as conn:
        set_failure_policy(conn, billing.endpoint.uid, actor="t", operational_owner="billing")
        # the first DEAD_EVENTS_PER_MINUTE deaths are reported one by one
        for event_type in ("misc.thing",) * DEAD_EVENTS_PER_MINUTE + (
            "invoice.paid", "invoice.paid", "shipping.sent", "misc.thing",
        ):  # fmt: skip
            publish(conn, event_type, {})
    await deliver(async_engine, box, clock)
    clock.advance(61)
    await deliver(async_engine, box, clock)  # flush the summaries, then send them
    summaries = sorted(
        (
            e["payload"]
            for e in op_events(engine, "delivery.dead")
            if e["payload"].get("summary")  # type: ignore[union-attr]
        ),
        key=lambda s: str(s["owner"]),  # type: ignore[index]
    )
    assert [(s["owner"], s["count"]) for s in summaries] == [  # type: ignore[index]
        (None, 1), ("billing", 2), ("shipping", 1),
    ]  # fmt: skip
    assert all("owner" in s for s in summaries)  # no owner is said, as null
    got = {
        path: sorted(
            (str(data["owner"]), data.get("summary", False))
            for data in (json.loads(r.body)["data"] for r in receiver.received(path))
        )
        for path in ("/ops-billing", "/ops-all")
    }
    assert got["/ops-billing"] == [("billing", True)]
    assert got["/ops-all"] == sorted(
        [("None", False)] * DEAD_EVENTS_PER_MINUTE
        + [("billing", True), ("shipping", True), ("None", True)]
    )
    assert check_documented(engine) == DEAD_EVENTS_PER_MINUTE + 3


def test_deaths_counted_before_the_owner_was_recorded_go_to_the_endpoints_owner(
    engine: Engine, box: SecretBox, clock: ManualClock
) -> None:
    """A window held back by the previous function (migration 0041 upgrades mid-minute)
    has a count and no owners: its summary names the endpoint's owner, or null."""
    owned = add_endpoint(engine, box, "https://example.com/a").endpoint.uid
    add_endpoint(engine, box, "https://example.com/b")
    with engine.begin() as conn:
        set_failure_policy(conn, owned, actor="t", owner="payments")
        conn.execute(
            text(
                "INSERT INTO operational_event_marks (endpoint_id, kind, window_start, emitted,"
                " suppressed) SELECT id, 'delivery.dead', :start, 3, 2 FROM endpoints"
            ),
            {"start": clock.now() - dt.timedelta(minutes=2)},
        )
        flushed = conn.execute(
            text("SELECT outbox_flush_operational_summaries(:now)"), {"now": clock.now()}
        ).scalar_one()
    assert flushed == 2
    owners = sorted(
        (str(e["payload"]["owner"]), e["payload"]["count"])  # type: ignore[index]
        for e in op_events(engine, "delivery.dead")
    )
    assert owners == [("None", 2), ("payments", 2)]
    assert (
        rows(engine, "SELECT suppressed, suppressed_owners FROM operational_event_marks")
        == [{"suppressed": 0, "suppressed_owners": None}] * 2
    )


async def test_a_dead_held_report_reports_nothing(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    """A `delivery.held` event that dies at its watcher is not itself reported as dead,
    like every operational event (no loops)."""
    add_endpoint(engine, box, receiver.route("/ops-down", status=400), "delivery.held")
    with engine.begin() as conn:
        conn.execute(
            text(
                "SELECT outbox_publish_operational((SELECT id FROM tenants"
                " WHERE uid = 'default'), 'delivery.held', CAST('{}' AS jsonb), 'k', :now)"
            ),
            {"now": clock.now()},
        )
    await deliver(async_engine, box, clock)
    assert len(receiver.received("/ops-down")) == 1
    assert scalar(engine, "SELECT count(*) FROM deliveries WHERE state = 'dead'") == 1
    assert op_events(engine, "delivery.dead") == []
