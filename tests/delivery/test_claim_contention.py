"""Concurrent claimers on one endpoint: rows another claimer holds are skipped, not a dead end."""

from __future__ import annotations

import asyncio

from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.health import EndpointLimits, set_endpoint_limits
from delivery.http import build_http_client
from delivery.receiver import Receiver
from delivery.worker import Worker, WorkerConfig
from delivery.worker.claiming import HELD_ELSEWHERE_RETRY
from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.relay import Relay
from tests.helpers import LOOPBACK, add_endpoint, until


async def test_a_claim_skips_rows_another_claimer_has_locked(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    add_endpoint(engine, box, "http://127.0.0.1:9/hook")
    with engine.begin() as conn:
        for i in range(300):
            publish(conn, "order.created", {"i": i})
    await Relay(async_engine, clock).run_until_idle()
    other = engine.connect()
    other_tx = other.begin()
    # Another worker's claim in progress: it holds the first 100 due rows.
    other.execute(
        text("SELECT id FROM deliveries ORDER BY next_attempt_at, id LIMIT 100 FOR UPDATE")
    ).all()
    try:
        async with build_http_client(
            max_connections=5, timeout=5, allowed_networks=LOOPBACK
        ) as http:
            worker = Worker(async_engine, http, box, clock, WorkerConfig(batch_size=50))
            claimed = await worker.claim(50)
    finally:
        other_tx.rollback()
        other.close()
    assert len(claimed) == 50


async def test_a_claim_that_finds_a_gated_endpoint_held_by_another_worker_looks_again_soon(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    """Two workers on one busy gated endpoint (a limit, or adaptive concurrency: every
    outcome write locks its health row): a claim that finds the row held skips the
    endpoint, and must look again once the holder lets go, not at its poll."""
    endpoint = add_endpoint(engine, box, receiver.route("/hook")).endpoint
    with engine.begin() as conn:
        set_endpoint_limits(conn, endpoint.uid, EndpointLimits(max_in_flight=5), actor="test")
    with engine.begin() as conn:
        for i in range(5):
            publish(conn, "order.created", {"i": i})
    await Relay(async_engine, clock).run_until_idle()
    # The other worker's outcome write (queries.LOCK_ENDPOINT_HEALTH) holds the row.
    other = engine.connect()
    other_tx = other.begin()
    other.execute(text("SELECT 1 FROM endpoint_health FOR UPDATE")).all()
    stop = asyncio.Event()
    async with build_http_client(max_connections=5, timeout=5, allowed_networks=LOOPBACK) as http:
        # The poll is a minute: only the retry can bring the deliveries out in time.
        worker = Worker(
            async_engine, http, box, clock, WorkerConfig(poll_interval=60, max_in_flight=10)
        )
        running = asyncio.create_task(worker.run(stop))
        try:
            await until(lambda: worker.next_gate_at is not None, "a claim on the held row")
            assert not receiver.requests
            assert worker.next_gate_at == clock.now() + HELD_ELSEWHERE_RETRY
            other_tx.rollback()  # the other worker's write commits and lets go
            await until(lambda: len(receiver.requests) == 5, "the 5 deliveries", seconds=10)
        finally:
            stop.set()
            await running
            other.close()
