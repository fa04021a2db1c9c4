"""Stats and alert signals computed from the database, checked against the raw rows."""

from __future__ import annotations

import datetime as dt
import statistics

from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.receiver import Receiver
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.stats import AlertThresholds, collect_stats
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
    clock.advance(1)
    with engine.connect() as conn:
        stats = collect_stats(conn, now=clock.now(), window=dt.timedelta(minutes=10))

    assert stats.counts_by_state == {
        "scheduled": 4,
        "in_flight": 0,
        "succeeded": 6,
        "dead": 0,
        "discarded": 0,
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
        conn.execute(
            text(
                "UPDATE endpoints SET enabled = false, disabled_reason = 'HTTP 410 Gone', "
                "disabled_at = now() WHERE url LIKE '%/slow'"
            )
        )
    assert "endpoint_auto_disabled" in firing(engine, clock, limits)
