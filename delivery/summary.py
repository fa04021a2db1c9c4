"""The service's summary: one INFO line a minute saying what it did and what waits.

    summary of worker web-1:3f2a9c1e: 1804 attempts in 60s: 1790 succeeded,
    12 retrying, 2 dead; backlog: 40 due (oldest due 3s ago), 0 events waiting for
    the relay   (one line in the log)

An operator tailing the log of a busy service sees its throughput, failures and
backlog without opening a dashboard. An idle one (nothing attempted, nothing due,
nothing waiting for the relay) logs nothing until something happens, but for one
line every `heartbeat` (10 minutes) saying it is alive; that line, like the first one
after a quiet stretch, covers the whole time since the last one logged. The
counts are this process's own (the worker's running totals, read from memory); the
backlog comes from two small queries that `outbox stats` also uses (due rows on the
partial index of scheduled deliveries, unrelayed events on theirs).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.worker import BatchStats
from outbox.clock import Clock
from outbox.outage import OUTAGE
from outbox.sql import stats as queries

log = logging.getLogger("outbox.summary")


@dataclass(frozen=True, slots=True)
class SummaryLine:
    seconds: float
    attempts: int
    succeeded: int
    retrying: int
    dead: int
    due: int
    oldest_due_seconds: float | None
    unrelayed: int
    worker: str = ""

    def text(self) -> str:
        oldest = (
            "nothing due"
            if self.oldest_due_seconds is None
            else f"oldest due {self.oldest_due_seconds:.0f}s ago"
        )
        who = f" of worker {self.worker}" if self.worker else ""
        return (
            f"summary{who}: {_count(self.attempts, 'attempt')} in {self.seconds:.0f}s: "
            f"{self.succeeded} succeeded, {self.retrying} retrying, {self.dead} dead; "
            f"backlog: {self.due} due ({oldest}), {_count(self.unrelayed, 'event')} waiting "
            "for the relay"
        )

    @property
    def idle(self) -> bool:
        """Nothing attempted, nothing due, nothing waiting for the relay."""
        return not (self.attempts or self.due or self.unrelayed)


# An idle service says it is alive this often, and otherwise nothing.
HEARTBEAT_SECONDS = 600.0


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


class Summary:
    """Logs a `SummaryLine` every `interval` seconds unless idle (then one a `heartbeat`);
    `run_once` works one out now and logs it on the same terms."""

    def __init__(
        self,
        engine: AsyncEngine,
        clock: Clock,
        totals: Callable[[], BatchStats],
        *,
        interval: float = 60.0,
        heartbeat: float = HEARTBEAT_SECONDS,
        worker: str = "",
    ) -> None:
        self.worker = worker  # named in the line: each process of --processes N logs its own
        self._engine = engine
        self._clock = clock
        self._totals = totals
        self.interval = interval
        self.heartbeat = heartbeat
        # Counts and time since the last line logged (a quiet line is not logged).
        self._last_at = clock.now()
        self._last = _copy(totals())

    async def run_once(self) -> SummaryLine:
        now = self._clock.now()
        async with self._engine.connect() as conn:
            every_tenant = {"scope_id": None}  # the summary is the whole service's
            due = (await conn.execute(queries.STATS_OLDEST_DUE, {"now": now, **every_tenant})).one()
            relay = (await conn.execute(queries.STATS_RELAY_LAG, every_tenant)).one()
        totals = _copy(self._totals())
        last = self._last
        seconds = (now - self._last_at).total_seconds()
        line = SummaryLine(
            seconds=seconds,
            attempts=totals.claimed - last.claimed,
            succeeded=totals.succeeded - last.succeeded,
            retrying=totals.scheduled - last.scheduled,
            dead=totals.dead - last.dead,
            due=int(due.due),
            oldest_due_seconds=_age(now, due.oldest_due),
            unrelayed=int(relay.unrelayed),
            worker=self.worker,
        )
        if not line.idle or seconds >= self.heartbeat:
            log.info("%s", line.text())
            self._last, self._last_at = totals, now
        return line

    async def run(self, stop: asyncio.Event) -> None:
        if self.interval <= 0:
            return
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.interval)
            if stop.is_set():
                return
            try:
                await self.run_once()
                OUTAGE.succeeded()
            except Exception as exc:
                OUTAGE.failed("summary", exc)


def _copy(stats: BatchStats) -> BatchStats:
    copy = BatchStats()
    copy.merge(stats)
    return copy


def _age(now: dt.datetime, at: dt.datetime | None) -> float | None:
    return None if at is None else max(0.0, (now - at).total_seconds())
