"""The relay hands fresh deliveries straight to the worker of its own process.

Deliveries a claim would take at once (an ungated, unordered endpoint of an enabled,
uncapped tenant, within the worker's free slots) are inserted already claimed for
that worker in the relay's transaction: no NOTIFY, no claim transaction. They are
leased and fenced like any claimed delivery, so a crash after the relay's commit
loses nothing and a late outcome never overwrites a rescue.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
from collections.abc import AsyncIterator, Sequence
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, event, text
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.health import EndpointLimits, set_endpoint_limits
from delivery.http import build_http_client
from delivery.operator.app import Service
from delivery.reaper import Reaper
from delivery.receiver import Receiver
from delivery.worker import Worker, WorkerConfig
from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.db import make_async_engine
from outbox.endpoints import rotate_secret
from outbox.relay import Capacity, Relay, RelayConfig
from outbox.tenants import create_tenant, set_tenant_enabled, update_tenant
from tests.helpers import LOOPBACK, add_endpoint, rows, scalar, until

POLL = 60.0  # far longer than any test here may take


class Recorder:
    """Stands in for a worker that dies right after the relay's commit: it reserves
    slots and is handed rows, and never attempts them."""

    def __init__(self, clock: ManualClock, **capacity: Any) -> None:
        self.capacity = Capacity(
            **{
                "limit": 100,
                "worker_id": "w-dead",
                "lease_expires_at": clock.now() + dt.timedelta(seconds=60),
                "endpoint_slots": 100,
                "slots_left": {},
                **capacity,
            }
        )
        self.taken: list[list[Any]] = []

    async def settle(self) -> None:
        return None

    def reserve(self) -> Capacity | None:
        return self.capacity

    async def take(self, capacity: Capacity, rows: Sequence[Any], now: dt.datetime) -> None:
        self.taken.append(list(rows))


def publish_many(engine: Engine, count: int, tenant: str = "default") -> list[str]:
    with engine.begin() as conn:
        return [publish(conn, "order.created", {"i": i}, tenant=tenant) for i in range(count)]


def states(engine: Engine) -> list[dict[str, Any]]:
    return rows(
        engine,
        """
        SELECT e.url, d.state, d.claims, d.locked_by, d.lease_expires_at IS NOT NULL AS leased
        FROM deliveries d JOIN endpoints e ON e.id = d.endpoint_id ORDER BY d.id
        """,
    )


async def test_a_fresh_delivery_reaches_the_local_worker_without_a_claim_or_notify(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    created = add_endpoint(engine, box, receiver.route("/hook"))
    with engine.begin() as conn:  # in a rotation's grace both secrets sign, handed off too
        rotate_secret(
            conn,
            box,
            created.endpoint.uid,
            actor="t",
            now=clock.now(),
            grace=dt.timedelta(minutes=1),
        )
    notified: list[int] = []
    stop = asyncio.Event()
    async with build_http_client(max_connections=10, timeout=5, allowed_networks=LOOPBACK) as http:
        worker = Worker(async_engine, http, box, clock, WorkerConfig(poll_interval=POLL))
        relay = Relay(async_engine, clock, on_deliveries=lambda: notified.append(1), handoff=worker)
        running = asyncio.create_task(worker.run(stop))
        try:
            await until(lambda: worker.taking_from_relay)  # its first claim found nothing
            claims = worker.claims
            [message_id] = publish_many(engine, 1)
            result = await relay.run_once()
            assert (result.deliveries, result.handed_off) == (1, 1)
            await until(lambda: worker.stats.succeeded == 1)
        finally:
            stop.set()
            await running
    assert worker.claims == claims  # no claim statement ran for it
    assert notified == []  # nothing scheduled, so nothing to wake
    assert worker.handed_off == 1
    assert [r.headers["webhook-id"] for r in receiver.requests] == [message_id]
    signatures = receiver.requests[0].headers["webhook-signature"].split(" ")
    assert [v[:3] for v in signatures] == ["v1,", "v1,"]
    [row] = rows(engine, "SELECT state, claims, attempts, locked_by FROM deliveries")
    assert dict(row) == {"state": "succeeded", "claims": 1, "attempts": 1, "locked_by": None}
    assert scalar(engine, "SELECT attempt_number FROM delivery_attempts") == 1


async def test_outcome_writes_in_close_succession_share_one_pooled_connection(
    engine: Engine,
    async_engine: AsyncEngine,
    database_url: str,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    """A trickle of events, each handed off and written on its own: the outcome writer
    takes a connection from the pool once for all of them (no checkout and pre-ping per
    write), and gives it back once no outcome came for `outcome_linger`."""
    add_endpoint(engine, box, receiver.route("/hook"))
    relay_engine = make_async_engine(database_url)  # the relay's checkouts are not counted
    checkouts: list[int] = []
    event.listen(async_engine.sync_engine.pool, "checkout", lambda *args: checkouts.append(1))
    stop = asyncio.Event()
    config = WorkerConfig(poll_interval=POLL, outcome_linger=POLL)
    async with build_http_client(max_connections=10, timeout=5, allowed_networks=LOOPBACK) as http:
        worker = Worker(async_engine, http, box, clock, config)
        relay = Relay(relay_engine, clock, handoff=worker)
        running = asyncio.create_task(worker.run(stop))
        try:
            await until(lambda: worker.taking_from_relay)  # its first claim found nothing
            publish_many(engine, 1)
            assert (await relay.run_once()).handed_off == 1
            await until(lambda: worker.stats.succeeded == 1)
            checkouts.clear()  # the first write also made the endpoint's health row
            for n in range(2, 6):
                publish_many(engine, 1)
                assert (await relay.run_once()).handed_off == 1
                await until(lambda n=n: worker.stats.succeeded == n)
            assert checkouts == []  # four writes, each on the connection the first took
            assert async_engine.pool.checkedout() == 1  # type: ignore[attr-defined]
            worker.config = dataclasses.replace(config, outcome_linger=0.01)
            publish_many(engine, 1)
            assert (await relay.run_once()).handed_off == 1
            await until(lambda: worker.stats.succeeded == 6)
            await until(
                lambda: async_engine.pool.checkedout() == 0,  # type: ignore[attr-defined]
                "the writer to give its connection back",
            )
        finally:
            stop.set()
            await running
            await relay_engine.dispose()
    assert scalar(engine, "SELECT count(*) FROM deliveries WHERE state = 'succeeded'") == 6


async def test_only_ungated_unordered_endpoints_of_enabled_uncapped_tenants_are_handed_off(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    add_endpoint(engine, box, "https://plain.example/h")
    limited = add_endpoint(engine, box, "https://limited.example/h")
    ordered = add_endpoint(engine, box, "https://ordered.example/h")
    broken = add_endpoint(engine, box, "https://broken.example/h")
    paused = add_endpoint(engine, box, "https://paused.example/h")
    with engine.begin() as conn:
        set_endpoint_limits(conn, limited.endpoint.uid, EndpointLimits(max_in_flight=5), actor="t")
        set_endpoint_limits(conn, ordered.endpoint.uid, EndpointLimits(ordered=True), actor="t")
        set_endpoint_limits(conn, broken.endpoint.uid, EndpointLimits(), actor="t")
        set_endpoint_limits(conn, paused.endpoint.uid, EndpointLimits(), actor="t")
        conn.execute(
            text(
                "UPDATE endpoint_health SET breaker_state = 'open', open_until = :later "
                "WHERE endpoint_id = (SELECT id FROM endpoints WHERE uid = :uid)"
            ),
            {"uid": broken.endpoint.uid, "later": clock.now() + dt.timedelta(minutes=5)},
        )
        conn.execute(
            text(
                "UPDATE endpoint_health SET paused_until = :later "
                "WHERE endpoint_id = (SELECT id FROM endpoints WHERE uid = :uid)"
            ),
            {"uid": paused.endpoint.uid, "later": clock.now() + dt.timedelta(minutes=5)},
        )
        create_tenant(conn, "capped")
        create_tenant(conn, "free")
        create_tenant(conn, "held")
        update_tenant(conn, "capped", actor="t", now=clock.now(), max_per_second=10.0)
    add_endpoint(engine, box, "https://capped.example/h", tenant="capped")
    add_endpoint(engine, box, "https://free.example/h", tenant="free")
    add_endpoint(engine, box, "https://held.example/h", tenant="held")
    publish_many(engine, 1)
    publish_many(engine, 1, tenant="capped")
    publish_many(engine, 1, tenant="free")
    publish_many(engine, 1, tenant="held")
    with engine.begin() as conn:  # a disabled tenant's deliveries are held, not sent
        set_tenant_enabled(conn, "held", enabled=False, actor="t", now=clock.now(), reason="r")
    recorder = Recorder(clock)
    result = await Relay(async_engine, clock, handoff=recorder).run_once()
    assert (result.deliveries, result.handed_off) == (8, 2)
    by_url = {row["url"]: row for row in states(engine)}
    handed = {url for url, row in by_url.items() if row["state"] == "in_flight"}
    assert handed == {"https://plain.example/h", "https://free.example/h"}
    for url, row in by_url.items():
        if url in handed:
            assert (row["claims"], row["locked_by"], row["leased"]) == (1, "w-dead", True)
        else:
            assert (row["state"], row["claims"], row["locked_by"]) == ("scheduled", 0, None)
    assert sorted(r.url for r in recorder.taken[0]) == sorted(handed)


async def test_the_handoff_stays_within_the_free_slots_and_each_endpoints_share(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    busy = add_endpoint(engine, box, "https://busy.example/h")
    add_endpoint(engine, box, "https://idle.example/h")
    busy_id = scalar(engine, "SELECT id FROM endpoints WHERE uid = :uid", uid=busy.endpoint.uid)
    publish_many(engine, 3)
    # The busy endpoint has one slot left in the worker, the other the default two.
    recorder = Recorder(clock, limit=10, endpoint_slots=2, slots_left={busy_id: 1})
    result = await Relay(async_engine, clock, handoff=recorder).run_once()
    assert (result.deliveries, result.handed_off) == (6, 3)
    handed = [row["url"] for row in states(engine) if row["state"] == "in_flight"]
    assert sorted(handed) == [
        "https://busy.example/h",
        "https://idle.example/h",
        "https://idle.example/h",
    ]
    # And never more than the free slots, oldest event first.
    publish_many(engine, 3)
    recorder = Recorder(clock, limit=1)
    result = await Relay(async_engine, clock, handoff=recorder).run_once()
    assert (result.deliveries, result.handed_off) == (6, 1)
    assert len(recorder.taken[0]) == 1
    assert recorder.taken[0][0].endpoint_uid == busy.endpoint.uid  # lowest (event, endpoint) first


class Declining:
    """A worker with no slot to offer: the relay must not hand it anything."""

    def __init__(self) -> None:
        self.taken: list[tuple[Capacity, list[Any]]] = []

    async def settle(self) -> None:
        return None

    def reserve(self) -> Capacity | None:
        return None

    async def take(self, capacity: Capacity, rows: Sequence[Any], now: dt.datetime) -> None:
        self.taken.append((capacity, list(rows)))


async def test_a_worker_without_free_slots_is_not_handed_anything(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    add_endpoint(engine, box, "https://plain.example/h")
    publish_many(engine, 2)
    notified: list[int] = []
    declining = Declining()
    relay = Relay(async_engine, clock, on_deliveries=lambda: notified.append(1), handoff=declining)
    result = await relay.run_once()
    assert (result.deliveries, result.handed_off) == (2, 0)
    assert declining.taken == []
    assert notified == [1]  # scheduled, so the workers are woken to claim them
    assert [r["state"] for r in states(engine)] == ["scheduled", "scheduled"]


async def test_a_failed_pass_gives_the_reservation_back(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    """Every reservation is answered by one `take`, with no rows when the pass failed, so
    the worker's reserved slots are freed."""
    add_endpoint(engine, box, "https://plain.example/h")
    publish_many(engine, 1)
    recorder = Recorder(clock)
    broken = Relay(async_engine, clock, RelayConfig(batch_size=-1), handoff=recorder)
    # the pass runs on psycopg directly (outbox/direct.py): psycopg's error, not wrapped
    with pytest.raises(psycopg.Error, match="LIMIT must not be negative"):
        await broken.run_once()
    assert recorder.taken == [[]]
    assert states(engine) == []  # nothing was fanned out


