"""What happened to an event, for application code: `status()` and `status_by_subject()`.

An application tells its own user "the invoice webhook is delivered / still trying / stuck"
without the admin API or a token: the same connection it publishes on, scoped to the
tenant it published for (another tenant's message id is not found, like one that never
existed). Read-only; runs in the caller's transaction and never commits.

The event's overall state, from its newest delivery to each endpoint:

- `accepted`: committed, not yet fanned out by the relay (no deliveries yet);
- `in_progress`: some endpoint's delivery is scheduled or in flight;
- `delivered`: every endpoint's delivery succeeded (also when no endpoint subscribed:
  `endpoints` is then empty);
- `needs_attention`: some endpoint's delivery is dead, held (waiting for a person after
  an ambiguous outcome) or was discarded, or the relay rejected the event (its payload
  broke its schema). A person decides: replay, confirm, discard. It wins over
  `in_progress`: one stuck endpoint is news even while others are still trying.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import psycopg
from psycopg.rows import tuple_row
from sqlalchemy import TextClause
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from outbox.errors import PublishError
from outbox.publish import AsyncAnyConnection, SyncConnection, unstorable_text, validate_subject
from outbox.sql.status import SELECT_EVENT_STATUS, SELECT_SUBJECT_STATUS
from outbox.tenants import DEFAULT_TENANT, validate_tenant_uid

EventState = Literal["accepted", "in_progress", "delivered", "needs_attention"]
EVENT_STATES: tuple[EventState, ...] = ("accepted", "in_progress", "delivered", "needs_attention")
# Delivery states that wait for a person. `held` is the state of a delivery whose outcome
# was ambiguous under the "hold" policy; listed here so it maps right wherever it exists.
ATTENTION_STATES = frozenset({"dead", "held", "discarded"})
PENDING_STATES = frozenset({"scheduled", "in_flight"})
MAX_SUBJECT_EVENTS = 100


@dataclass(frozen=True, slots=True)
class EndpointStatus:
    """An event's newest delivery to one endpoint (a replay supersedes the one it replays)."""

    endpoint: str
    delivery_id: int
    state: str  # the delivery's state: scheduled, in_flight, succeeded, dead, discarded, held
    attempts: int
    last_outcome: str | None  # of the last attempt: succeeded, retryable, permanent, ambiguous
    last_status_code: int | None
    last_error: str | None
    next_attempt_at: dt.datetime | None  # only while it is scheduled
    delivered_at: dt.datetime | None  # only once it succeeded


@dataclass(frozen=True, slots=True)
class EventStatus:
    message_id: str
    event_type: str
    subject: str | None
    state: EventState
    created_at: dt.datetime
    relayed_at: dt.datetime | None
    rejected_reason: str | None
    endpoints: tuple[EndpointStatus, ...]

    def as_json(self) -> dict[str, Any]:
        """Plain JSON types (times as ISO 8601), for an application's own API."""

        def iso(value: dt.datetime | None) -> str | None:
            return value.isoformat() if value else None

        return {
            "message_id": self.message_id,
            "event_type": self.event_type,
            "subject": self.subject,
            "state": self.state,
            "created_at": iso(self.created_at),
            "relayed_at": iso(self.relayed_at),
            "rejected_reason": self.rejected_reason,
            "endpoints": [
                {
                    "endpoint": e.endpoint,
                    "delivery_id": e.delivery_id,
                    "state": e.state,
                    "attempts": e.attempts,
                    "last_outcome": e.last_outcome,
                    "last_status_code": e.last_status_code,
                    "last_error": e.last_error,
                    "next_attempt_at": iso(e.next_attempt_at),
                    "delivered_at": iso(e.delivered_at),
                }
                for e in self.endpoints
            ],
        }


def overall_state(delivery_states: Sequence[str], *, relayed: bool, rejected: bool) -> EventState:
    """The event's state from its endpoints' newest deliveries (see the module docstring)."""
    if rejected or any(state in ATTENTION_STATES for state in delivery_states):
        return "needs_attention"
    if not relayed and not delivery_states:
        return "accepted"
    if any(state in PENDING_STATES for state in delivery_states):
        return "in_progress"
    if all(state == "succeeded" for state in delivery_states):
        return "delivered"
    # A state this release does not know (a newer release's): someone should look.
    return "needs_attention"


Row = Sequence[Any]


