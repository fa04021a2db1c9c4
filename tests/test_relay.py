"""The relay fans each committed event out exactly once to every matching, enabled endpoint."""

from __future__ import annotations

import asyncio

from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.relay import Relay, RelayConfig
from tests.helpers import add_endpoint, disable, rows, scalar


async def test_fans_out_to_matching_enabled_endpoints_only(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    orders = add_endpoint(engine, box, "http://127.0.0.1:1/orders", "order.*")
    invoices = add_endpoint(engine, box, "http://127.0.0.1:1/inv", "invoice.paid")
    everything = add_endpoint(engine, box, "http://127.0.0.1:1/all", "*")
    off = add_endpoint(engine, box, "http://127.0.0.1:1/off", "*")
    disable(engine, off.endpoint.uid)
    with engine.begin() as conn:
        publish(conn, "order.created", {"id": 1})
        publish(conn, "order.line.added", {"id": 1})
        publish(conn, "invoice.paid", {"id": 2})
        publish(conn, "invoice.voided", {"id": 3})
        publish(conn, "orders", {"id": 4})  # not matched by 'order.*'

    result = await Relay(async_engine, clock).run_until_idle()

    # Six events: disabling `off` published an endpoint.disabled, which '*' does not match.
    assert (result.events, result.deliveries) == (6, 8)
    fanned = rows(
        engine,
        """SELECT e.uid, ev.event_type FROM deliveries d
           JOIN endpoints e ON e.id = d.endpoint_id JOIN outbox_events ev ON ev.id = d.event_id""",
    )
    by_endpoint: dict[str, set[str]] = {}
    for row in fanned:
        by_endpoint.setdefault(row["uid"], set()).add(row["event_type"])
    assert by_endpoint == {
        orders.endpoint.uid: {"order.created", "order.line.added"},
        invoices.endpoint.uid: {"invoice.paid"},
        everything.endpoint.uid: {
            "order.created",
            "order.line.added",
            "invoice.paid",
            "invoice.voided",
            "orders",
        },
    }
    assert scalar(engine, "SELECT count(*) FROM outbox_events WHERE relayed_at IS NULL") == 0
    # Relaying again finds nothing: no event is fanned out twice.
    assert (await Relay(async_engine, clock).run_once()).deliveries == 0


async def test_event_committed_after_a_later_id_was_relayed_is_not_skipped(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    add_endpoint(engine, box, "http://127.0.0.1:1/all", "*")
    relay = Relay(async_engine, clock)
    slow = engine.connect()
    slow_tx = slow.begin()
    publish(slow, "order.created", {"which": "slow, lower id"})
    with engine.begin() as conn:
        publish(conn, "order.created", {"which": "fast, higher id"})
    assert (await relay.run_once()).events == 1
    slow_tx.commit()
    slow.close()
    assert (await relay.run_once()).events == 1
    payloads = rows(
        engine,
        "SELECT ev.payload FROM deliveries d JOIN outbox_events ev ON ev.id = d.event_id",
    )
    assert sorted(row["payload"]["which"] for row in payloads) == [
        "fast, higher id",
        "slow, lower id",
    ]


async def test_concurrent_relays_neither_duplicate_nor_skip(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    for index in range(3):
        add_endpoint(engine, box, f"http://127.0.0.1:1/{index}", "*")
    with engine.begin() as conn:
        for index in range(600):
            publish(conn, "order.created", {"i": index})
    config = RelayConfig(batch_size=25)
    relays = [Relay(async_engine, clock, config) for _ in range(3)]
    results = await asyncio.gather(*(relay.run_until_idle() for relay in relays))
    assert sum(result.events for result in results) == 600
    assert scalar(engine, "SELECT count(*) FROM deliveries") == 1800
    assert (
        scalar(
            engine,
            "SELECT count(*) FROM (SELECT event_id, endpoint_id FROM deliveries"
            " GROUP BY 1, 2 HAVING count(*) > 1) AS dup",
        )
        == 0
    )


async def test_relay_lingers_after_a_backlog_then_sleeps_until_woken(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    """publish() only wakes an idle relay, so a busy relay must look again before sleeping."""
    add_endpoint(engine, box, "http://127.0.0.1:1/all", "*")
    relay = Relay(async_engine, clock, RelayConfig(poll_interval=30.0, linger=0.5))
    stop, wake = asyncio.Event(), asyncio.Event()

    def relayed() -> int:
        return int(
            scalar(engine, "SELECT count(*) FROM outbox_events WHERE relayed_at IS NOT NULL")
        )

    async def until(count: int) -> None:
        for _ in range(100):
            if relayed() >= count:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"only {relayed()} of {count} relayed")

    task = asyncio.create_task(relay.run(stop, wake))
    try:
        await asyncio.sleep(0.1)  # the first, empty pass; now asleep for the poll interval
        with engine.begin() as conn:
            publish(conn, "order.created", {"id": 1})
        wake.set()
        await until(1)
        with engine.begin() as conn:
            publish(conn, "order.created", {"id": 2})  # no wake-up: found by the linger pass
        await until(2)
        await asyncio.sleep(0.8)  # the linger pass found nothing: asleep again
        with engine.begin() as conn:
            publish(conn, "order.created", {"id": 3})
        await asyncio.sleep(0.3)
        assert relayed() == 2
        wake.set()
        await until(3)
    finally:
        stop.set()
        await task