async def test_a_crash_after_the_relay_commit_loses_nothing(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    add_endpoint(engine, box, receiver.route("/hook"))
    [message_id] = publish_many(engine, 1)
    dead = Recorder(clock)  # handed the delivery, then gone before attempting it
    result = await Relay(async_engine, clock, handoff=dead).run_once()
    assert result.handed_off == 1
    reaper = Reaper(async_engine, clock)
    assert await reaper.run_once() == []  # the lease still runs
    clock.advance(61)
    assert len(await reaper.run_once()) == 1
    async with build_http_client(max_connections=4, timeout=5, allowed_networks=LOOPBACK) as http:
        stats = await Worker(async_engine, http, box, clock).run_once()
    assert stats.succeeded == 1
    assert [r.headers["webhook-id"] for r in receiver.requests] == [message_id]
    [row] = rows(engine, "SELECT state, claims, rescues FROM deliveries")
    assert dict(row) == {"state": "succeeded", "claims": 2, "rescues": 1}


async def test_a_late_outcome_of_a_handed_off_delivery_is_fenced(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    slow = receiver.route("/slow", delay=1.0)
    add_endpoint(engine, box, slow)
    stop = asyncio.Event()
    async with build_http_client(max_connections=10, timeout=5, allowed_networks=LOOPBACK) as http:
        first = Worker(
            async_engine, http, box, clock, WorkerConfig(worker_id="first", poll_interval=POLL)
        )
        running = asyncio.create_task(first.run(stop))
        try:
            await until(lambda: first.taking_from_relay)
            publish_many(engine, 1)
            assert (await Relay(async_engine, clock, handoff=first).run_once()).handed_off == 1
            await until(lambda: len(receiver.requests) == 1)  # the first POST is in flight
            # Its lease runs out; the reaper reschedules it and another worker delivers it.
            clock.advance(61)
            assert len(await Reaper(async_engine, clock).run_once()) == 1
            second = Worker(async_engine, http, box, clock, WorkerConfig(worker_id="second"))
            assert (await second.run_once()).succeeded == 1
            await until(lambda: first.stats.lost_lease == 1)
        finally:
            stop.set()
            await running
    assert first.stats.succeeded == 0
    [row] = rows(engine, "SELECT state, claims, attempts FROM deliveries")
    assert dict(row) == {"state": "succeeded", "claims": 2, "attempts": 1}
    attempts = rows(
        engine, "SELECT attempt_number, worker_id FROM delivery_attempts ORDER BY attempt_number"
    )
    assert [(a["attempt_number"], a["worker_id"]) for a in attempts] == [
        (1, "first"),
        (2, "second"),
    ]


async def test_the_worker_takes_from_the_relay_only_while_caught_up(
    async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    stop = asyncio.Event()
    wake = asyncio.Event()
    async with build_http_client(max_connections=10, timeout=5, allowed_networks=LOOPBACK) as http:
        config = WorkerConfig(poll_interval=POLL, max_in_flight=8, batch_size=5)
        worker = Worker(async_engine, http, box, clock, config)
        assert worker.reserve() is None  # not running
        running = asyncio.create_task(worker.run(stop, wake))
        try:
            await until(lambda: worker.taking_from_relay)
            capacity = worker.reserve()
            assert capacity is not None
            assert (capacity.limit, capacity.endpoint_slots) == (5, 4)
            more = worker.reserve()  # 3 slots are left beyond the first 5
            assert more is not None and more.limit == 3
            assert worker.reserve() is None  # every free slot is reserved
            await worker.take(more, [], clock.now())
            assert worker.reserve() is not None  # those 3 are free again
            await worker.take(more, [], clock.now())
            # A pending wake-up means due work may wait: the claim goes first.
            wake.set()
            assert worker.reserve() is None
        finally:
            stop.set()
            await running
        assert worker.reserve() is None  # stopped
        # Switched off: never, even while caught up.
        off = Worker(
            async_engine, http, box, clock, dataclasses.replace(config, take_from_relay=False)
        )
        stop = asyncio.Event()
        running = asyncio.create_task(off.run(stop))
        try:
            await until(lambda: off.taking_from_relay)
            assert off.reserve() is None
        finally:
            stop.set()
            await running


@contextlib.asynccontextmanager
async def settling_worker(
    async_engine: AsyncEngine, clock: ManualClock, box: SecretBox, notified: list[int]
) -> AsyncIterator[tuple[Worker, Relay, asyncio.Event]]:
    """A running, caught-up worker that waits for its claims as long as they take (the
    claim, not the clock, ends the relay's wait), its relay, and its wake-up event."""
    stop, wake = asyncio.Event(), asyncio.Event()
    async with build_http_client(max_connections=10, timeout=5, allowed_networks=LOOPBACK) as http:
        config = WorkerConfig(poll_interval=POLL, relay_settle=30.0)
        worker = Worker(async_engine, http, box, clock, config)
        relay = Relay(async_engine, clock, on_deliveries=lambda: notified.append(1), handoff=worker)
        running = asyncio.create_task(worker.run(stop, wake))
        try:
            await until(lambda: worker.taking_from_relay)
            yield worker, relay, wake
        finally:
            stop.set()
            await running


async def test_a_pass_waits_for_the_claim_a_wake_up_is_about_to_start(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    """A NOTIFY is pending: without waiting, the pass would schedule its deliveries and
    notify for one more claim (a cascade of claims at a steady trickle)."""
    add_endpoint(engine, box, "https://plain.example/h")
    notified: list[int] = []
    async with settling_worker(async_engine, clock, box, notified) as (worker, relay, wake):
        claims = worker.claims
        publish_many(engine, 1)
        wake.set()  # the worker has not run since: its claim is still to come
        result = await relay.run_once()
        assert worker.claims == claims + 1  # the claim ran first and found nothing
        assert (result.deliveries, result.handed_off) == (1, 1)
    assert notified == []


async def test_a_pass_waits_for_a_claim_under_way(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    add_endpoint(engine, box, "https://plain.example/h")
    notified: list[int] = []
    async with settling_worker(async_engine, clock, box, notified) as (worker, relay, wake):
        claims = worker.claims
        publish_many(engine, 1)
        with engine.connect() as blocker:
            blocker.execute(text("LOCK TABLE deliveries IN ACCESS EXCLUSIVE MODE"))
            wake.set()
            await until(lambda: worker.claims == claims + 1)  # started, held by the lock
            passing = asyncio.create_task(relay.run_once())
            await until(lambda: worker._claim_waiters)  # the pass waits for the claim's verdict
            assert not passing.done()
            blocker.rollback()
        result = await passing
        assert (result.deliveries, result.handed_off) == (1, 1)
    assert notified == []


async def test_deliveries_handed_to_a_stopped_worker_go_back_at_once(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    add_endpoint(engine, box, receiver.route("/hook"))
    stop = asyncio.Event()
    async with build_http_client(max_connections=10, timeout=5, allowed_networks=LOOPBACK) as http:
        worker = Worker(async_engine, http, box, clock, WorkerConfig(poll_interval=POLL))
        running = asyncio.create_task(worker.run(stop))
        await until(lambda: worker.taking_from_relay)
        capacity = worker.reserve()
        assert capacity is not None
        stop.set()  # the worker stops while the relay's pass runs
        await running
        publish_many(engine, 1)
        relay = Relay(async_engine, clock, handoff=_Reserved(worker, capacity))
        assert (await relay.run_once()).handed_off == 1
    assert receiver.requests == []
    [row] = rows(engine, "SELECT state, attempts, locked_by FROM deliveries")
    assert dict(row) == {"state": "scheduled", "attempts": 0, "locked_by": None}


class _Reserved:
    """The worker, with a reservation it granted before it stopped."""

    def __init__(self, worker: Worker, capacity: Capacity) -> None:
        self._worker = worker
        self._capacity = capacity

    async def settle(self) -> None:
        await self._worker.settle()

    def reserve(self) -> Capacity | None:
        return self._capacity

    async def take(self, capacity: Capacity, rows: Sequence[Any], now: dt.datetime) -> None:
        await self._worker.take(capacity, rows, now)


async def test_the_service_hands_fresh_deliveries_to_its_own_worker(
    engine: Engine, database_url: str, box: SecretBox, receiver: Receiver
) -> None:
    add_endpoint(engine, box, receiver.route("/hook"))
    service = Service(
        database_url,
        box,
        relay=RelayConfig(poll_interval=120),
        # The relay waits for a claim that is running to settle before it reserves; 20 ms
        # by default, which a loaded CI box can overrun (the delivery is then claimed, as
        # designed, and this test saw no handoff once). Here the wait is bounded loosely.
        worker=WorkerConfig(poll_interval=120, relay_settle=10.0),
        allowed_networks=LOOPBACK,
    )
    stop = asyncio.Event()
    running = asyncio.create_task(service.run(stop))
    try:
        await until(lambda: service.worker is not None and service.worker.taking_from_relay)
        assert service.listener is not None
        await service.listener.ready.wait()
        with engine.begin() as conn:
            message_id = publish(conn, "order.created", {"id": 1})
        await until(lambda: bool(receiver.requests))
    finally:
        stop.set()
        await running
    assert receiver.requests[0].headers["webhook-id"] == message_id
    assert service.worker is not None and service.worker.handed_off == 1
