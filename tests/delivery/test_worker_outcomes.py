"""What `Worker.record` and `Worker.release` report and write, exactly.

The mutation run of `delivery/worker.py` (docs/mutation.md) showed counts and edge
cases no fast test pinned. Real PostgreSQL and a real receiver on 127.0.0.1; time is
the manual clock.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator

import httpx
import pytest
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.http import build_http_client
from delivery.reaper import Reaper
from delivery.receiver import Receiver
from delivery.worker import BatchStats, Worker, WorkerConfig
from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.relay import Relay
from tests.helpers import LOOPBACK, add_endpoint, rows, scalar


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with build_http_client(max_connections=10, timeout=5, allowed_networks=LOOPBACK) as c:
        yield c


def worker(
    async_engine: AsyncEngine,
    http: httpx.AsyncClient,
    box: SecretBox,
    clock: ManualClock,
    name: str,
) -> Worker:
    config = WorkerConfig(worker_id=name, lease_seconds=60, retry_schedule=(10.0, 20.0))
    return Worker(async_engine, http, box, clock, config)


async def test_nothing_to_release_or_record_is_zero_and_touches_nothing(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    http: httpx.AsyncClient,
) -> None:
    w = worker(async_engine, http, box, clock, "W")
    assert await w.release([]) == 0
    assert await w.record([]) == BatchStats()
    assert scalar(engine, "SELECT count(*) FROM delivery_attempts") == 0


async def test_one_batch_counts_each_outcome_once_and_a_late_one_as_lost(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    """Two each of succeeded, scheduled again and dead, and a result whose lease was
    rescued meanwhile."""
    for path, status, pattern in [
        ("/ok", 200, "a.*"),
        ("/busy", 503, "b.*"),
        ("/bad", 400, "c.*"),
        ("/ok2", 204, "e.*"),
        ("/busy2", 429, "f.*"),
        ("/bad2", 404, "g.*"),
        ("/late", 200, "d.*"),
    ]:
        add_endpoint(engine, box, receiver.route(path, status=status), pattern)
    w = worker(async_engine, http, box, clock, "W")
    with engine.begin() as conn:
        publish(conn, "d.x", {"n": 1})
    await Relay(async_engine, clock).run_until_idle()
    [late] = await w.claim(10)
    clock.advance(61)
    assert await Reaper(async_engine, clock).run_once() == [late.id]
    other = worker(async_engine, http, box, clock, "W2")
    assert [c.id for c in await other.claim(10)] == [late.id]
    with engine.begin() as conn:
        for event_type in ("a.x", "b.x", "c.x", "e.x", "f.x", "g.x"):
            publish(conn, event_type, {"n": 1})
    await Relay(async_engine, clock).run_until_idle()
    claimed = [late, *await w.claim(10)]
    assert len(claimed) == 7
    outcomes = [(c, await w.attempt(c)) for c in claimed]
    stats = await w.record(outcomes)
    assert stats == BatchStats(claimed=7, succeeded=2, scheduled=2, dead=2, lost_lease=1)
    w.stats.merge(stats)
    w.stats.merge(stats)
    assert w.stats == BatchStats(claimed=14, succeeded=4, scheduled=4, dead=4, lost_lease=2)


async def test_each_attempt_informs_its_endpoints_breaker_with_what_it_saw(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    """The health row after one batch: a 503 is a failure with its error text (not an
    answer), a 429's own Retry-After (not the default pause) pauses its endpoint."""
    failing = add_endpoint(engine, box, receiver.route("/busy", status=503), "b.*")
    throttling = add_endpoint(
        engine, box, receiver.route("/slow", status=429, headers={"Retry-After": "120"}), "s.*"
    )
    w = worker(async_engine, http, box, clock, "W")
    with engine.begin() as conn:
        publish(conn, "b.x", {"n": 1})
        publish(conn, "s.x", {"n": 1})
    await Relay(async_engine, clock).run_until_idle()
    claimed = await w.claim(10)
    assert len(claimed) == 2
    await w.record([(c, await w.attempt(c)) for c in claimed])
    now = clock.now()
    [busy] = rows(
        engine,
        "SELECT failing_since, last_failure, paused_until FROM endpoint_health"
        " WHERE endpoint_id = :id",
        id=failing.endpoint.id,
    )
    assert busy["failing_since"] == now
    assert busy["last_failure"] == "HTTP 503 Service Unavailable"
    assert busy["paused_until"] is None
    [slow] = rows(
        engine,
        "SELECT failing_since, last_failure, paused_until FROM endpoint_health"
        " WHERE endpoint_id = :id",
        id=throttling.endpoint.id,
    )
    assert slow["paused_until"] == now + dt.timedelta(seconds=120)
    assert slow["failing_since"] is None
    assert slow["last_failure"] is None
