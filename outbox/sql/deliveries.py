"""What an operator does to deliveries (outbox/deliveries.py): search, inspect, replay,
discard; and the test deliveries of `outbox endpoints test` (outbox/testevents.py).
Every operator statement keeps to the caller's tenant (outbox/sql/scope.py)."""

from __future__ import annotations

from sqlalchemy import text

from outbox.sql.scope import in_scope

# Whose failure a delivery is (migration 0031): the endpoint's owner, else its event type's.
_OWNER = """COALESCE(e.owner, (SELECT ot.owner FROM event_types ot
                              WHERE ot.name = ev.event_type))"""

# Which deliveries a search or bulk replay matches.
# Search takes every filter as an optional bind parameter, so one prepared statement
# serves every combination. Paging is keyset on id (newest first): pass the last id seen.
_DELIVERY_FILTER = f"""
    {in_scope("d.tenant_id")}
    AND (CAST(:states AS text[]) IS NULL OR d.state = ANY(CAST(:states AS text[])))
    AND (CAST(:endpoint AS text) IS NULL OR e.uid = :endpoint)
    AND (CAST(:event_type AS text) IS NULL OR ev.event_type = :event_type)
    AND (CAST(:message_id AS text) IS NULL OR ev.message_id = :message_id)
    AND (CAST(:subject AS text) IS NULL OR ev.subject = :subject)
    AND (CAST(:owner AS text) IS NULL OR {_OWNER} = :owner)
    AND (CAST(:since AS timestamptz) IS NULL OR d.created_at >= :since)
    AND (CAST(:until AS timestamptz) IS NULL OR d.created_at < :until)
    AND (CAST(:before_id AS bigint) IS NULL OR d.id < :before_id)
    AND (NOT CAST(:unreplayed AS boolean)
         OR NOT EXISTS (SELECT 1 FROM deliveries r WHERE r.replay_of = d.id))
    AND (CAST(:error AS text) IS NULL
         OR strpos(lower(coalesce(d.last_error, '') || ' ' || coalesce(d.final_reason, '')),
                   lower(:error)) > 0
         OR EXISTS (SELECT 1 FROM delivery_attempts a
                    WHERE a.delivery_id = d.id AND strpos(lower(a.error), lower(:error)) > 0))
"""

# What a delivery listing shows of each delivery.
_DELIVERY_COLUMNS = f"""
    d.id, d.state, d.attempts, d.max_attempts, d.next_attempt_at, d.last_status_code,
    d.last_error, d.final_reason, d.replay_of, d.created_at, d.updated_at, d.completed_at,
    e.uid AS endpoint_uid, e.url AS endpoint_url, ev.message_id, ev.event_type, ev.subject,
    (SELECT t.uid FROM tenants t WHERE t.id = d.tenant_id) AS tenant,
    {_OWNER} AS owner
"""

# One page of matching deliveries, newest first.
SEARCH_DELIVERIES = text(
    f"""
    SELECT {_DELIVERY_COLUMNS}
    FROM deliveries d
    JOIN endpoints e ON e.id = d.endpoint_id
    JOIN outbox_events ev ON ev.id = d.event_id
    WHERE {_DELIVERY_FILTER}
    ORDER BY d.id DESC
    LIMIT :limit
    """
)

# How many deliveries match (a bulk replay's count before it acts).
COUNT_DELIVERIES = text(
    f"""
    SELECT count(*)
    FROM deliveries d
    JOIN endpoints e ON e.id = d.endpoint_id
    JOIN outbox_events ev ON ev.id = d.event_id
    WHERE {_DELIVERY_FILTER}
    """
)

# One delivery in full, with its event and lease.
SELECT_DELIVERY = text(
    f"""
    SELECT {_DELIVERY_COLUMNS}, ev.payload, ev.created_at AS event_created_at,
           ev.relayed_at AS event_relayed_at, d.locked_by, d.lease_expires_at
    FROM deliveries d
    JOIN endpoints e ON e.id = d.endpoint_id
    JOIN outbox_events ev ON ev.id = d.event_id
    WHERE d.id = :id AND {in_scope("d.tenant_id")}
    """
)

# A delivery's attempt history, oldest first.
SELECT_ATTEMPTS = text(
    """
    SELECT attempt_number, started_at, duration_ms, status_code, outcome, error,
           response_excerpt, request_headers, worker_id
    FROM delivery_attempts WHERE delivery_id = :id ORDER BY attempt_number, id
    """
)

