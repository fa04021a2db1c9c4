"""Helpers for the operator-side tests: push real events through relay and worker, sign in."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.http import build_http_client
from delivery.worker import Worker, WorkerConfig
from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.relay import Relay
from outbox.tokens import create_token
from tests.helpers import LOOPBACK, rows


def publish_many(engine: Engine, event_type: str, count: int = 1) -> list[str]:
    with engine.begin() as conn:
        return [publish(conn, event_type, {"n": n}) for n in range(count)]


async def deliver(async_engine: AsyncEngine, box: SecretBox, clock: ManualClock) -> None:
    """Relay everything and give every due delivery one attempt."""
    await Relay(async_engine, clock).run_until_idle()
    async with build_http_client(max_connections=20, timeout=5, allowed_networks=LOOPBACK) as http:
        worker = Worker(async_engine, http, box, clock, WorkerConfig(lease_seconds=30))
        while (await worker.run_once()).claimed:
            pass


def snapshot(engine: Engine, delivery_id: int) -> dict[str, Any]:
    """A delivery row and all its attempts, to compare before and after an action."""
    return {
        "delivery": rows(engine, "SELECT * FROM deliveries WHERE id = :id", id=delivery_id),
        "attempts": rows(
            engine,
            "SELECT * FROM delivery_attempts WHERE delivery_id = :id ORDER BY id",
            id=delivery_id,
        ),
    }


def token(engine: Engine, role: str, name: str | None = None) -> dict[str, str]:
    """The authorization header of a new admin API token with `role`."""
    with engine.begin() as conn:
        _, secret = create_token(conn, name=name or role, role=role, actor="test")
    return {"authorization": f"Bearer {secret}"}
