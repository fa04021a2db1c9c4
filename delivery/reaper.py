"""The reaper: re-schedules deliveries whose worker died while holding the lease.

A rescue does not count as an attempt: the attempt counter only moves when an
outcome is recorded, and a dead worker recorded nothing (a deploy that kills
workers must not eat into a partner's attempts). The receiver may still have
received the request, which is why `webhook-id` stays the same.

Rescues are counted separately (`deliveries.rescues`), and the `max_rescues`-th
one makes the delivery dead with a reason saying so: a delivery that crashes
every worker that picks it up (a poison) is stopped instead of being rescued
forever.

The lease (OUTBOX_LEASE_SECONDS) always outlasts the attempt deadline plus a
margin, so a slow but live attempt is never rescued while it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from delivery import operational, queries
from outbox.clock import Clock
from outbox.outage import OUTAGE

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReaperConfig:
    batch_size: int = 500
    interval: float = 5.0
    max_rescues: int = 3


class Reaper:
    def __init__(self, engine: AsyncEngine, clock: Clock, config: ReaperConfig | None = None):
        self._engine = engine
        self._clock = clock
        self.config = config or ReaperConfig()

    async def run_once(self) -> list[int]:
        """Rescue one batch of expired leases; returns the ids taken back (rescheduled or dead)."""
        now = self._clock.now()
        async with self._engine.begin() as conn:
            rows = (
                await conn.execute(
                    queries.RESCUE_EXPIRED_LEASES,
                    {
                        "now": now,
                        "limit": self.config.batch_size,
                        "max_rescues": self.config.max_rescues,
                    },
                )
            ).all()
            # A poison made dead is reported like any dead delivery (delivery.dead).
            await operational.report_dead(
                conn, sorted(int(row.id) for row in rows if row.state == "dead"), now=now
            )
        rescued = [int(row.id) for row in rows]
        dead = [int(row.id) for row in rows if row.state == "dead"]
        if rescued:
            log.warning(
                "lease expired, %d deliveries rescued (their worker stopped without recording "
                "an outcome); due again, no attempt spent: %s",
                len(rescued),
                rescued[:20],
            )
        if dead:
            log.error(
                "%d deliveries were rescued %d times and are now dead (possible poison): %s",
                len(dead),
                self.config.max_rescues,
                dead[:20],
            )
        return rescued

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.run_once()
                OUTAGE.succeeded()
            except Exception as exc:
                OUTAGE.failed("reaper", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.config.interval)
