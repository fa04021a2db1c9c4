"""What the admin API and the console share: the database, the clock, the secret box and
the settings, plus the few things both do with them (run a read or a transaction, audit a
refused request). Neither web layer imports the other; both take this.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.requests import Request

from delivery.health.adaptive import DEFAULT_MAXIMUM
from delivery.operator.console.config import ConsoleConfig
from delivery.operator.refusals import RATE_LIMITED, client_address, record_refusal
from delivery.ssrf import AddressPolicy, refusal_warning
from outbox.clock import Clock, SystemClock
from outbox.crypto import SecretBox
from outbox.migrate import head_revision
from outbox.schema_rules import DEFAULT_VALIDATION_BUDGET, SchemaLimits
from outbox.stats import AlertThresholds

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class AdminConfig:
    stats_window: dt.timedelta = dt.timedelta(hours=1)
    thresholds: AlertThresholds = field(default_factory=AlertThresholds)
    replay_rate_per_minute: float = 600.0
    metrics_public: bool = False
    default_rotation_grace: dt.timedelta = dt.timedelta(hours=24)
    https_only: bool = False
    max_body_bytes: int = 1024 * 1024
    allowed_networks: tuple[str, ...] = ()  # the SSRF guard's, for warnings on save
    refused_interval: dt.timedelta = dt.timedelta(minutes=1)
    unauthenticated_per_minute: float = 60.0
    # OUTBOX_TRUSTED_PROXIES: peers whose X-Forwarded-For names the client (see serve).
    trusted_proxies: tuple[str, ...] = ()
    console: ConsoleConfig = field(default_factory=ConsoleConfig)
    # Event-type schemas (OUTBOX_MAX_SCHEMA_*, OUTBOX_VALIDATION_BUDGET_MS).
    schema_limits: SchemaLimits = field(default_factory=SchemaLimits)
    validation_budget: float = DEFAULT_VALIDATION_BUDGET
    # OUTBOX_ADAPTIVE_DEFAULT_MAX: the ceiling shown for adaptive endpoints without their own
    adaptive_default_max: int = DEFAULT_MAXIMUM


class OperatorContext:
    """Engine, secret box, clock and settings of one admin server."""

    def __init__(
        self,
        engine: AsyncEngine,
        box: SecretBox,
        *,
        clock: Clock | None = None,
        config: AdminConfig | None = None,
    ) -> None:
        self.engine = engine
        self.box = box
        self.clock = clock or SystemClock()
        self.config = config or AdminConfig()
        # The schema revision this release needs (reported by /readyz).
        self.head = head_revision()

    async def read(self, func: Callable[[Connection], T]) -> T:
        async with self.engine.connect() as conn:
            return await conn.run_sync(func)

    async def write(self, func: Callable[[Connection], T]) -> T:
        """Run `func` in one transaction: the change and its audit row commit together."""
        async with self.engine.begin() as conn:
            return await conn.run_sync(func)

    async def address_warnings(self, url: str) -> list[str]:
        """What the SSRF guard will refuse about `url` today (advice; nothing is refused)."""
        warning = await refusal_warning(AddressPolicy(self.config.allowed_networks), url)
        return [warning] if warning else []

    async def record_refused(
        self,
        request: Request,
        *,
        request_id: str,
        status: int,
        why: str,
        actor: str,
        tenant: str | None = None,
        limited: int = 0,
    ) -> None:
        """Audit one refused request, plus `limited` earlier 429s of the same client, in the
        aggregated rows of delivery.operator.refusals (the API's and the console's sign-in)."""
        client = client_address(request)
        now = self.clock.now()

        def audit(conn: Connection) -> None:
            for code, reason, count in ((status, why, 1), (429, RATE_LIMITED, limited)):
                if count:
                    record_refusal(
                        conn,
                        now=now,
                        interval=self.config.refused_interval,
                        actor=actor,
                        client=client,
                        status=code,
                        reason=reason,
                        method=request.method,
                        path=request.url.path,
                        user_agent=request.headers.get("user-agent"),
                        request_id=request_id,
                        count=count,
                        tenant=tenant,
                    )

        await self.write(audit)
