"""Retention prunes exactly the finished history it should, in small batches."""

from __future__ import annotations

import asyncio

from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.operator import app
from delivery.receiver import Receiver
from delivery.retention import Retention, RetentionConfig
from delivery.worker import WorkerConfig
from outbox import deliveries as delivery_ops
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.relay import RelayConfig
from tests.helpers import add_endpoint, disable, rows, scalar
from tests.operator_helpers import deliver, publish_many


def remaining(engine: Engine) -> set[tuple[str, str | None, str | None]]:
    """(event type, endpoint path, state) of every event and delivery left."""
    return {
        (r["event_type"], r["url"].rsplit("/", 1)[-1] if r["url"] else None, r["state"])
        for r in rows(
            engine,
            """
            SELECT ev.event_type, e.url, d.state FROM outbox_events ev
            LEFT JOIN deliveries d ON d.event_id = ev.id
            LEFT JOIN endpoints e ON e.id = d.endpoint_id
            -- the service's own reports of the failures below (young, and not the subject)
            WHERE ev.event_type NOT IN ('delivery.dead', 'endpoint.disabled')
            """,
        )
    }


async def test_pruning_removes_exactly_the_old_finished_history(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    add_endpoint(engine, box, receiver.route("/ok"), "a.*,c.*,d.*,e.*")
    add_endpoint(engine, box, receiver.route("/dead", status=404), "a.*")
    add_endpoint(engine, box, receiver.route("/fixed", status=404), "c.*")
    flaky = add_endpoint(engine, box, receiver.route("/flaky", status=500), "d.*")
    add_endpoint(engine, box, receiver.route("/dropped", status=500), "e.*")
    for event_type in ("a.x", "b.x", "c.x", "d.x", "e.x"):
        publish_many(engine, event_type)
    await deliver(async_engine, box, clock)
    receiver.route("/fixed", status=200)
    with engine.begin() as conn:
        fixed = delivery_ops.search_deliveries(
            conn, delivery_ops.DeliveryFilter(error="404", event_type="c.x")
        )
        delivery_ops.replay(conn, [fixed[0].id], actor="t", reason="fixed", now=clock.now())
        dropped = delivery_ops.search_deliveries(
            conn, delivery_ops.DeliveryFilter(event_type="e.x", error="500")
        )
        delivery_ops.discard(conn, [dropped[0].id], actor="t", reason="obsolete", now=clock.now())
    await deliver(async_engine, box, clock)
    disable(engine, flaky.endpoint.uid)  # keeps its delivery scheduled and untouched

    clock.advance(days=8)
    publish_many(engine, "a.recent")
    await deliver(async_engine, box, clock)
    attempts_before = scalar(engine, "SELECT count(*) FROM delivery_attempts")
    before = remaining(engine)

    retention = Retention(async_engine, clock, RetentionConfig(retention_days=7, batch_size=1))
    first = await retention.run_once()
    assert first.deliveries in (1, 2) and first.events == 1  # one group, one event per batch
    await retention.run_until_done()

    pruned = {
        ("a.x", "ok", "succeeded"),
        ("b.x", None, None),
        ("c.x", "ok", "succeeded"),
        ("c.x", "fixed", "dead"),
        ("c.x", "fixed", "succeeded"),
        ("d.x", "ok", "succeeded"),
        ("e.x", "ok", "succeeded"),
        ("e.x", "dropped", "discarded"),
    }
    assert pruned <= before
    assert remaining(engine) == before - pruned
    assert remaining(engine) == {
        ("a.x", "dead", "dead"),  # a dead letter nobody handled stays
        ("d.x", "flaky", "scheduled"),  # still pending
        ("a.recent", "ok", "succeeded"),  # too young
        ("a.recent", "dead", "dead"),
    }
    attempts_after = scalar(engine, "SELECT count(*) FROM delivery_attempts")
    tallied = scalar(engine, "SELECT sum(value) FROM pruned_totals WHERE name LIKE 'attempts:%'")
    assert attempts_before - attempts_after == tallied == 7
    # Three events, plus the two delivery.dead reports of day 0 (a.x and c.x died then).
    assert scalar(engine, "SELECT value FROM pruned_totals WHERE name = 'events'") == 3 + 2
    # Nothing dangles: every attempt still has its delivery.
    assert (
        scalar(
            engine,
            "SELECT count(*) FROM delivery_attempts a "
            "WHERE NOT EXISTS (SELECT 1 FROM deliveries d WHERE d.id = a.delivery_id)",
        )
        == 0
    )

    # Dead letters have their own, longer retention (30 days by default).
    clock.advance(days=21)  # t0 + 29 days
    await retention.run_until_done()
    assert remaining(engine) == {
        ("a.x", "dead", "dead"),
        ("d.x", "flaky", "scheduled"),
        ("a.recent", "dead", "dead"),
    }
    clock.advance(days=2)  # t0 + 31 days: a.x's dead letter is past 30 days, a.recent's not
    await retention.run_until_done()
    assert remaining(engine) == {("d.x", "flaky", "scheduled"), ("a.recent", "dead", "dead")}
    # With dead retention off (0), dead letters stay for ever.
    clock.advance(days=365)
    await Retention(
        async_engine, clock, RetentionConfig(retention_days=7, dead_retention_days=0)
    ).run_until_done()
    assert remaining(engine) == {("d.x", "flaky", "scheduled"), ("a.recent", "dead", "dead")}


async def test_the_running_service_prunes_in_the_background(
    engine: Engine,
    async_engine: AsyncEngine,
    database_url: str,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    add_endpoint(engine, box, receiver.route("/ok"), "*")
    publish_many(engine, "order.created", 3)
    await deliver(async_engine, box, clock)
    clock.advance(days=8)
    service = app.Service(
        database_url,
        box,
        relay=RelayConfig(poll_interval=0.05),
        worker=WorkerConfig(poll_interval=0.05),
        retention=RetentionConfig(retention_days=7, interval=0.05),
        clock=clock,
    )
    stop = asyncio.Event()
    running = asyncio.create_task(service.run(stop))
    try:
        for _ in range(400):  # waiting for the service (at most 20 s), not for the logic
            if not scalar(engine, "SELECT count(*) FROM outbox_events"):
                break
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        await running
    assert scalar(engine, "SELECT count(*) FROM deliveries") == 0
    assert scalar(engine, "SELECT value FROM pruned_totals WHERE name = 'events'") == 3
