"""Workers and relay passes built the way the delivery tests need them."""

from __future__ import annotations

from typing import Any

import httpx
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.health import HealthConfig
from delivery.worker import Worker, WorkerConfig
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.relay import Relay, RelayConfig
from tests.helpers import scalar


def make_worker(
    async_engine: AsyncEngine,
    http: httpx.AsyncClient,
    box: SecretBox,
    clock: ManualClock,
    **config: object,
) -> Worker:
    return Worker(async_engine, http, box, clock, WorkerConfig(**config))  # type: ignore[arg-type]


HEALTH = HealthConfig(
    failure_threshold=3,
    cooldown_seconds=10,
    cooldown_max_seconds=40,
    ramp_seconds=5,
    ramp_start_per_second=1,
    ramp_step_per_second=1,
    throttle_seconds=5,
)


def worker(
    engine: AsyncEngine,
    http: httpx.AsyncClient,
    box: SecretBox,
    clock: ManualClock,
    health: HealthConfig = HEALTH,
    **config: Any,
) -> Worker:
    settings = {"retry_schedule": (1.0,), "request_timeout": 10.0, **config}
    return Worker(engine, http, box, clock, WorkerConfig(health=health, **settings))


async def relay_all(engine: AsyncEngine, clock: ManualClock, max_attempts: int = 50) -> None:
    await Relay(engine, clock, RelayConfig(default_max_attempts=max_attempts)).run_until_idle()


def breaker(engine: Engine, uid: str) -> str:
    return str(
        scalar(
            engine,
            "SELECT COALESCE(h.breaker_state, 'closed') FROM endpoints e"
            " LEFT JOIN endpoint_health h ON h.endpoint_id = e.id WHERE e.uid = :uid",
            uid=uid,
        )
    )
