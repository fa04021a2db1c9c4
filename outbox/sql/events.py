"""Publishing: the event row written in the caller's transaction (outbox/publish.py), and
the event types' default priorities it takes (outbox/priorities.py)."""

from __future__ import annotations

from sqlalchemy import text


# The canonical hash of a payload: sha256 of PostgreSQL's text of the jsonb value (keys in
# jsonb's fixed order, fixed spacing, duplicate keys merged), so publish(), outbox_publish()
# and rows written before the payload_hash column (hashed here on the fly) agree by
# construction. Numbers keep their written form: 1 and 1.0 differ, as the receiver sees.
def _canonical_hash(payload: str) -> str:
    return f"sha256(convert_to(CAST({payload} AS text), 'UTF8'))"


# What makes a publish with an existing idempotency key another operation: NULL when it is
# the same input (the first event's id is the answer), else what differs (for the error).
# `o` is the first event.
_DIFFERS = f"""
    CASE WHEN o.event_type <> :event_type THEN 'event type'
         WHEN o.ordering_key IS DISTINCT FROM CAST(:ordering_key AS text) THEN 'ordering key'
         WHEN coalesce(o.payload_hash, {_canonical_hash("o.payload")})
              <> {_canonical_hash("CAST(:payload AS jsonb)")} THEN 'payload'
    END
"""

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
#
# A key already used answers the first event's id and what differs (_DIFFERS): publish()
# refuses other input under the same key, and nothing was written (DO NOTHING).
INSERT_EVENT = text(
    f"""
    WITH current_type AS (
        -- the catalogue revision publish() validated against is still the current one
        SELECT COALESCE((SELECT revision FROM event_types WHERE name = :event_type), '')
               = :catalogue_revision AS ok
    ), tenant AS (
        SELECT id FROM tenants WHERE uid = :tenant AND (SELECT ok FROM current_type)
    ), inserted AS (
        INSERT INTO outbox_events
            (message_id, tenant_id, event_type, payload, idempotency_key, ordering_key,
             priority, traceparent, subject, payload_hash)
        SELECT :message_id, tenant.id, :event_type, CAST(:payload AS jsonb), :idempotency_key,
               :ordering_key,
               COALESCE(CAST(:priority AS smallint),
                        (SELECT p.priority FROM event_type_priorities p
                         WHERE p.event_type = :event_type),
                        0),
               :traceparent, :subject,
               -- only keyed events are ever compared: unkeyed ones skip the hashing
               CASE WHEN CAST(:idempotency_key AS text) IS NOT NULL
                    THEN {_canonical_hash("CAST(:payload AS jsonb)")} END
        FROM tenant
        ON CONFLICT (tenant_id, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
        RETURNING message_id
    ), woken AS (
        SELECT pg_notify('outbox_events', '') FROM inserted
        WHERE NOT EXISTS (SELECT 1 FROM outbox_events WHERE relayed_at IS NULL)
    )
    SELECT message_id, CAST(NULL AS text) AS differs FROM inserted LEFT JOIN woken ON true
    UNION ALL
    SELECT o.message_id, {_DIFFERS} FROM outbox_events o
    WHERE o.tenant_id = (SELECT id FROM tenant) AND o.idempotency_key = :idempotency_key
      AND NOT EXISTS (SELECT 1 FROM inserted)
    UNION ALL
    -- an unknown tenant: nothing was inserted; publish() raises (refusing is the default)
    SELECT NULL, NULL WHERE NOT EXISTS (SELECT 1 FROM tenant) AND (SELECT ok FROM current_type)
    UNION ALL
    -- the catalogue changed since publish() cached the type: nothing was inserted;
    -- publish() re-reads the type, validates again and retries
    SELECT '', NULL WHERE NOT (SELECT ok FROM current_type)
    """
)

# An event's idempotent twin committed by a concurrent transaction, and what differs.
# When a concurrent transaction inserted the same key after our statement's snapshot,
# the first query sees neither row; by now that transaction has committed (our insert
# waited for it), so this statement's fresh snapshot sees it and compares it the same way.
FIND_EVENT_BY_IDEMPOTENCY_KEY = text(
    f"""
    SELECT o.message_id, {_DIFFERS} FROM outbox_events o
    WHERE o.tenant_id = (SELECT id FROM tenants WHERE uid = :tenant)
      AND o.idempotency_key = :idempotency_key
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
