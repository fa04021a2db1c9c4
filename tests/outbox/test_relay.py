"""The relay fans each committed event out exactly once to every matching, enabled endpoint."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging

import pytest
from sqlalchemy import Engine, event, text
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import publish
from outbox.catalogue import add_event_type
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.relay import Relay, RelayConfig, RelayResult
from tests.helpers import add_endpoint, disable, rows, scalar, until


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
    passes: list[int] = []  # events relayed by each pass, in order

    class CountingRelay(Relay):
        async def run_once(self) -> RelayResult:
            result = await super().run_once()
            passes.append(result.events)
            return result

    relay = CountingRelay(async_engine, clock, RelayConfig(poll_interval=30.0, linger=0.5))
    stop, wake = asyncio.Event(), asyncio.Event()

    def relayed() -> int:
        return int(
            scalar(engine, "SELECT count(*) FROM outbox_events WHERE relayed_at IS NOT NULL")
        )

    def asleep_after_backlog() -> bool:
        """The pass after the last busy one and the linger pass after it found nothing."""
        busy = max(i for i, events in enumerate(passes) if events)
        return len(passes) >= busy + 3

    task = asyncio.create_task(relay.run(stop, wake))
    try:
        await until(lambda: passes, "the first, empty pass")  # now asleep for the poll
        with engine.begin() as conn:
            publish(conn, "order.created", {"id": 1})
        wake.set()
        await until(lambda: relayed() >= 1, "event 1 relayed")
        with engine.begin() as conn:
            publish(conn, "order.created", {"id": 2})  # no wake-up: found by the linger pass
        await until(lambda: relayed() >= 2, "event 2 relayed")
        await until(asleep_after_backlog, "the linger pass to find nothing")
        ran = len(passes)
        with engine.begin() as conn:
            publish(conn, "order.created", {"id": 3})
        # Asleep for the 30 s poll is the behaviour under test: a window (not a wait for
        # an event) in which a relay that kept looking would run a pass.
        await asyncio.sleep(0.3)
        assert relayed() == 2
        assert len(passes) == ran
        wake.set()
        await until(lambda: relayed() >= 3, "event 3 relayed")
    finally:
        stop.set()
        await task


async def test_a_busy_relay_keeps_one_connection_for_its_passes_and_returns_it_when_idle(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    """Events arriving one by one, each woken: every pass of that busy spell runs on one
    connection taken from the pool once (no checkout and pre-ping per pass); once the
    relay goes idle, the connection is back in the pool."""
    add_endpoint(engine, box, "http://127.0.0.1:1/all", "*")
    passes: list[int] = []

    class CountingRelay(Relay):
        async def run_once(self) -> RelayResult:
            result = await super().run_once()
            passes.append(result.events)
            return result

    checkouts: list[object] = []
    event.listen(async_engine.sync_engine.pool, "checkout", lambda *args: checkouts.append(1))
    relay = CountingRelay(async_engine, clock, RelayConfig(poll_interval=30.0, linger=30.0))
    stop, wake = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(relay.run(stop, wake))
    try:
        await until(lambda: passes, "the first, empty pass")
        await until(lambda: async_engine.pool.checkedout() == 0, "idle: connection returned")  # type: ignore[attr-defined]
        checkouts.clear()
        for n in range(1, 5):
            with engine.begin() as conn:
                publish(conn, "order.created", {"n": n})
            wake.set()
            await until(lambda n=n: sum(passes) >= n, f"event {n} relayed")
            await until(lambda: passes[-1] == 0, "the pass after it")  # lingering now
        assert len(passes) >= 9  # the first, then a pass with an event and one without, x4
        assert len(checkouts) == 1
        assert async_engine.pool.checkedout() == 1  # type: ignore[attr-defined]
    finally:
        stop.set()
        await task
    assert async_engine.pool.checkedout() == 0  # type: ignore[attr-defined]


async def test_run_until_idle_adds_up_every_batch_and_each_pass_with_deliveries_wakes_workers(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    add_endpoint(engine, box, "http://127.0.0.1:1/orders", "order.*")
    with engine.begin() as conn:
        for n in range(5):
            publish(conn, "order.created", {"n": n})
    woken: list[int] = []
    relay = Relay(
        async_engine, clock, RelayConfig(batch_size=2), on_deliveries=lambda: woken.append(1)
    )
    result = await relay.run_until_idle()
    assert (result.events, result.deliveries, result.rejected) == (5, 5, 0)
    assert len(woken) == 3  # passes of 2, 2 and 1 events
    with engine.begin() as conn:
        publish(conn, "invoice.paid", {})  # no endpoint subscribes: nothing to wake for
    assert (await relay.run_until_idle()).deliveries == 0
    assert len(woken) == 3


class RanPastItsStop(BaseException):
    pass


class ScriptedRelay(Relay):
    """The real `run` loop around scripted passes: the loop's pacing is under test."""

    def __init__(self, script: list[int | Exception], stop: asyncio.Event, wake: asyncio.Event):
        config = RelayConfig(batch_size=10, poll_interval=1.0, linger=0.05, gather=0.01)
        super().__init__(None, ManualClock(), config)  # type: ignore[arg-type]
        self.script, self.stop, self.wake = script, stop, wake
        self.woken_at_start: list[bool] = []

    async def run_once(self) -> RelayResult:
        if not self.script:
            raise RanPastItsStop  # not an Exception: the loop must not swallow it
        self.woken_at_start.append(self.wake.is_set())
        self.wake.set()  # a NOTIFY that arrives during the pass
        step = self.script.pop(0)
        if not self.script:
            self.stop.set()
        if isinstance(step, Exception):
            raise step
        return RelayResult(events=step, deliveries=step)


