"""What application code asks about its own events (outbox/status.py): one event by message
id, or a tenant's events about one subject, each with its newest delivery per endpoint.

Tenant-aware in the query: an event of another tenant matches nothing, exactly like a
message id that never existed. One round trip per question; each part reads an index (the
message id's unique index or ix_outbox_events_tenant_id_subject, then
ix_deliveries_event_id_endpoint_id, then the attempt numbers' unique index).
"""

from __future__ import annotations

from sqlalchemy import text

_EVENT_COLUMNS = (
    "o.id, o.message_id, o.event_type, o.subject, o.created_at, o.relayed_at, o.rejected_reason"
)

# One row per (event, endpoint): the event's columns, then its newest delivery to that
# endpoint (a replay supersedes the delivery it replays) with its last attempt's outcome.
# An event without deliveries yet gives one row with NULL delivery columns.
_EVENT_WITH_DELIVERIES = """
    SELECT ev.message_id, ev.event_type, ev.subject, ev.created_at, ev.relayed_at,
           ev.rejected_reason,
           d.id AS delivery_id, e.uid AS endpoint, d.state, d.attempts, d.next_attempt_at,
           d.completed_at, d.last_status_code, coalesce(d.last_error, d.final_reason),
           a.outcome
    FROM ev
    LEFT JOIN LATERAL (
        SELECT DISTINCT ON (x.endpoint_id) x.*
        FROM deliveries x WHERE x.event_id = ev.id
        ORDER BY x.endpoint_id, x.id DESC
    ) d ON true
    LEFT JOIN endpoints e ON e.id = d.endpoint_id
    LEFT JOIN LATERAL (
        SELECT outcome FROM delivery_attempts
        WHERE delivery_id = d.id ORDER BY attempt_number DESC LIMIT 1
    ) a ON true
    ORDER BY ev.id DESC, e.uid
"""

# One event by its message id, if it is this tenant's.
SELECT_EVENT_STATUS = text(
    f"""
    WITH ev AS (
        SELECT {_EVENT_COLUMNS} FROM outbox_events o
        WHERE o.message_id = :message_id
          AND o.tenant_id = (SELECT id FROM tenants WHERE uid = :tenant)
    )
    {_EVENT_WITH_DELIVERIES}
    """
)

# A tenant's newest events about one subject (ix_outbox_events_tenant_id_subject).
SELECT_SUBJECT_STATUS = text(
    f"""
    WITH ev AS (
        SELECT {_EVENT_COLUMNS} FROM outbox_events o
        WHERE o.tenant_id = (SELECT id FROM tenants WHERE uid = :tenant)
          AND o.subject = :subject
        ORDER BY o.id DESC
        LIMIT :limit
    )
    {_EVENT_WITH_DELIVERIES}
    """
)
