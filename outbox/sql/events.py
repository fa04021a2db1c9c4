"""Publishing: the event row written in the caller's transaction (outbox/publish.py), and
the event types' default priorities it takes (outbox/priorities.py)."""

from __future__ import annotations

from sqlalchemy import text

# Publish one event: insert it, or find its idempotent twin, and wake the relay.
# One round trip in the common case: insert (or find the idempotent twin) and wake
# the relay. pg_notify is delivered only if the caller's transaction commits.
# Without an explicit priority the event type's default applies (event_type_priorities).
#
# The wake-up is debounced: only an event that finds no other unrelayed event sends
# one. Why: PostgreSQL serialises the commits of all notifying transactions (a
# cluster-wide lock held through the commit's WAL flush), which on the benchmark box
# cut application commits from ~2,000/s to ~700/s. While a backlog exists the relay
# is awake anyway (it re-polls at once after every batch that found work, and once
# more shortly after it runs dry), so the notification is needed only to wake an idle
# relay. The NOT EXISTS reads the small partial index of unrelayed events.
#
# The catalogue check costs one index lookup in the same statement: it is how publish()
# trusts its cached schema without a query of its own (outbox/catalogue.py).
INSERT_EVENT = text(
    """
    WITH current_type AS (
        -- the catalogue revision publish() validated against is still the current one
        SELECT COALESCE((SELECT revision FROM event_types WHERE name = :event_type), '')
               = :catalogue_revision AS ok
    ), tenant AS (
        SELECT id FROM tenants WHERE uid = :tenant AND (SELECT ok FROM current_type)
    ), inserted AS (
        INSERT INTO outbox_events
            (message_id, tenant_id, event_type, payload, idempotency_key, ordering_key,
             priority, traceparent)
        SELECT :message_id, tenant.id, :event_type, CAST(:payload AS jsonb), :idempotency_key,
               :ordering_key,
               COALESCE(CAST(:priority AS smallint),
                        (SELECT p.priority FROM event_type_priorities p
                         WHERE p.event_type = :event_type),
                        0),
               :traceparent
        FROM tenant
        ON CONFLICT (tenant_id, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
        RETURNING message_id
    ), woken AS (
        SELECT pg_notify('outbox_events', '') FROM inserted
        WHERE NOT EXISTS (SELECT 1 FROM outbox_events WHERE relayed_at IS NULL)
    )
    SELECT message_id FROM inserted LEFT JOIN woken ON true
    UNION ALL
    SELECT message_id FROM outbox_events
    WHERE tenant_id = (SELECT id FROM tenant) AND idempotency_key = :idempotency_key
      AND NOT EXISTS (SELECT 1 FROM inserted)
    UNION ALL
    -- an unknown tenant: nothing was inserted; publish() raises (refusing is the default)
    SELECT NULL WHERE NOT EXISTS (SELECT 1 FROM tenant) AND (SELECT ok FROM current_type)
    UNION ALL
    -- the catalogue changed since publish() cached the type: nothing was inserted;
    -- publish() re-reads the type, validates again and retries
    SELECT '' WHERE NOT (SELECT ok FROM current_type)
    """
)

# An event's idempotent twin committed by a concurrent transaction.
# When a concurrent transaction inserted the same key after our statement's snapshot,
# the first query sees neither row; by now that transaction has committed.
FIND_EVENT_BY_IDEMPOTENCY_KEY = text(
    """
    SELECT message_id FROM outbox_events
    WHERE tenant_id = (SELECT id FROM tenants WHERE uid = :tenant)
      AND idempotency_key = :idempotency_key
    """
)

# Set an event type's default priority (`outbox priorities`).
SET_EVENT_TYPE_PRIORITY = text(
    """
    INSERT INTO event_type_priorities (event_type, priority, updated_at)
    VALUES (:event_type, :priority, now())
    ON CONFLICT (event_type) DO UPDATE SET priority = EXCLUDED.priority, updated_at = now()
    """
)

# Drop an event type's default priority: its events go back to 0.
DELETE_EVENT_TYPE_PRIORITY = text(
    "DELETE FROM event_type_priorities WHERE event_type = :event_type RETURNING event_type"
)

# Every default priority, highest first.
SELECT_EVENT_TYPE_PRIORITIES = text(
    "SELECT event_type, priority FROM event_type_priorities ORDER BY priority DESC, event_type"
)