async def test_the_loop_continues_through_a_backlog_gathers_after_a_partial_batch_and_lingers(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    waits: list[tuple[str, float]] = []
    stop, wake = asyncio.Event(), asyncio.Event()

    async def record(*events: asyncio.Event, timeout: float) -> None:  # noqa: ASYNC109
        names = {id(stop): "stop", id(wake): "wake"}
        waits.append(("+".join(names[id(e)] for e in events), timeout))

    monkeypatch.setattr("outbox.relay.wait_for_any", record)
    caplog.set_level(logging.ERROR, logger="outbox.database")
    # idle, a full batch, a partial one, idle twice, a failing pass, idle
    relay = ScriptedRelay([0, 10, 3, 0, 0, RuntimeError("a bug"), 0], stop, wake)
    await relay.run(stop, wake)
    assert waits == [
        ("stop+wake", 1.0),  # idle from the start: the poll interval
        # a full batch: straight on, no wait (publishers do not notify during a backlog)
        ("stop", 0.01),  # a partial batch: gather a little, a wake-up cannot cut it short
        ("stop+wake", 0.05),  # the first idle pass after work: linger
        ("stop+wake", 1.0),  # idle again: the poll interval
        ("stop+wake", 1.0),  # a failed pass counts as idle
        ("stop+wake", 1.0),
    ]
    assert relay.woken_at_start == [False] * 7  # each pass forgets earlier wake-ups
    failures = [r for r in caplog.records if r.name == "outbox.database"]
    assert [(r.getMessage(), r.exc_info is not None) for r in failures] == [
        ("relay failed; retrying", True)  # with the traceback: a bug, not an outage
    ]


SQL_PUBLISH = text("SELECT outbox_publish(NULL, :type, CAST(:payload AS jsonb), NULL, NULL, NULL)")


def _python_and_sql_events(engine: Engine, box: SecretBox) -> None:
    """Ids in order: two publish() events, a schema-breaking and an unknown-type event
    from SQL, a valid one from SQL, one more publish() event."""
    add_endpoint(engine, box, "http://127.0.0.1:1/orders", "order.*")
    with engine.begin() as conn:
        schema = {"type": "object", "properties": {"id": {"type": "integer"}}}
        add_event_type(conn, "order.created", schema=schema, actor="t")
        publish(conn, "order.created", {"id": 1})
        publish(conn, "order.created", {"id": 2})
        for event_type, payload in [
            ("order.created", '{"id": "one"}'),
            ("order.unknown", "{}"),
            ("order.created", '{"id": 3}'),
        ]:
            conn.execute(SQL_PUBLISH, {"type": event_type, "payload": payload})
        publish(conn, "order.created", {"id": 4})


async def test_a_pass_checks_a_batch_of_sql_published_events_and_relays_the_valid_ones(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    caplog: pytest.LogCaptureFixture,
) -> None:
    _python_and_sql_events(engine, box)
    relay = Relay(async_engine, clock, RelayConfig(batch_size=2, event_types_mode="strict"))
    caplog.set_level(logging.WARNING, logger="outbox.relay")
    # Pass 1: the two publish() events; then the schema check of at most a batch (the
    # broken and the unknown type: rejected); then what is ready (the last publish()).
    assert await relay.run_once() == RelayResult(events=3, deliveries=3, rejected=2)
    assert [r.getMessage() for r in caplog.records if r.name == "outbox.relay"] == [
        "2 events broke their event type's schema and were rejected; "
        "`outbox events rejected` lists them"
    ]
    rejected = rows(
        engine, "SELECT rejected_at, relayed_at FROM outbox_events WHERE rejected_at IS NOT NULL"
    )
    assert [(r["rejected_at"], r["relayed_at"]) for r in rejected] == [(clock.now(),) * 2] * 2
    # Pass 2: the valid SQL event, checked, then relayed in the same pass.
    assert await relay.run_once() == RelayResult(events=1, deliveries=1, rejected=0)
    assert await relay.run_once() == RelayResult(events=0, deliveries=0, rejected=0)
    assert len(caplog.records) == 1


async def test_run_until_idle_adds_up_the_rejected_of_every_pass(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    _python_and_sql_events(engine, box)
    relay = Relay(async_engine, clock, RelayConfig(batch_size=2, event_types_mode="strict"))
    assert await relay.run_until_idle() == RelayResult(events=4, deliveries=4, rejected=2)


async def test_held_back_dead_summaries_are_flushed_once_per_summary_interval(
    engine: Engine, async_engine: AsyncEngine, box: SecretBox
) -> None:
    """A minute's held-back delivery.dead reports go out as one summary after the minute;
    the relay looks for them on its first pass and then every `summary_interval`."""
    endpoint = add_endpoint(engine, box, "http://127.0.0.1:1/orders", "order.*").endpoint
    start = dt.datetime(2030, 1, 1, 12, 0, 55, tzinfo=dt.UTC)
    clock = ManualClock(start)

    def summaries() -> int:
        return int(
            scalar(
                engine,
                "SELECT count(*) FROM outbox_events WHERE event_type = 'delivery.dead'"
                " AND (payload ->> 'summary')::boolean",
            )
        )

    relay = Relay(async_engine, clock, RelayConfig(summary_interval=10.0))
    await relay.run_once()  # the first pass looks; the next look is due at 12:01:05
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO operational_event_marks (endpoint_id, kind, window_start, suppressed)"
                " SELECT id, 'delivery.dead', :minute, 2 FROM endpoints WHERE uid = :uid"
            ),
            {"minute": start.replace(second=0), "uid": endpoint.uid},
        )
    clock.advance(6)  # 12:01:01: the minute is over, but the interval is not
    await relay.run_once()
    assert summaries() == 0
    clock.advance(4)  # 12:01:05: the interval is up, to the second
    await relay.run_once()
    assert summaries() == 1
