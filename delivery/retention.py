"""Retention: prune old history in small batches while the service runs.

Succeeded and discarded deliveries (with their attempts) and relayed events go
once they are older than the retention; audit rows once they are older than the
audit retention (longer by default, and independent of the rest). A dead letter nobody replayed or
discarded is what an operator still has to look at, so it stays, for its own,
longer retention (or for ever). Each batch is its own short transaction, so
pruning never holds locks for long and never stalls delivery.

Deliveries are pruned per (event, endpoint) group -- the first delivery and all
its replays together -- so a replay never outlives the row it points at.
What is removed is tallied in `pruned_totals`, so the totals on /metrics never go
backwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.clock import Clock
from outbox.outage import OUTAGE
from outbox.schema import LATENCY_BUCKETS
from outbox.sql import retention as queries

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RetentionConfig:
    """Ages are in days; 0 means keep for ever."""

    retention_days: float = 7.0
    dead_retention_days: float = 30.0
    audit_retention_days: float = 90.0
    batch_size: int = 500
    interval: float = 60.0
    max_batches_per_pass: int = 100


@dataclass(slots=True)
class PruneResult:
    deliveries: int = 0
    attempts: int = 0
    events: int = 0
    audit: int = 0
    feed_entries: int = 0
    filter_skips: int = 0

    @property
    def total(self) -> int:
        return (
            self.deliveries
            + self.attempts
            + self.events
            + self.audit
            + self.feed_entries
            + self.filter_skips
        )


def _cutoff(now: dt.datetime, days: float) -> dt.datetime | None:
    return now - dt.timedelta(days=days) if days > 0 else None


class Retention:
    def __init__(
        self, engine: AsyncEngine, clock: Clock, config: RetentionConfig | None = None
    ) -> None:
        self._engine = engine
        self._clock = clock
        self.config = config or RetentionConfig()

    async def run_once(self) -> PruneResult:
        """Prune at most one batch of delivery groups and one batch of events."""
        result = PruneResult()
        now = self._clock.now()
        audit_before = _cutoff(now, self.config.audit_retention_days)
        if audit_before is not None:
            # The audit log has its own retention: refused API calls are audited, so
            # without it anyone who can reach the admin port could grow it for ever.
            async with self._engine.begin() as conn:
                row = (
                    await conn.execute(
                        queries.PRUNE_AUDIT,
                        {"before": audit_before, "limit": self.config.batch_size},
                    )
                ).one()
                result.audit = int(row.audit)
        before = _cutoff(now, self.config.retention_days)
        if before is None:
            return result
        async with self._engine.begin() as conn:
            row = (
                await conn.execute(
                    queries.PRUNE_DELIVERIES,
                    {
                        "before": before,
                        "dead_before": _cutoff(now, self.config.dead_retention_days),
                        "limit": self.config.batch_size,
                        "buckets": list(LATENCY_BUCKETS),
                    },
                )
            ).one()
            result.deliveries, result.attempts = int(row.deliveries), int(row.attempts)
        # Feed entries live as long as deliveries (OUTBOX_RETENTION_DAYS); they go before
        # the events, which stay while a feed still lists them.
        async with self._engine.begin() as conn:
            limits = {"before": before, "limit": self.config.batch_size}
            row = (await conn.execute(queries.PRUNE_FEED_ENTRIES, limits)).one()
            result.feed_entries = int(row.entries)
            row = (await conn.execute(queries.PRUNE_FILTER_SKIPS, limits)).one()
            result.filter_skips = int(row.skips)
        async with self._engine.begin() as conn:
            row = (
                await conn.execute(
                    queries.PRUNE_EVENTS, {"before": before, "limit": self.config.batch_size}
                )
            ).one()
            result.events = int(row.events)
        return result

    async def run_until_done(self) -> PruneResult:
        """Batch after batch until nothing is left to prune (or the per-pass cap)."""
        total = PruneResult()
        for _ in range(self.config.max_batches_per_pass):
            step = await self.run_once()
            total.deliveries += step.deliveries
            total.attempts += step.attempts
            total.events += step.events
            total.audit += step.audit
            total.feed_entries += step.feed_entries
            total.filter_skips += step.filter_skips
            if step.total == 0:
                break
        return total

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                pruned = await self.run_until_done()
                OUTAGE.succeeded()
                if pruned.total:
                    log.info(
                        "retention pruned %d deliveries, %d attempts, %d events, %d audit rows",
                        pruned.deliveries,
                        pruned.attempts,
                        pruned.events,
                        pruned.audit,
                    )
            except Exception as exc:
                OUTAGE.failed("retention", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.config.interval)
