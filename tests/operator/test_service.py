"""The one-process service: NOTIFY wakes the relay and the workers long before a poll would."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import Engine

from delivery.operator.app import Service
from delivery.receiver import Receiver
from delivery.worker import WorkerConfig
from outbox import publish
from outbox.crypto import SecretBox
from outbox.relay import Relay, RelayConfig, RelayResult
from tests.helpers import LOOPBACK, add_endpoint, until


async def test_a_committed_event_is_delivered_without_waiting_for_a_poll(
    engine: Engine,
    database_url: str,
    box: SecretBox,
    receiver: Receiver,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    passes: list[RelayResult] = []
    relay_once = Relay.run_once

    async def counted(relay: Relay) -> RelayResult:
        result = await relay_once(relay)
        passes.append(result)
        return result

    monkeypatch.setattr(Relay, "run_once", counted)  # counts the relay's passes, no more
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
            await until(lambda: service.listener is not None, "the listener")
            assert service.listener is not None
            await service.listener.ready.wait()
            # The first (empty) relay pass and claim are over: both wait for a long poll
            # now, so only the notification can explain a prompt delivery.
            await until(
                lambda: passes and service.worker is not None and service.worker.taking_from_relay,
                "the first relay pass and claim",
            )
            with engine.begin() as conn:
                message_id = publish(conn, "order.created", {"id": 1})
            loop = asyncio.get_running_loop()
            published_at = loop.time()
            await until(lambda: receiver.requests, "the delivery")
            waited = loop.time() - published_at
    finally:
        stop.set()
        await running
    assert receiver.requests[0].headers["webhook-id"] == message_id
    assert waited < 5.0