# Replays of a delivery, with who asked for each and why (from the audit row).
SELECT_REPLAYS = text(
    """
    SELECT d.id, d.state, d.created_at, a.actor, a.reason
    FROM deliveries d
    LEFT JOIN audit_log a
      ON a.action = 'delivery.replay' AND a.target_type = 'delivery'
     AND a.target_id = CAST(d.replay_of AS text) AND a.details ->> 'replay_id' = CAST(d.id AS text)
    WHERE d.replay_of = :id
    ORDER BY d.id
    """
)

# The states of these deliveries, in scope (a discard's check before it writes).
SELECT_DELIVERY_STATES = text(
    f"""
    SELECT id, state FROM deliveries
    WHERE id = ANY(CAST(:ids AS bigint[])) AND {in_scope("tenant_id")}
    """
)

# Lock the deliveries a replay replays, and read their states.
# A replay locks the rows it replays, in id order (so concurrent replays never
# deadlock): a second replay of the same delivery waits for the first to commit and
# then sees its replay. The originals are terminal, so no worker ever waits on this.
LOCK_DELIVERIES_FOR_REPLAY = text(
    f"""
    SELECT id, state FROM deliveries
    WHERE id = ANY(CAST(:ids AS bigint[])) AND {in_scope("tenant_id")}
    ORDER BY id FOR UPDATE
    """
)

# The newest replay of each of these deliveries, if any (read after the lock above).
SELECT_LATEST_REPLAYS = text(
    """
    SELECT DISTINCT ON (replay_of) replay_of, id, state
    FROM deliveries WHERE replay_of = ANY(CAST(:ids AS bigint[]))
    ORDER BY replay_of, id DESC
    """
)

# Insert the replays, each due at its own time, and wake the workers.
# A replay is a NEW row for the same event and endpoint (so the same webhook-id);
# the old row is only read. Each replay gets its own start time so a bulk replay is
# spread out (the rate cap). The WHERE re-checks the states under the same snapshot.
INSERT_REPLAYS = text(
    f"""
    WITH wanted AS (
        SELECT * FROM unnest(CAST(:ids AS bigint[]), CAST(:due AS timestamptz[])) AS w(id, due)
    ), inserted AS (
        INSERT INTO deliveries
            (event_id, endpoint_id, tenant_id, state, max_attempts, next_attempt_at, priority,
             ordering_key, replay_of, created_at, updated_at)
        SELECT d.event_id, d.endpoint_id, d.tenant_id, 'scheduled',
               COALESCE(e.max_attempts, d.max_attempts),
               w.due, d.priority, d.ordering_key, d.id, :now, :now
        FROM wanted w
        JOIN deliveries d ON d.id = w.id
        JOIN endpoints e ON e.id = d.endpoint_id
        WHERE d.state = ANY(CAST(:allowed AS text[])) AND {in_scope("d.tenant_id")}
        ORDER BY w.due, d.id
        ON CONFLICT (replay_of)
            WHERE replay_of IS NOT NULL AND state IN ('scheduled', 'in_flight') DO NOTHING
        RETURNING id, replay_of
    ), woken AS (
        SELECT pg_notify('outbox_deliveries', '') WHERE EXISTS (SELECT 1 FROM inserted)
    )
    SELECT id, replay_of FROM inserted LEFT JOIN woken ON true
    """
)

# Discard deliveries for good, with the reason.
# Discarding is terminal; in-flight rows are left alone (the attempt may be landing).
DISCARD_DELIVERIES = text(
    f"""
    UPDATE deliveries
    SET state = 'discarded', final_reason = :reason, locked_by = NULL, lease_expires_at = NULL,
        updated_at = :now, completed_at = :now
    WHERE id = ANY(CAST(:ids AS bigint[])) AND state IN ('scheduled', 'dead', 'held')
      AND {in_scope("tenant_id")}
    RETURNING id
    """
)

