"""The relay's pass on psycopg directly (outbox/direct.py): the same results and rows as
the same statements through SQLAlchemy, nothing of a plain pass through SQLAlchemy, the
schema check of SQL-published events still on SQLAlchemy in one transaction, and the
pool usable after a failed pass or a backend killed mid-pass. Real PostgreSQL, a manual
clock."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Sequence
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, event, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.util import greenlet_spawn

from outbox import direct, publish
from outbox.catalogue import add_event_type
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.db import libpq_url
from outbox.relay import Capacity, Relay, RelayConfig, RelayResult
from outbox.sql.relay import DELIVERIES_CHANNEL
from tests.helpers import add_endpoint, scalar, until

SQL_PUBLISH = text("SELECT outbox_publish(NULL, :type, CAST(:payload AS jsonb), NULL, NULL, NULL)")

# What a pass writes, read in the pass's own transaction or after its commit; no
# sequence-made ids (a rolled-back reference run used them up): rows by what they are.
_SNAPSHOT = {
    "deliveries": """SELECT event_id, endpoint_id, tenant_id, state, max_attempts,
                            next_attempt_at, priority, ordering_key, locked_by,
                            lease_expires_at, claims
                     FROM deliveries ORDER BY event_id, endpoint_id""",
    "events": """SELECT event_type, payload::text AS payload, relayed_at, rejected_at,
                        validate_pending
                 FROM outbox_events ORDER BY id""",
    "feeds": "SELECT endpoint_id, last_position FROM endpoint_feeds ORDER BY endpoint_id",
    "feed_entries": "SELECT endpoint_id, position, event_id FROM feed_entries ORDER BY 1, 2",
    "skips": "SELECT endpoint_id, event_id FROM filter_skips ORDER BY 1, 2",
    "marks": "SELECT to_jsonb(m)::text AS mark FROM operational_event_marks m ORDER BY 1",
}


async def _snapshot(conn: AsyncConnection) -> dict[str, list[tuple[Any, ...]]]:
    found = {}
    for name, sql in _SNAPSHOT.items():
        found[name] = [tuple(r) for r in await conn.execute(text(sql))]
    return found


def _typed(found: Sequence[Any]) -> list[list[tuple[str, str, Any]]]:
    """Handed-off rows as sorted (column, type, value) lists, without the delivery id."""
    typed = [
        [(k, type(v).__name__, v) for k, v in row._mapping.items() if k != "id"] for row in found
    ]
    return sorted(typed, key=repr)


class _Taker:
    """The relay's handoff as the local worker: keeps what it is handed."""

    def __init__(self, capacity: Capacity) -> None:
        self.capacity = capacity
        self.taken: list[Any] = []

    async def settle(self) -> None:
        return None

    def reserve(self) -> Capacity | None:
        return self.capacity

    async def take(self, capacity: Capacity, rows: Sequence[Any], now: dt.datetime) -> None:
        self.taken.extend(rows)


def _world(engine: Engine, box: SecretBox, now: dt.datetime) -> tuple[int, int]:
    """Fan-out to several endpoints (one filtered, one pull-only with a feed), per-type
    rules, an event a filter cannot evaluate, a held-back summary whose minute is over.
    Returns two endpoint ids for the handoff's per-endpoint slots."""
    ids = []
    for index in range(4):
        created = add_endpoint(engine, box, f"http://127.0.0.1:1/e{index}", "order.*")
        ids.append(created.endpoint.id)
    add_endpoint(engine, box, "http://127.0.0.1:1/f", "*", payload_filter="$.amount >= 100")
    add_endpoint(engine, box, "http://127.0.0.1:1/p", "order.*", delivery_mode="pull")
    with engine.begin() as conn:
        for index in range(6):
            publish(conn, "order.created", {"amount": index * 50}, ordering_key=f"k{index % 2}")
        publish(conn, "order.paid", {"amount": "lots"})  # the filter cannot compare: skipped
        publish(conn, "invoice.paid", {"amount": 500})
        conn.execute(
            text(
                "INSERT INTO operational_event_marks (endpoint_id, kind, window_start, suppressed)"
                " VALUES (:endpoint, 'delivery.dead', :minute, 3)"
            ),
            {"endpoint": ids[0], "minute": (now - dt.timedelta(minutes=2)).replace(second=0)},
        )
    return ids[0], ids[1]


