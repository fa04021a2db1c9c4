"""The relay's and the worker's updates keep each new row version on its old one's page.

None of these updates is HOT (each changes a column of an index predicate), so each
writes its index entries whatever the page; what the free space on the page saves is
the rest (migration 0047): a new version on the same page is logged as the changed
bytes only, with one page reference, and needs no other page found, locked and
extended. pg_stat_user_tables counts the updates whose new version went to another
page (n_tup_newpage_upd, PostgreSQL 16 and later).
"""

from __future__ import annotations

from sqlalchemy import Engine, text

from delivery.http import build_http_client
from delivery.receiver import Receiver
from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.db import make_async_engine
from outbox.relay import Relay
from outbox.schema import DELIVERIES_FILLFACTOR, EVENTS_FILLFACTOR
from tests.delivery.workers import make_worker
from tests.helpers import LOOPBACK, add_endpoint, scalar, until

# A few pages' worth of rows, the size of a small real event (ids and options).
EVENTS = 150
PAYLOAD = {"order_id": 123456, "customer": "cus_8f3a91", "total": "129.90", "lines": 3}


def updates(engine: Engine, table: str) -> tuple[int, int]:
    """(updates, of which the new version went to another page) on `table` so far."""
    row = (
        engine.connect()
        .execute(
            text("SELECT n_tup_upd, n_tup_newpage_upd FROM pg_stat_user_tables WHERE relname = :t"),
            {"t": table},
        )
        .one()
    )
    return int(row[0]), int(row[1])


async def settled(engine: Engine, table: str, expected: int) -> tuple[int, int]:
    """The counters once every backend that updated `table` has reported (at its exit)."""
    found: list[tuple[int, int]] = []

    def reported() -> bool:
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_stat_clear_snapshot()"))
        found[:] = [updates(engine, table)]
        return found[0][0] >= expected

    await until(reported, f"{expected} updates of {table} in pg_stat_user_tables")
    return found[0]


def reloptions(engine: Engine, table: str) -> list[str]:
    return list(scalar(engine, "SELECT reloptions FROM pg_class WHERE relname = :t", t=table) or [])


async def test_relay_and_worker_updates_stay_on_the_page(
    engine: Engine,
    database_url: str,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    assert reloptions(engine, "deliveries") == [f"fillfactor={DELIVERIES_FILLFACTOR}"]
    assert reloptions(engine, "outbox_events") == [f"fillfactor={EVENTS_FILLFACTOR}"]
    add_endpoint(engine, box, receiver.route("/orders"), "order.*")
    with engine.begin() as conn:
        for _ in range(EVENTS):
            publish(conn, "order.created", PAYLOAD)

    # Its own engine: disposing it ends the backends, which reports their counters.
    async_engine = make_async_engine(database_url)
    try:
        await Relay(async_engine, clock).run_until_idle()
    finally:
        await async_engine.dispose()
    relayed, moved = await settled(engine, "outbox_events", EVENTS)
    assert (relayed, moved) == (EVENTS, 0)

    async_engine = make_async_engine(database_url)
    try:
        async with build_http_client(
            max_connections=10, timeout=5, allowed_networks=LOOPBACK, transport="wire"
        ) as http:
            worker = make_worker(async_engine, http, box, clock, batch_size=EVENTS)
            delivered = 0
            for _ in range(10):
                delivered += (await worker.run_once()).succeeded
                if delivered == EVENTS:
                    break
    finally:
        await async_engine.dispose()
    assert delivered == EVENTS
    # Two updates each: the claim (which adds the lease, so its version is the larger)
    # and the outcome, which fits where the insert's version was pruned.
    assert await settled(engine, "deliveries", 2 * EVENTS) == (2 * EVENTS, 0)
