"""Concurrent claimers on one endpoint: rows another claimer holds are skipped, not a dead end."""

from __future__ import annotations

from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.http import build_http_client
from delivery.worker import Worker, WorkerConfig
from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.relay import Relay
from tests.helpers import LOOPBACK, add_endpoint


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