CASES = {
    "batch": None,
    "handoff": lambda now, ids: Capacity(
        limit=9,
        worker_id="w-direct",
        lease_expires_at=now + dt.timedelta(seconds=60),
        endpoint_slots=3,
        slots_left={ids[0]: 1, ids[1]: 0},
    ),
    "handoff-none-fits": lambda now, ids: Capacity(
        limit=5,
        worker_id="w-direct",
        lease_expires_at=now + dt.timedelta(seconds=60),
        endpoint_slots=0,
        slots_left={},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_a_direct_pass_writes_and_answers_what_the_sqlalchemy_pass_does(
    engine: Engine,
    async_engine: AsyncEngine,
    database_url: str,
    clock: ManualClock,
    box: SecretBox,
    case: str,
) -> None:
    now = clock.now()
    ids = _world(engine, box, now)
    make = CASES[case]
    capacity = make(now, ids) if make is not None else None
    config = RelayConfig(batch_size=50, max_attempts_by_event_type={"order.*": 3, "*": 5})
    taker = _Taker(capacity) if capacity is not None else None
    relay = Relay(async_engine, clock, config, handoff=taker)

    # The reference: the same pass through SQLAlchemy, rolled back.
    async with async_engine.connect() as conn, conn.begin() as transaction:
        expected, expected_handed = await relay._relay(conn, now, capacity, flush=True)
        expected_rows = await _snapshot(conn)
        await transaction.rollback()

    through_sqlalchemy: list[str] = []
    seen = lambda *args: through_sqlalchemy.append(args[2])  # noqa: E731
    event.listen(async_engine.sync_engine, "before_cursor_execute", seen)
    with psycopg.connect(libpq_url(database_url), autocommit=True) as listener:
        listener.execute(f'LISTEN "{DELIVERIES_CHANNEL}"')
        try:
            result = await relay.run_once()
        finally:
            event.remove(async_engine.sync_engine, "before_cursor_execute", seen)
        # scheduled deliveries wake the workers (committed: the listener has it)
        woken = sum(1 for _ in listener.notifies(timeout=10, stop_after=1))
    assert through_sqlalchemy == []  # the whole pass went to psycopg directly
    assert woken == 1 and expected.deliveries > expected.handed_off
    async with async_engine.connect() as conn:
        rows = await _snapshot(conn)

    assert result == expected
    assert rows == expected_rows
    assert _typed(taker.taken if taker else []) == _typed(expected_handed)
    # the case says something: fan-out, feeds, skips, the summary published
    assert result.deliveries > result.events > 0 and result.fed and result.skipped
    assert any(r[0] == "delivery.dead" for r in rows["events"])
    assert (result.handed_off > 0) is (case == "handoff")
    assert 0 < result.handed_off < result.deliveries or case != "handoff"


async def test_sql_published_events_waiting_for_their_check_take_the_sqlalchemy_pass(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    """The direct pass sees events awaiting their schema check, rolls back, and the
    pass runs on SQLAlchemy with the check, in one transaction: the same as the
    reference, with the broken events rejected."""
    add_endpoint(engine, box, "http://127.0.0.1:1/orders", "order.*")
    with engine.begin() as conn:
        schema = {"type": "object", "properties": {"id": {"type": "integer"}}}
        add_event_type(conn, "order.created", schema=schema, actor="t")
        publish(conn, "order.created", {"id": 1})
        for event_type, payload in [
            ("order.created", '{"id": "one"}'),
            ("order.unknown", "{}"),
            ("order.created", '{"id": 3}'),
        ]:
            conn.execute(SQL_PUBLISH, {"type": event_type, "payload": payload})
    now = clock.now()
    relay = Relay(async_engine, clock, RelayConfig(event_types_mode="strict"))

    async with async_engine.connect() as reference, reference.begin() as transaction:
        expected, _ = await relay._relay(reference, now, None, flush=True)
        expected_rows = await _snapshot(reference)
        await transaction.rollback()
    assert expected == RelayResult(events=2, deliveries=2, rejected=2)

    result = await relay.run_once()
    async with async_engine.connect() as after:
        rows = await _snapshot(after)
    assert (result, rows) == (expected, expected_rows)
    assert async_engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    assert await relay.run_once() == RelayResult(0, 0)


async def _pooled_autocommit(async_engine: AsyncEngine) -> bool:
    pooled = await async_engine.raw_connection()
    try:
        return bool(pooled.driver_connection.autocommit)  # type: ignore[union-attr]
    finally:
        await greenlet_spawn(pooled.close)


async def test_a_failed_pass_and_a_backend_killed_mid_pass_leave_the_pool_usable(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    """A statement error rolls the pass back and its connection goes back to the pool;
    a pass whose server process is killed while it waits fails, and the next pass gets
    a working connection and relays everything, once."""
    add_endpoint(engine, box, "http://127.0.0.1:1/p", "order.*", delivery_mode="pull")
    with engine.begin() as conn:
        for index in range(3):
            publish(conn, "order.created", {"i": index})
    broken = RelayConfig(max_attempts_by_event_type={"order.*": "three"})  # type: ignore[dict-item]
    with pytest.raises(Exception, match="invalid input syntax for type integer"):
        await Relay(async_engine, clock, broken).run_once()
    assert async_engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    assert await _pooled_autocommit(async_engine) is False
    assert scalar(engine, "SELECT count(*) FROM outbox_events WHERE relayed_at IS NULL") == 3

    relay = Relay(async_engine, clock)
    # Hold the pull endpoint's feed row: the pass waits for its lock inside its statement.
    blocker = engine.connect()
    try:
        blocker.execute(text("SELECT 1 FROM endpoint_feeds FOR UPDATE"))
        waiting = asyncio.create_task(relay.run_once())

        def relay_backend() -> int | None:
            found = scalar(
                engine,
                "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND query LIKE '%WITH batch AS%'",  # the relay's statement (its head)
            )
            return int(found) if found is not None else None

        await until(lambda: relay_backend() is not None, "the pass waiting for the feed lock")
        assert scalar(engine, "SELECT pg_terminate_backend(:pid)", pid=relay_backend()) is True
        with pytest.raises(Exception, match=r"terminat|closed|lost"):
            await waiting
    finally:
        blocker.rollback()
        blocker.close()
    assert async_engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    assert await relay.run_once() == RelayResult(events=3, deliveries=0, fed=3)
    assert scalar(engine, "SELECT count(*) FROM feed_entries") == 3
    assert await relay.run_once() == RelayResult(0, 0)


async def test_while_events_wait_for_their_check_the_passes_start_on_sqlalchemy(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An application publishing from SQL keeps events waiting for their check: after a
    pass that left some, the next starts on SQLAlchemy (no direct pass found and rolled
    back each time); once none are left, passes are direct again."""
    add_endpoint(engine, box, "http://127.0.0.1:1/orders", "order.*")
    with engine.begin() as conn:
        for index in range(3):
            conn.execute(SQL_PUBLISH, {"type": "order.created", "payload": f'{{"i": {index}}}'})
    direct_passes: list[bool] = []
    borrowed = direct.transaction

    def counted(engine: AsyncEngine, **options: Any) -> Any:
        direct_passes.append(True)
        return borrowed(engine, **options)

    monkeypatch.setattr(direct, "transaction", counted)
    relay = Relay(async_engine, clock, RelayConfig(batch_size=2))
    assert await relay.run_once() == RelayResult(events=2, deliveries=2)  # one left unchecked
    assert len(direct_passes) == 1  # found them, rolled back, ran on SQLAlchemy
    assert await relay.run_once() == RelayResult(events=1, deliveries=1)
    assert len(direct_passes) == 1  # straight to SQLAlchemy
    assert await relay.run_once() == RelayResult(0, 0)
    assert len(direct_passes) == 2  # none left: direct again