# Settle held deliveries (outbox/deliveries.py, resolve_held), guarded by the state: two
# operators acting at once cannot both settle one. 'succeeded' (confirmed delivered by a
# person) finishes it with the reason; 'scheduled' sends the SAME delivery again now
# (its attempts kept, its webhook-id the event's, so the receiver can de-duplicate).
RESOLVE_HELD = text(
    f"""
    WITH settled AS (
        UPDATE deliveries
        SET state = CAST(:to_state AS text),
            final_reason = CASE WHEN CAST(:to_state AS text) = 'succeeded' THEN :reason END,
            next_attempt_at = CASE WHEN CAST(:to_state AS text) = 'scheduled' THEN :now
                                   ELSE next_attempt_at END,
            updated_at = :now,
            completed_at = CASE WHEN CAST(:to_state AS text) = 'succeeded' THEN :now END
        WHERE id = ANY(CAST(:ids AS bigint[])) AND state = 'held'
          AND {in_scope("tenant_id")}
        RETURNING id
    ), woken AS (
        SELECT pg_notify('outbox_deliveries', '')
        WHERE CAST(:to_state AS text) = 'scheduled' AND EXISTS (SELECT 1 FROM settled)
    )
    SELECT id FROM settled LEFT JOIN woken ON true
    """
)

# Send a test event to one endpoint (`outbox endpoints test`).
# The event is born relayed, so
# it reaches this endpoint only, through the real worker, with one attempt and top priority.
INSERT_TEST_DELIVERY = text(
    """
    WITH ep AS (
        SELECT id, tenant_id FROM endpoints WHERE uid = :uid
    ), ev AS (
        INSERT INTO outbox_events (message_id, tenant_id, event_type, payload, priority,
                                   created_at, relayed_at)
        SELECT :message_id, ep.tenant_id, :event_type, CAST(:payload AS jsonb), 100, :now, :now
        FROM ep
        RETURNING id
    ), d AS (
        INSERT INTO deliveries (event_id, endpoint_id, tenant_id, state, max_attempts,
                                next_attempt_at, priority, created_at, updated_at)
        SELECT ev.id, ep.id, ep.tenant_id, 'scheduled', 1, :now, 100, :now, :now
        FROM ev, ep
        RETURNING id
    )
    SELECT d.id, pg_notify('outbox_deliveries', '') FROM d
    """
)

# How a test delivery went: its state and its last attempt.
SELECT_TEST_OUTCOME = text(
    """
    SELECT d.state, d.attempts, d.last_status_code, d.last_error, d.final_reason,
           a.duration_ms
    FROM deliveries d
    LEFT JOIN LATERAL (
        SELECT duration_ms FROM delivery_attempts WHERE delivery_id = d.id
        ORDER BY id DESC LIMIT 1
    ) a ON true
    WHERE d.id = :id
    """
)

# For each of these deliveries, a newer event that supersedes its event at the same
# endpoint, if any: same tenant and event type, same subject or same ordering key, published
# later (a higher id), with a succeeded delivery to that endpoint. Replaying the old one
# would hand the receiver an older state after the newer one (replay asks first).
# Cost: index lookups, never a walk of the history. The subject arm walks
# ix_outbox_events_tenant_id_subject backwards from the newest event of that subject down
# to this one (only that subject's newer events) and checks each with
# ix_deliveries_event_id_endpoint_id; the ordering-key arm is one range of
# ix_deliveries_ordering (endpoint, key, event id > this one). tests/test_replay_superseded.py
# holds the plan to that (EXPLAIN).
SELECT_SUPERSEDING_EVENTS = text(
    """
    SELECT d.id, newer.message_id
    FROM deliveries d
    JOIN outbox_events ev ON ev.id = d.event_id
    CROSS JOIN LATERAL (
        SELECT c.message_id FROM (
            (SELECT n.id, n.message_id FROM outbox_events n
             WHERE ev.subject IS NOT NULL
               AND n.tenant_id = ev.tenant_id AND n.subject = ev.subject AND n.id > ev.id
               AND n.event_type = ev.event_type
               AND EXISTS (SELECT 1 FROM deliveries s
                           WHERE s.event_id = n.id AND s.endpoint_id = d.endpoint_id
                             AND s.state = 'succeeded')
             ORDER BY n.id DESC LIMIT 1)
            UNION ALL
            (SELECT n.id, n.message_id FROM deliveries s
             JOIN outbox_events n ON n.id = s.event_id
             WHERE d.ordering_key IS NOT NULL
               AND s.endpoint_id = d.endpoint_id AND s.ordering_key = d.ordering_key
               AND s.event_id > d.event_id AND s.state = 'succeeded'
               AND n.tenant_id = ev.tenant_id AND n.event_type = ev.event_type
             ORDER BY s.event_id DESC LIMIT 1)
        ) c
        ORDER BY c.id DESC LIMIT 1
    ) newer
    WHERE d.id = ANY(CAST(:ids AS bigint[]))
    """
)
