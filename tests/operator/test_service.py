"""The one-process service: NOTIFY wakes the relay and the workers long before a poll would."""

from __future__ import annotations

import asyncio

from sqlalchemy import Engine

from delivery.operator.app import Service
from delivery.receiver import Receiver
from delivery.worker import WorkerConfig
from outbox import publish
from outbox.crypto import SecretBox
from outbox.relay import RelayConfig
from tests.helpers import LOOPBACK, add_endpoint


async def test_a_committed_event_is_delivered_without_waiting_for_a_poll(
    engine: Engine, database_url: str, box: SecretBox, receiver: Receiver
) -> None:
    add_endpoint(engine, box, receiver.route("/hook"))
    service = Service(
        database_url,
        box,
        # Polls so rare that only a notification can explain a prompt delivery.
        relay=RelayConfig(poll_interval=120),
        worker=WorkerConfig(poll_interval=120),
        allowed_networks=LOOPBACK,
    )
    stop = asyncio.Event()
    running = asyncio.create_task(service.run(stop))
    try:
        async with asyncio.timeout(20):
            while service.listener is None:
                await asyncio.sleep(0.01)
            await service.listener.ready.wait()
            # Let the first (empty) relay and claim passes settle into their long waits.
            await asyncio.sleep(0.3)
            with engine.begin() as conn:
                message_id = publish(conn, "order.created", {"id": 1})
            loop = asyncio.get_running_loop()
            published_at = loop.time()
            while not receiver.requests:
                await asyncio.sleep(0.01)
            waited = loop.time() - published_at
    finally:
        stop.set()
        await running
    assert receiver.requests[0].headers["webhook-id"] == message_id
    assert waited < 5.0
