"""The relay: turns committed events into one delivery per subscribed, enabled endpoint."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from outbox import direct
from outbox.catalogue import Mode, validate_pending
from outbox.clock import Clock
from outbox.direct import Statements
from outbox.notify import wait_for_any
from outbox.outage import OUTAGE
from outbox.schema_rules import DEFAULT_VALIDATION_BUDGET
from outbox.sql import relay as queries

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RelayConfig:
    batch_size: int = 500
    poll_interval: float = 1.0
    default_max_attempts: int = 8
    # Pattern -> max attempts (OUTBOX_EVENT_TYPE_RETRY); an endpoint's own value wins.
    max_attempts_by_event_type: Mapping[str, int] = field(default_factory=dict)
    # After a pass that found work and one that found none, look once more this soon:
    # publish() only wakes an idle relay (see outbox.sql.events.INSERT_EVENT), so this catches
    # an event whose transaction committed while the relay was finishing its backlog.
    linger: float = 0.05
    # After a partial batch, wait this long before the next pass so the next one is
    # bigger: each pass is a transaction, and back-to-back passes of a few events each
    # would spend a core on per-transaction overhead. Bounds the added latency.
    gather: float = 0.01
    # OUTBOX_EVENT_TYPES: what the schema check of SQL-published events does with an
    # unknown type ('strict' rejects it).
    event_types_mode: Mode = "accept"
    # Seconds one SQL-published payload's schema check may take (OUTBOX_VALIDATION_BUDGET_MS);
    # over it, the event is rejected with that reason and the batch goes on.
    validation_budget: float = DEFAULT_VALIDATION_BUDGET
    # How often held-back summaries of dead deliveries are published (outbox/operational).
    summary_interval: float = 10.0


@dataclass(frozen=True, slots=True)
class RelayResult:
    events: int
    deliveries: int
    rejected: int = 0
    handed_off: int = 0  # of `deliveries`, inserted already claimed for the local worker
    fed: int = 0  # entries appended to pull and push+pull endpoints' feeds
    skipped: int = 0  # (event, endpoint) pairs whose payload filter could not be evaluated


@dataclass(frozen=True, slots=True)
class Capacity:
    """What the worker of the relay's process takes straight from the relay's next pass."""

    limit: int  # deliveries at most (its free slots, reserved until `Handoff.take`)
    worker_id: str
    lease_expires_at: dt.datetime
    endpoint_slots: int  # per endpoint, unless `slots_left` says less
    slots_left: Mapping[int, int]  # endpoint id -> slots it may still take


class Handoff(Protocol):
    """The worker of this process (delivery.worker.Worker), seen from the relay.

    Fresh deliveries that a claim would take at once anyway go to it in the relay's own
    transaction (queries.RELAY_BATCH_HANDOFF) instead of being scheduled, notified,
    and claimed in another transaction. `reserve` is asked before each pass, after
    `settle` lets a claim of the worker's that is under way finish; every reservation is
    answered by exactly one `take` of it, with the rows the pass handed off (none when
    it failed).
    """

    async def settle(self) -> None: ...

    def reserve(self) -> Capacity | None: ...

    async def take(self, capacity: Capacity, rows: Sequence[Any], now: dt.datetime) -> None: ...


class _ToValidate(Exception):
    """A direct pass found SQL-published events waiting for their schema check."""


class Relay:
    def __init__(
        self,
        engine: AsyncEngine,
        clock: Clock,
        config: RelayConfig | None = None,
        *,
        on_deliveries: Callable[[], None] | None = None,
        handoff: Handoff | None = None,
    ) -> None:
        self._engine = engine
        self._clock = clock
        self.config = config or RelayConfig()
        self._on_deliveries = on_deliveries
        self._handoff = handoff
        self._next_summaries: dt.datetime | None = None
        # The last pass left SQL-published events to check: the next one starts on
        # SQLAlchemy (see _pass) rather than finding them again on psycopg.
        self._checks_pending = False
        # While `run` is busy, its passes' connection (see _pass); None outside `run`.
        self._held: direct.HeldConnection | None = None

    async def run_once(self) -> RelayResult:
        """Relay one batch in one transaction; returns how much it did.

        Events written by the SQL function outbox_publish() are checked against their
        schema first (the batch statement says whether any wait); a payload that breaks
        it is rejected, never sent. With a `handoff` (the worker of this process) that
        has free slots, the deliveries it may take at once are inserted already claimed
        for it and given to it after the commit (queries.RELAY_BATCH_HANDOFF).
        """
        capacity = None
        if self._handoff is not None:
            await self._handoff.settle()
            capacity = self._handoff.reserve()
        now = self._clock.now()
        handed: list[Any] = []
        try:
            result, handed = await self._pass(now, capacity)
        finally:
            if self._handoff is not None and capacity is not None:
                # After the commit: the rows are leased to that worker from now on. On a
                # failure none are given (if the commit did happen, their lease expires
                # and the reaper reschedules them).
                await self._handoff.take(capacity, handed, now)
        if result.skipped:
            log.warning(
                "%d events were skipped for an endpoint whose payload filter could not be "
                "evaluated on them (a type mismatch?); `outbox endpoints show` counts them",
                result.skipped,
            )
        if result.rejected:
            log.warning(
                "%d events broke their event type's schema and were rejected; "
                "`outbox events rejected` lists them",
                result.rejected,
            )
        if result.deliveries > result.handed_off and self._on_deliveries is not None:
            self._on_deliveries()
        return result

    async def _pass(
        self, now: dt.datetime, capacity: Capacity | None
    ) -> tuple[RelayResult, list[Any]]:
        """One pass in one transaction, on psycopg directly (outbox/direct.py): the pass
        runs several times a second, and SQLAlchemy's async bridge around its statements
        cost about a quarter of it. When SQL-published events wait for their schema check
        (validate_pending, SQLAlchemy ORM work), that transaction is rolled back and the
        pass runs again on SQLAlchemy, checks included, in one transaction as before; so
        do the next passes while the last one left events to check. A pass is two round
        trips (BEGIN with the batch statement, COMMIT), on the connection `run` holds
        while busy: no pool checkout and pre-ping per pass."""
        flush = self._next_summaries is None or now >= self._next_summaries
        done = None
        if not self._checks_pending:
            with contextlib.suppress(_ToValidate):
                # BEGIN goes out with the batch statement; within `run`, passes share one
                # connection while events keep coming (direct.HeldConnection).
                async with direct.transaction(
                    self._engine, pipelined=True, held=self._held
                ) as statements:
                    done = await self._relay(statements, now, capacity, flush=flush)
        if done is None:
            async with self._engine.begin() as conn:
                done = await self._relay(conn, now, capacity, flush=flush)
        if flush:
            self._next_summaries = now + dt.timedelta(seconds=self.config.summary_interval)
        return done

    async def _relay(
        self, conn: Statements, now: dt.datetime, capacity: Capacity | None, *, flush: bool
    ) -> tuple[RelayResult, list[Any]]:
        """A pass's statements on `conn`; on a DirectConnection, raises _ToValidate (before
        anything is committed) when SQL-published events wait for their schema check."""
        rejected = 0
        handed: list[Any] = []
        if flush:
            await conn.execute(queries.FLUSH_OPERATIONAL_SUMMARIES, {"now": now})
        if capacity is not None and capacity.limit > 0:
            rows = await self._batch_handing_off(conn, now, capacity)
            row = rows[0]
            handed = [r for r in rows if r.id is not None]
        else:
            row = await self._batch(conn, now)
        events, deliveries = int(row.events), int(row.deliveries)
        fed, skipped = int(row.fed), int(row.skipped)
        self._checks_pending = bool(row.to_validate)
        if row.to_validate:
            if not isinstance(conn, AsyncConnection):
                raise _ToValidate
            rejected = await conn.run_sync(
                lambda c: validate_pending(
                    c,
                    now=now,
                    mode=self.config.event_types_mode,
                    limit=self.config.batch_size,
                    budget=self.config.validation_budget,
                )
            )
            row = await self._batch(conn, now)
            events, deliveries = events + int(row.events), deliveries + int(row.deliveries)
            fed, skipped = fed + int(row.fed), skipped + int(row.skipped)
            self._checks_pending = bool(row.to_validate)
        result = RelayResult(
            events, deliveries, rejected, handed_off=len(handed), fed=fed, skipped=skipped
        )
        # Deliveries handed off need no wake-up: only scheduled ones are notified.
        if result.deliveries > result.handed_off:
            await conn.execute(queries.NOTIFY_DELIVERIES_DUE)
        return result, handed

    async def _batch_handing_off(
        self, conn: Statements, now: dt.datetime, capacity: Capacity
    ) -> list[Any]:
        return list(
            await conn.execute(
                queries.RELAY_BATCH_HANDOFF,
                {
                    "limit": self.config.batch_size,
                    "now": now,
                    "max_attempts": self.config.default_max_attempts,
                    "rule_patterns": list(self.config.max_attempts_by_event_type),
                    "rule_max_attempts": list(self.config.max_attempts_by_event_type.values()),
                    "handoff_limit": capacity.limit,
                    "worker_id": capacity.worker_id,
                    "lease_expires_at": capacity.lease_expires_at,
                    "endpoint_slots": capacity.endpoint_slots,
                    "slot_endpoint_ids": list(capacity.slots_left),
                    "slot_counts": list(capacity.slots_left.values()),
                },
            )
        )

    async def _batch(self, conn: Statements, now: dt.datetime) -> Any:
        return (
            await conn.execute(
                queries.RELAY_BATCH,
                {
                    "limit": self.config.batch_size,
                    "now": now,
                    "max_attempts": self.config.default_max_attempts,
                    "rule_patterns": list(self.config.max_attempts_by_event_type),
                    "rule_max_attempts": list(self.config.max_attempts_by_event_type.values()),
                },
            )
        ).one()

    async def run_until_idle(self) -> RelayResult:
        """Relay every batch there is now (tests and the demo use this)."""
        events = deliveries = rejected = fed = skipped = 0
        while True:
            result = await self.run_once()
            events += result.events
            deliveries += result.deliveries
            rejected += result.rejected
            fed += result.fed
            skipped += result.skipped
            if result.events < self.config.batch_size:
                return RelayResult(events, deliveries, rejected, fed=fed, skipped=skipped)

    async def run(self, stop: asyncio.Event, wakeup: asyncio.Event | None = None) -> None:
        """Relay until `stop` is set; a wake-up (NOTIFY) cuts the poll wait short."""
        held = self._held = direct.HeldConnection(self._engine)
        try:
            await self._run(stop, wakeup or asyncio.Event(), held)
        finally:
            self._held = None
            await held.release()

    async def _run(
        self, stop: asyncio.Event, wake: asyncio.Event, held: direct.HeldConnection
    ) -> None:
        busy = False
        while not stop.is_set():
            wake.clear()
            try:
                result = await self.run_once()
                OUTAGE.succeeded()
            except Exception as exc:
                OUTAGE.failed("relay", exc)
                result = RelayResult(0, 0)
            if result.events:
                # Keep going while there is a backlog: publishers do not notify then.
                busy = True
                if result.events < self.config.batch_size:
                    await wait_for_any(stop, timeout=self.config.gather)
                continue
            if not busy:
                await held.release()  # idle: no connection kept from the pool meanwhile
            timeout = self.config.linger if busy else self.config.poll_interval
            busy = False
            await wait_for_any(stop, wake, timeout=timeout)
