"""Stats and alert signals computed from the database, checked against the raw rows."""

from __future__ import annotations

import datetime as dt
import statistics
from dataclasses import replace

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.receiver import Receiver
from delivery.retention import Retention, RetentionConfig
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.publish import publish
from outbox.relay import Relay
from outbox.schema import LATENCY_BUCKETS
from outbox.stats import (
    OTHER_OWNERS,
    UNOWNED,
    AlertThresholds,
    Totals,
    WorkflowHealth,
    collect_stats,
    evaluate_alerts,
    read_totals,
)
from outbox.tenants import create_tenant
from outbox.workflows import Workflow
from tests.helpers import add_endpoint, disable, rows, scalar
from tests.operator_helpers import deliver, publish_many


def firing(engine: Engine, clock: ManualClock, limits: AlertThresholds) -> set[str]:
    with engine.connect() as conn:
        stats = collect_stats(conn, now=clock.now(), thresholds=limits)
    return {alert.name for alert in stats.firing}


async def test_counts_rates_and_latency_match_the_rows(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    fast = add_endpoint(engine, box, receiver.route("/fast"), "*")
    add_endpoint(engine, box, receiver.route("/flaky", status=502), "order.*")
    publish_many(engine, "order.created", 4)
    publish_many(engine, "invoice.paid", 2)
    await deliver(async_engine, box, clock)
    # Events take the database's real time (created_at), attempts the manual clock: read
    # a minute later, so a slow machine's real seconds cannot push events past `now`.
    clock.advance(60)
    with engine.connect() as conn:
        stats = collect_stats(conn, now=clock.now(), window=dt.timedelta(minutes=10))

    assert stats.counts_by_state == {
        "scheduled": 4,
        "in_flight": 0,
        "succeeded": 6,
        "dead": 0,
        "discarded": 0,
        "held": 0,
    }
    assert stats.window["attempts"] == 10 and stats.window["published"] == 6
    assert stats.per_minute["attempts"] == 1.0  # 10 attempts over 10 minutes
    health = {e.uid: e for e in stats.endpoints}[fast.endpoint.uid]
    durations = [
        r["duration_ms"]
        for r in rows(
            engine,
            "SELECT a.duration_ms FROM delivery_attempts a JOIN deliveries d "
            "ON d.id = a.delivery_id JOIN endpoints e ON e.id = d.endpoint_id WHERE e.uid = :u",
            u=fast.endpoint.uid,
        )
    ]
    assert (health.attempts, health.success_rate, health.pending) == (6, 1.0, 0)
    assert health.p50_ms == statistics.median(durations)
    [flaky] = [e for e in stats.endpoints if e.uid != fast.endpoint.uid]
    assert (flaky.error_rate, flaky.pending) == (1.0, 4)
    [top] = stats.top_errors
    assert (top.error, top.deliveries, top.endpoints) == ("HTTP 502 Bad Gateway", 4, 1)
    # Outside the window nothing counts, but the backlog is still the backlog.
    clock.advance(minutes=11)
    with engine.connect() as conn:
        later = collect_stats(conn, now=clock.now(), window=dt.timedelta(minutes=10))
    assert later.window["attempts"] == 0 and later.top_errors == []
    assert later.counts_by_state["scheduled"] == 4


async def test_each_alert_signal_fires_at_its_threshold(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    limits = AlertThresholds(
        dead_per_window=3, repeated_error_deliveries=3, oldest_due_seconds=600,
        relay_lag_seconds=30,
    )  # fmt: skip
    assert firing(engine, clock, limits) == set()

    gone = add_endpoint(engine, box, receiver.route("/gone", status=404), "gone.*")
    publish_many(engine, "gone.x", 2)
    await deliver(async_engine, box, clock)
    assert firing(engine, clock, limits) == set()  # 2 dead, 2 repeated: under both thresholds
    publish_many(engine, "gone.x", 1)
    await deliver(async_engine, box, clock)
    assert firing(engine, clock, limits) == {"dead_letters_rising", "repeated_error"}

    # A retrying delivery waits; once it is due and untouched for 10 minutes, it alerts.
    add_endpoint(engine, box, receiver.route("/slow", status=503), "slow.*")
    publish_many(engine, "slow.x")
    await deliver(async_engine, box, clock)
    due_at = scalar(engine, "SELECT next_attempt_at FROM deliveries WHERE state = 'scheduled'")
    clock.set(due_at + dt.timedelta(seconds=599))
    assert "oldest_due_delivery" not in firing(engine, clock, limits)
    clock.advance(1)
    assert "oldest_due_delivery" in firing(engine, clock, limits)

    # Relay lag: an event nobody relayed, older than the threshold.
    publish_many(engine, "slow.y")
    created = scalar(engine, "SELECT max(created_at) FROM outbox_events")
    clock.set(created + dt.timedelta(seconds=31))
    assert "relay_lag" in firing(engine, clock, limits)

    # An operator's disable is not an alert; a disable with no operator behind it is.
    disable(engine, gone.endpoint.uid)
    assert "endpoint_auto_disabled" not in firing(engine, clock, limits)
    with engine.begin() as conn:
        # What the worker does on a 410: disable, with an automatic audit row.
        conn.execute(
            text(
                "UPDATE endpoints SET enabled = false, disabled_reason = 'HTTP 410 Gone', "
                "disabled_at = now() WHERE url LIKE '%/slow'"
            )
        )
        conn.execute(
            text(
                "INSERT INTO audit_log (actor, action, target_type, target_id, details) "
                "SELECT 'worker:w1', 'endpoint.disable', 'endpoint', uid, "
                "'{\"automatic\": true}' FROM endpoints WHERE url LIKE '%/slow'"
            )
        )
    assert "endpoint_auto_disabled" in firing(engine, clock, limits)
    with engine.connect() as conn:
        stats = collect_stats(conn, now=clock.now(), thresholds=limits)
    assert [e.url.rsplit("/", 1)[-1] for e in stats.endpoints if e.auto_disabled] == ["slow"]


async def test_metric_totals_count_bucket_edges_and_survive_pruning(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    add_endpoint(engine, box, "http://127.0.0.1:9/never", "*")
    publish_many(engine, "order.created", 3)
    await Relay(async_engine, clock).run_until_idle()
    durations = [50, 51, 250, 30_000, 30_001]
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE deliveries SET state = 'succeeded', completed_at = :at "
                "WHERE id = (SELECT min(id) FROM deliveries)"
            ),
            {"at": clock.now()},
        )
        for number, duration in enumerate(durations, 1):
            conn.execute(
                text(
                    "INSERT INTO delivery_attempts (delivery_id, attempt_number, started_at, "
                    "duration_ms, outcome, worker_id) SELECT min(id), :n, :at, :ms, "
                    "CASE WHEN :n = 5 THEN 'succeeded' ELSE 'retryable' END, 'w' FROM deliveries"
                ),
                {"n": number, "at": clock.now(), "ms": duration},
            )
    with engine.connect() as conn:
        before = read_totals(conn, LATENCY_BUCKETS)
    buckets = dict(before.latency_buckets)
    assert (buckets[0.05], buckets[0.1], buckets[0.25], buckets[10.0], buckets[30.0]) == (
        1,
        2,
        3,
        3,
        4,
    )
    assert before.latency_count == 5
    assert before.latency_sum_seconds == pytest.approx(sum(durations) / 1000)
    assert before.attempts_by_outcome == {
        "succeeded": 1,
        "retryable": 4,
        "permanent": 0,
        "ambiguous": 0,
    }
    assert (before.events_published, before.events_relayed) == (3, 3)

    clock.advance(days=8)
    pruned = await Retention(
        async_engine, clock, RetentionConfig(retention_days=7)
    ).run_until_done()
    assert (pruned.deliveries, pruned.attempts) == (1, 5)
    assert scalar(engine, "SELECT count(*) FROM delivery_attempts") == 0
    with engine.connect() as conn:
        after = read_totals(conn, LATENCY_BUCKETS)
    assert after.latency_sum_seconds == pytest.approx(before.latency_sum_seconds)
    assert replace(after, latency_sum_seconds=0) == replace(before, latency_sum_seconds=0)


async def test_tenant_scoped_totals_survive_pruning_and_stay_apart(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    """Retention tallies per tenant: a scoped scrape's counters never go backwards, and
    one tenant's pruned history never shows in another's."""
    with engine.begin() as conn:
        create_tenant(conn, "seller-7")
        create_tenant(conn, "seller-8")
    add_endpoint(engine, box, receiver.route("/seven"), "*", tenant="seller-7")
    add_endpoint(engine, box, receiver.route("/eight", status=500), "*", tenant="seller-8")
    with engine.begin() as conn:
        for n in range(3):
            publish(conn, "order.created", {"n": n}, tenant="seller-7")
        publish(conn, "order.created", {"n": 9}, tenant="seller-8")
    await deliver(async_engine, box, clock)

    def totals(scope: str | None) -> Totals:
        with engine.connect() as conn:
            return read_totals(conn, LATENCY_BUCKETS, scope=scope)

    before = {scope: totals(scope) for scope in ("seller-7", "seller-8", None)}
    assert before["seller-7"].attempts_by_outcome["succeeded"] == 3
    assert before["seller-7"].events_published == 3
    assert before["seller-8"].attempts_by_outcome == {
        "succeeded": 0, "retryable": 1, "permanent": 0, "ambiguous": 0,
    }  # fmt: skip
    clock.advance(days=8)
    retention = Retention(async_engine, clock, RetentionConfig(retention_days=7))
    pruned = await retention.run_until_done()
    assert (pruned.deliveries, pruned.events) == (3, 3)  # seller-8's delivery is still pending
    assert scalar(engine, "SELECT count(*) FROM outbox_events") == 1
    for scope in ("seller-7", "seller-8", None):
        after = totals(scope)
        assert after.latency_sum_seconds == pytest.approx(before[scope].latency_sum_seconds)
        assert replace(after, latency_sum_seconds=0) == replace(
            before[scope], latency_sum_seconds=0
        ), scope


def test_alerts_about_dead_and_held_deliveries_say_whose_they_are(
    engine: Engine, clock: ManualClock
) -> None:
    """Each signal about dead or held deliveries names the owners, and says "no owner"
    (not the metrics label) for deliveries nobody owns."""
    with engine.connect() as conn:
        empty = collect_stats(conn, now=clock.now())
    stats = replace(
        empty,
        counts_by_state={**empty.counts_by_state, "held": 3},
        dead_by_owner={"shipping": 2, UNOWNED: 1},
        held_by_owner={"payments": 1, UNOWNED: 1, OTHER_OWNERS: 1},
        workflows=[
            WorkflowHealth(
                event_type=name,
                owner=owner,
                oldest_due_age_seconds=None,
                attempts=4,
                error_rate=0.5,
                processing_p95_seconds=None,
                thresholds=Workflow(name, "retry", owner, None, 0.2, None),
            )
            for name, owner in (("invoice.paid", "billing"), ("misc.thing", None))
        ],
    )
    messages = {alert.name: alert.message for alert in evaluate_alerts(stats, AlertThresholds())}
    assert messages["dead_letters_rising"] == (
        "no delivery went dead in the last 60 min; dead now by owner: shipping: 2, no owner: 1"
    )
    assert messages["deliveries_held"] == (
        "3 deliveries held for review, by owner: payments: 1, no owner: 1, other owners: 1; "
        "`outbox deliveries list --state held` shows them"
    )
    assert messages["workflow_error_rate:invoice.paid"].startswith("invoice.paid (owner billing):")
    assert messages["workflow_error_rate:misc.thing"].startswith("misc.thing (no owner):")
