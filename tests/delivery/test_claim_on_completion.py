"""The worker claims when a slot frees or a gate opens, not when its poll comes round.

Every worker here polls once a minute, so a delivery that arrives within seconds
can only have been claimed because a completion or a gate opening triggered it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import httpx
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.health import (
    EndpointLimits,
    Health,
    HealthConfig,
    TenantCap,
    next_opening,
    set_endpoint_limits,
    tenant_next_opening,
)
from delivery.http import build_http_client
from delivery.receiver import Receiver
from delivery.worker import Worker, WorkerConfig
from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.relay import Relay
from tests.helpers import LOOPBACK, add_endpoint, until

POLL = 60.0  # far longer than any test here may take


def publish_many(engine: Engine, count: int) -> None:
    with engine.begin() as conn:
        for index in range(count):
            publish(conn, "order.created", {"i": index})


async def received(receiver: Receiver, count: int, seconds: float = 20.0) -> None:
    await until(lambda: len(receiver.requests) >= count, f"{count} requests", seconds)


def make_worker(
    engine: AsyncEngine, http: httpx.AsyncClient, box: SecretBox, clock: ManualClock, **config: Any
) -> Worker:
    return Worker(engine, http, box, clock, WorkerConfig(poll_interval=POLL, **config))


async def test_a_backlog_beyond_the_endpoint_share_drains_on_completions(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    add_endpoint(engine, box, receiver.route("/slow", delay=0.05))
    publish_many(engine, 40)
    await Relay(async_engine, clock).run_until_idle()
    # 8 slots, of which one endpoint may hold 4: each claim stops at 4 in flight.
    stop = asyncio.Event()
    async with build_http_client(max_connections=8, timeout=5, allowed_networks=LOOPBACK) as http:
        worker = make_worker(async_engine, http, box, clock, max_in_flight=8, batch_size=8)
        running = asyncio.create_task(worker.run(stop))
        try:
            await received(receiver, 40)
        finally:
            stop.set()
            await running
    assert len({r.headers["webhook-id"] for r in receiver.requests}) == 40
    # Each claim refilled the slots freed meanwhile: about 40 / 4 claims, not one per
    # completion (40) and not one per poll (a minute each).
    assert worker.claims <= 25, worker.claims
    assert worker.stats.succeeded == 40


async def test_completions_that_free_no_wanted_slot_trigger_no_claim(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    add_endpoint(engine, box, receiver.route("/hook"))
    publish_many(engine, 5)
    await Relay(async_engine, clock).run_until_idle()
    stop = asyncio.Event()
    async with build_http_client(max_connections=8, timeout=5, allowed_networks=LOOPBACK) as http:
        worker = make_worker(async_engine, http, box, clock, max_in_flight=20, batch_size=20)
        running = asyncio.create_task(worker.run(stop))
        try:
            await received(receiver, 5)
            await until(lambda: worker.stats.succeeded >= 5, "5 outcomes recorded")
        finally:
            stop.set()
            await running
    # The first claim took everything that was due and left no slot wanting: nothing to
    # re-claim on completion, so the only claim is that one.
    assert worker.claims == 1


async def test_a_rate_limited_endpoint_is_claimed_when_its_next_token_is_due(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    endpoint = add_endpoint(engine, box, receiver.route("/hook")).endpoint
    with engine.begin() as conn:
        set_endpoint_limits(conn, endpoint.uid, EndpointLimits(max_per_second=4), actor="test")
    publish_many(engine, 8)
    await Relay(async_engine, clock).run_until_idle()
    stop = asyncio.Event()
    async with build_http_client(max_connections=8, timeout=5, allowed_networks=LOOPBACK) as http:
        worker = make_worker(async_engine, http, box, clock, max_in_flight=20, batch_size=20)
        running = asyncio.create_task(worker.run(stop))
        try:
            await received(receiver, 4)  # the bucket's burst
            await until(lambda: worker.stats.succeeded >= 4, "4 outcomes recorded")
            # The clock stands still: no token refills, and nothing more may go out. The
            # worker looks again when it expects the token (a quarter of a second, real
            # time); after two more claims it has looked and taken nothing.
            claims = worker.claims
            await until(lambda: worker.claims >= claims + 2, "two claims on a closed gate")
            assert len(receiver.requests) == 4
            assert worker.next_gate_at is not None
            assert worker.next_gate_at - clock.now() == dt.timedelta(seconds=0.25)
            # A second later the bucket is full again; the worker claims at the moment its
            # next token was due (a quarter of a second, real time), not at its poll.
            clock.advance(1)
            await received(receiver, 8, seconds=10)
        finally:
            stop.set()
            await running


async def test_a_tenant_capped_per_second_is_claimed_when_its_next_token_is_due(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    # Two endpoints without limits; their tenant may send 4 a second across both.
    add_endpoint(engine, box, receiver.route("/a"))
    add_endpoint(engine, box, receiver.route("/b"))
    with engine.begin() as conn:
        conn.execute(text("UPDATE tenants SET max_per_second = 4"))
    publish_many(engine, 4)  # 8 deliveries
    await Relay(async_engine, clock).run_until_idle()
    stop = asyncio.Event()
    async with build_http_client(max_connections=8, timeout=5, allowed_networks=LOOPBACK) as http:
        worker = make_worker(async_engine, http, box, clock, max_in_flight=20, batch_size=20)
        running = asyncio.create_task(worker.run(stop))
        try:
            await received(receiver, 4)  # the tenant bucket's burst
            await until(lambda: worker.stats.succeeded >= 4, "4 outcomes recorded")
            # The clock stands still: the tenant's bucket stays empty. After two more
            # claims (a quarter of a second apart, real time) nothing more went out.
            claims = worker.claims
            await until(lambda: worker.claims >= claims + 2, "two claims on a closed gate")
            assert len(receiver.requests) == 4
            assert worker.next_gate_at is not None
            assert worker.next_gate_at - clock.now() == dt.timedelta(seconds=0.25)
            # A second later the bucket is full again: the worker claims when the token was
            # due (a quarter of a second, real time), not at its poll (a minute).
            clock.advance(1)
            await received(receiver, 8, seconds=10)
        finally:
            stop.set()
            await running


def test_next_opening_of_a_tenant_bucket() -> None:
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    # 2 per second, half a token left: the next whole one in 0.25 s.
    drained = TenantCap(1, max_per_second=2, tokens=0.5, tokens_at=now)
    assert tenant_next_opening(drained, now=now) == now + dt.timedelta(seconds=0.25)
    assert tenant_next_opening(drained, now=now + dt.timedelta(seconds=0.25)) is None
    # A full bucket, or no rate cap (an in-flight cap waits for outcomes, not the clock).
    assert tenant_next_opening(TenantCap(1, max_per_second=2), now=now) is None
    assert (
        tenant_next_opening(TenantCap(1, max_in_flight=3, tokens=0, tokens_at=now), now=now) is None
    )


def test_next_opening_of_each_gate() -> None:
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    config = HealthConfig()
    later = now + dt.timedelta(seconds=7)
    assert next_opening(Health(1), now=now, config=config) is None
    assert next_opening(Health(1, paused_until=later), now=now, config=config) == later
    assert (
        next_opening(Health(1, breaker_state="open", open_until=later), now=now, config=config)
        == later
    )
    # A cooldown that is over, or a probe that is out: an outcome decides, not the clock.
    assert (
        next_opening(Health(1, breaker_state="open", open_until=now), now=now, config=config)
        is None
    )
    assert (
        next_opening(
            Health(1, breaker_state="half_open", probe_until=later), now=now, config=config
        )
        is None
    )
    # Tokens: 2 per second, half a token left -> the next whole one in 0.25 s.
    drained = Health(1, max_per_second=2, tokens=0.5, tokens_at=now)
    assert next_opening(drained, now=now, config=config) == now + dt.timedelta(seconds=0.25)
    assert (
        next_opening(Health(1, max_per_second=2, tokens=1.0, tokens_at=now), now=now, config=config)
        is None
    )


async def test_a_full_claim_that_used_up_its_endpoints_share_claims_again_on_a_completion(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    """A full batch usually means more is due, so the worker claims again at once; not
    when the batch came only from endpoints whose share of its slots it used up: that
    claim would find nothing (new work notifies). It waits for a completion instead."""
    add_endpoint(engine, box, receiver.route("/slow", delay=0.3))
    publish_many(engine, 8)
    await Relay(async_engine, clock).run_until_idle()
    stop = asyncio.Event()
    async with build_http_client(max_connections=8, timeout=5, allowed_networks=LOOPBACK) as http:
        # 8 slots, 4 for one endpoint, batches of 4: the first claim is full and uses up
        # the endpoint's share.
        worker = make_worker(async_engine, http, box, clock, max_in_flight=8, batch_size=4)
        running = asyncio.create_task(worker.run(stop))
        try:
            await received(receiver, 4)
            assert worker.claims == 1  # no second claim while all four are in flight
            await received(receiver, 8)
        finally:
            stop.set()
            await running
    assert worker.claims <= 3, worker.claims


async def test_an_in_flight_limit_drains_as_outcomes_are_recorded_not_per_poll(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    """An endpoint's in-flight limit (fixed or adaptive) is counted from the deliveries
    in flight in the database, and a finished attempt leaves that state only when its
    outcome is written. A claim woken by the completion itself can run before that and
    find the limit still used up; the write must wake it again, or the endpoint gets
    one limit's worth per poll (here a minute)."""
    endpoint = add_endpoint(engine, box, receiver.route("/hook")).endpoint
    with engine.begin() as conn:
        set_endpoint_limits(conn, endpoint.uid, EndpointLimits(max_in_flight=2), actor="test")
    publish_many(engine, 20)
    await Relay(async_engine, clock).run_until_idle()
    stop = asyncio.Event()
    async with build_http_client(max_connections=8, timeout=5, allowed_networks=LOOPBACK) as http:
        worker = make_worker(async_engine, http, box, clock, max_in_flight=20, batch_size=20)
        record = worker.record

        async def slow_record(batch: Any) -> Any:
            # A write slower than the claim the completions wake (claim_gather, 10 ms):
            # the race as a fast partner and a busy database make it.
            await asyncio.sleep(0.1)
            return await record(batch)

        worker.record = slow_record  # type: ignore[method-assign]
        running = asyncio.create_task(worker.run(stop))
        try:
            await received(receiver, 20, seconds=15)
        finally:
            stop.set()
            await running
    assert len({r.headers["webhook-id"] for r in receiver.requests}) == 20
