"""Default priorities per event type: a password reset goes before a bulk export.

`publish()` uses the event type's default when the call gives no priority; the
relay copies the event's priority onto each delivery, and workers claim due
deliveries highest priority first.
"""

from __future__ import annotations

from sqlalchemy import Connection

from outbox.audit import record_audit
from outbox.errors import PublishError
from outbox.publish import _EVENT_TYPE, _PRIORITY_RANGE
from outbox.sql import events as queries


def set_event_type_priority(
    conn: Connection, event_type: str, priority: int, *, actor: str
) -> None:
    """Set an event type's default priority (-100..100, higher first); never commits."""
    if not _EVENT_TYPE.match(event_type):
        raise PublishError(f"event type {event_type!r} is invalid, e.g. 'password.reset'")
    if priority not in _PRIORITY_RANGE:
        raise PublishError("priority must be an integer from -100 to 100 (higher goes first)")
    conn.execute(queries.SET_EVENT_TYPE_PRIORITY, {"event_type": event_type, "priority": priority})
    record_audit(
        conn,
        actor=actor,
        action="event_type.priority",
        target_type="event_type",
        target_id=event_type,
        details={"priority": priority},
    )


def clear_event_type_priority(conn: Connection, event_type: str, *, actor: str) -> bool:
    """Remove an event type's default (it goes back to 0); False if it had none."""
    removed = conn.execute(queries.DELETE_EVENT_TYPE_PRIORITY, {"event_type": event_type}).first()
    if removed is not None:
        record_audit(
            conn,
            actor=actor,
            action="event_type.priority_cleared",
            target_type="event_type",
            target_id=event_type,
        )
    return removed is not None


def list_event_type_priorities(conn: Connection) -> dict[str, int]:
    return {
        row.event_type: int(row.priority)
        for row in conn.execute(queries.SELECT_EVENT_TYPE_PRIORITIES)
    }
