"""Every SQL statement of the outbox package, named for what it does.

Hot-path statements are plain text with stable SQL so psycopg can prepare them;
they are set-based: one statement claims or fans out a whole batch.
"""

from __future__ import annotations

from sqlalchemy import text

EVENTS_CHANNEL = "outbox_events"
DELIVERIES_CHANNEL = "outbox_deliveries"

# One round trip in the common case: insert (or find the idempotent twin) and wake
# the relay. pg_notify is delivered only if the caller's transaction commits.
#
# The wake-up is debounced: only an event that finds no other unrelayed event sends
# one. Why: PostgreSQL serialises the commits of all notifying transactions (a
# cluster-wide lock held through the commit's WAL flush), which on the benchmark box
# cut application commits from ~2,000/s to ~700/s. While a backlog exists the relay
# is awake anyway (it re-polls at once after every batch that found work, and once
# more shortly after it runs dry), so the notification is needed only to wake an idle
# relay. The NOT EXISTS reads the small partial index of unrelayed events.
INSERT_EVENT = text(
    """
    WITH inserted AS (
        INSERT INTO outbox_events
            (message_id, event_type, payload, idempotency_key, ordering_key, priority)
        VALUES
            (:message_id, :event_type, CAST(:payload AS jsonb), :idempotency_key,
             :ordering_key, :priority)
        ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
        RETURNING message_id
    ), woken AS (
        SELECT pg_notify('outbox_events', '') FROM inserted
        WHERE NOT EXISTS (SELECT 1 FROM outbox_events WHERE relayed_at IS NULL)
    )
    SELECT message_id FROM inserted LEFT JOIN woken ON true
    UNION ALL
    SELECT message_id FROM outbox_events
    WHERE idempotency_key = :idempotency_key AND NOT EXISTS (SELECT 1 FROM inserted)
    """
)

# When a concurrent transaction inserted the same key after our statement's snapshot,
# the first query sees neither row; by now that transaction has committed.
FIND_EVENT_BY_IDEMPOTENCY_KEY = text(
    "SELECT message_id FROM outbox_events WHERE idempotency_key = :idempotency_key"
)


# An endpoint pattern is '*', an exact event type, or a prefix ending in '.*'.
_PATTERN_MATCHES = """
    EXISTS (
        SELECT 1 FROM unnest(e.event_types) AS p(pattern)
        WHERE p.pattern = '*'
           OR p.pattern = b.event_type
           OR (right(p.pattern, 2) = '.*' AND starts_with(b.event_type, left(p.pattern, -1)))
    )
"""

# Claim, fan out and mark one batch in one statement (and so one transaction).
# SKIP LOCKED lets several relays share the work; the relayed_at IS NULL filter
# (not an id watermark) means an event whose transaction commits after a later id
# was relayed is still picked up. The unique index on (event_id, endpoint_id) makes
# a second fan-out impossible even if two relays raced.
# The f-string inserts a constant fragment, never input.
RELAY_BATCH = text(
    f"""
    WITH batch AS (
        SELECT id, event_type, ordering_key, priority
        FROM outbox_events
        WHERE relayed_at IS NULL
        ORDER BY id
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    ), fanned AS (
        INSERT INTO deliveries
            (event_id, endpoint_id, state, max_attempts, next_attempt_at, priority,
             ordering_key, created_at, updated_at)
        SELECT b.id, e.id, 'scheduled', COALESCE(e.max_attempts, :max_attempts), :now,
               b.priority, b.ordering_key, :now, :now
        FROM batch b
        JOIN endpoints e ON e.enabled AND {_PATTERN_MATCHES}
        ORDER BY b.id, e.id
        ON CONFLICT (event_id, endpoint_id) WHERE replay_of IS NULL DO NOTHING
        RETURNING 1
    ), marked AS (
        UPDATE outbox_events o SET relayed_at = :now
        FROM batch WHERE o.id = batch.id
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM marked) AS events, (SELECT count(*) FROM fanned) AS deliveries
    """
)

NOTIFY_DELIVERIES_DUE = text(f"SELECT pg_notify('{DELIVERIES_CHANNEL}', '')")

INSERT_ENDPOINT = text(
    """
    INSERT INTO endpoints (uid, url, description, event_types, signing_secret)
    VALUES (:uid, :url, :description, :event_types, :signing_secret)
    RETURNING id
    """
)

SELECT_ENDPOINTS = text(
    """
    SELECT id, uid, url, description, event_types, enabled, disabled_reason, disabled_at,
           created_at
    FROM endpoints ORDER BY id
    """
)

SELECT_ENDPOINT_BY_UID = text(
    """
    SELECT id, uid, url, description, event_types, enabled, disabled_reason, disabled_at,
           created_at
    FROM endpoints WHERE uid = :uid
    """
)

SET_ENDPOINT_ENABLED = text(
    """
    UPDATE endpoints
    SET enabled = :enabled,
        disabled_reason = CASE WHEN :enabled THEN NULL ELSE CAST(:reason AS text) END,
        disabled_at = CASE WHEN :enabled THEN NULL ELSE now() END,
        updated_at = now()
    WHERE uid = :uid
    RETURNING id
    """
)

SET_ENDPOINT_SIGNING_SECRET = text(
    "UPDATE endpoints SET signing_secret = :signing_secret, updated_at = now() WHERE id = :id"
)

INSERT_AUDIT = text(
    """
    INSERT INTO audit_log (actor, action, target_type, target_id, reason, details, request_id)
    VALUES (:actor, :action, :target_type, :target_id, :reason, CAST(:details AS jsonb),
            :request_id)
    """
)