def _events(rows: Sequence[Row]) -> list[EventStatus]:
    """Group the (event, endpoint) rows of SELECT_*_STATUS into one status per event."""
    grouped: dict[str, list[Row]] = {}
    for row in rows:
        grouped.setdefault(row[0], []).append(row)
    result = []
    for event_rows in grouped.values():
        first = event_rows[0]
        endpoints = tuple(
            EndpointStatus(
                endpoint=str(row[7]),
                delivery_id=int(row[6]),
                state=str(row[8]),
                attempts=int(row[9]),
                last_outcome=row[14],
                last_status_code=row[12],
                last_error=row[13],
                next_attempt_at=row[10] if row[8] == "scheduled" else None,
                delivered_at=row[11] if row[8] == "succeeded" else None,
            )
            for row in event_rows
            if row[6] is not None
        )
        result.append(
            EventStatus(
                message_id=str(first[0]),
                event_type=str(first[1]),
                subject=first[2],
                state=overall_state(
                    [e.state for e in endpoints],
                    relayed=first[4] is not None,
                    rejected=first[5] is not None,
                ),
                created_at=first[3],
                relayed_at=first[4],
                rejected_reason=first[5],
                endpoints=endpoints,
            )
        )
    return result


@functools.lru_cache(maxsize=8)
def _psycopg_sql(statement: TextClause) -> str:
    return str(statement.compile(dialect=PGDialect_psycopg()))  # type: ignore[no-untyped-call]


def _run(conn: SyncConnection, statement: TextClause, params: dict[str, Any]) -> Sequence[Row]:
    if isinstance(conn, psycopg.Connection):
        with conn.cursor(row_factory=tuple_row) as cursor:
            cursor.execute(_psycopg_sql(statement), params)
            return cursor.fetchall()
    connection = conn.connection() if isinstance(conn, Session) else conn
    return connection.execute(statement, params).all()


async def _run_async(
    conn: AsyncAnyConnection, statement: TextClause, params: dict[str, Any]
) -> Sequence[Row]:
    if isinstance(conn, psycopg.AsyncConnection):
        async with conn.cursor(row_factory=tuple_row) as cursor:
            await cursor.execute(_psycopg_sql(statement), params)
            return await cursor.fetchall()
    connection = await conn.connection() if isinstance(conn, AsyncSession) else conn
    return (await connection.execute(statement, params)).all()


def _event_params(message_id: str, tenant: str) -> dict[str, Any]:
    if (
        not isinstance(message_id, str)
        or not message_id
        or len(message_id) > 255
        or unstorable_text(message_id)
    ):
        raise PublishError("message_id must be the id publish() returned, e.g. msg_...")
    return {"message_id": message_id, "tenant": validate_tenant_uid(tenant, error=PublishError)}


def _subject_params(subject: str, tenant: str, limit: int) -> dict[str, Any]:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 0 < limit <= MAX_SUBJECT_EVENTS:
        raise PublishError(f"limit must be an integer from 1 to {MAX_SUBJECT_EVENTS}")
    return {
        "subject": validate_subject(subject),
        "tenant": validate_tenant_uid(tenant, error=PublishError),
        "limit": limit,
    }


def status(
    conn: SyncConnection, message_id: str, *, tenant: str = DEFAULT_TENANT
) -> EventStatus | None:
    """The state of the event `publish()` returned `message_id` for, or None when `tenant`
    has no such event (another tenant's id answers None too)."""
    found = _events(_run(conn, SELECT_EVENT_STATUS, _event_params(message_id, tenant)))
    return found[0] if found else None


async def status_async(
    conn: AsyncAnyConnection, message_id: str, *, tenant: str = DEFAULT_TENANT
) -> EventStatus | None:
    """The asyncio twin of `status`."""
    rows = await _run_async(conn, SELECT_EVENT_STATUS, _event_params(message_id, tenant))
    found = _events(rows)
    return found[0] if found else None


def status_by_subject(
    conn: SyncConnection, subject: str, *, tenant: str = DEFAULT_TENANT, limit: int = 20
) -> list[EventStatus]:
    """`tenant`'s newest events published with `subject` (at most `limit`), newest first."""
    return _events(_run(conn, SELECT_SUBJECT_STATUS, _subject_params(subject, tenant, limit)))


async def status_by_subject_async(
    conn: AsyncAnyConnection, subject: str, *, tenant: str = DEFAULT_TENANT, limit: int = 20
) -> list[EventStatus]:
    """The asyncio twin of `status_by_subject`."""
    rows = await _run_async(conn, SELECT_SUBJECT_STATUS, _subject_params(subject, tenant, limit))
    return _events(rows)
