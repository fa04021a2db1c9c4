"""Every SQL statement of the delivery package, named for what it does.

Claims and outcome writes are one statement per batch. Every write to an
in-flight row is guarded by `state = 'in_flight' AND locked_by = :worker_id`, so a
worker whose lease was rescued can never overwrite what happened since.
"""

from __future__ import annotations

from sqlalchemy import text

# Claim due deliveries of enabled endpoints, highest priority first, and lease them.
# The claim commits before any HTTP request starts.
CLAIM_DUE_DELIVERIES = text(
    """
    WITH due AS (
        SELECT d.id
        FROM deliveries d
        JOIN endpoints e ON e.id = d.endpoint_id
        WHERE d.state = 'scheduled' AND d.next_attempt_at <= :now AND e.enabled
        ORDER BY d.priority DESC, d.next_attempt_at
        LIMIT :limit
        FOR UPDATE OF d SKIP LOCKED
    )
    UPDATE deliveries d
    SET state = 'in_flight', locked_by = :worker_id, lease_expires_at = :lease_expires_at,
        updated_at = :now
    FROM due, outbox_events ev, endpoints e
    WHERE d.id = due.id AND ev.id = d.event_id AND e.id = d.endpoint_id
    RETURNING d.id, d.attempts, d.max_attempts,
              e.uid AS endpoint_uid, e.url, e.signing_secret, e.previous_signing_secret,
              e.previous_secret_expires_at, e.timeout_seconds, e.retry_schedule,
              ev.message_id, ev.event_type, ev.payload::text AS payload_json,
              ev.created_at AS event_created_at
    """
)

# Write a batch of attempt outcomes: the delivery rows (guarded) and the attempt rows.
# Returns the ids whose row was still ours; the rest were rescued in the meantime.
RECORD_OUTCOMES = text(
    """
    WITH outcome AS (
        SELECT * FROM unnest(
            CAST(:ids AS bigint[]), CAST(:states AS text[]), CAST(:attempts AS int[]),
            CAST(:next_attempt_at AS timestamptz[]), CAST(:status_codes AS int[]),
            CAST(:errors AS text[]), CAST(:final_reasons AS text[])
        ) AS o(id, state, attempts, next_attempt_at, status_code, error, final_reason)
    ), updated AS (
        UPDATE deliveries d
        SET state = o.state,
            attempts = o.attempts,
            next_attempt_at = COALESCE(o.next_attempt_at, d.next_attempt_at),
            locked_by = NULL,
            lease_expires_at = NULL,
            last_status_code = o.status_code,
            last_error = o.error,
            final_reason = o.final_reason,
            updated_at = :now,
            completed_at = CASE WHEN o.state IN ('succeeded', 'dead') THEN :now END
        FROM outcome o
        WHERE d.id = o.id AND d.state = 'in_flight' AND d.locked_by = :worker_id
        RETURNING d.id
    ), recorded AS (
        INSERT INTO delivery_attempts
            (delivery_id, attempt_number, started_at, duration_ms, status_code, outcome,
             error, response_excerpt, request_headers, worker_id)
        SELECT a.delivery_id, a.attempt_number, a.started_at, a.duration_ms, a.status_code,
               a.outcome, a.error, a.response_excerpt, a.request_headers::jsonb, :worker_id
        FROM unnest(
            CAST(:ids AS bigint[]), CAST(:attempts AS int[]),
            CAST(:started_at AS timestamptz[]), CAST(:durations AS int[]),
            CAST(:status_codes AS int[]), CAST(:outcomes AS text[]), CAST(:errors AS text[]),
            CAST(:excerpts AS text[]), CAST(:request_headers AS text[])
        ) AS a(delivery_id, attempt_number, started_at, duration_ms, status_code, outcome,
               error, response_excerpt, request_headers)
        RETURNING 1
    )
    SELECT id FROM updated
    """
)

# Hand back claimed deliveries that were never attempted (shutdown): no attempt spent.
RELEASE_CLAIMS = text(
    """
    UPDATE deliveries
    SET state = 'scheduled', locked_by = NULL, lease_expires_at = NULL, updated_at = :now
    WHERE id = ANY(CAST(:ids AS bigint[])) AND state = 'in_flight' AND locked_by = :worker_id
    RETURNING id
    """
)

# Re-schedule deliveries whose worker died (lease expired). The CTE locks with SKIP
# LOCKED (a row a worker is writing right now is left alone) and remembers whose
# lease it saw; the UPDATE re-checks state, holder and lease, so a delivery that
# finished meanwhile, or was claimed again under a new lease, is never touched.
# A rescue is not an attempt (nothing was recorded), but it is counted: the
# :max_rescues-th rescue makes the delivery dead, so a delivery that crashes every
# worker that tries it (a poison) cannot be rescued forever.
RESCUE_EXPIRED_LEASES = text(
    """
    WITH expired AS (
        SELECT id, locked_by, lease_expires_at
        FROM deliveries
        WHERE state = 'in_flight' AND lease_expires_at < :now
        ORDER BY lease_expires_at
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    )
    UPDATE deliveries d
    SET state = CASE WHEN d.rescues + 1 >= :max_rescues THEN 'dead' ELSE 'scheduled' END,
        rescues = d.rescues + 1,
        locked_by = NULL, lease_expires_at = NULL,
        next_attempt_at = :now, updated_at = :now,
        last_error = 'lease of worker ' || expired.locked_by
            || ' expired: it stopped before recording an outcome',
        final_reason = CASE WHEN d.rescues + 1 >= :max_rescues THEN
            'rescued ' || (d.rescues + 1) || ' times after its worker stopped mid-attempt '
            || '(' || d.attempts || ' attempts recorded): it may be crashing workers; '
            || 'inspect it before replaying' END,
        completed_at = CASE WHEN d.rescues + 1 >= :max_rescues THEN :now END
    FROM expired
    WHERE d.id = expired.id AND d.state = 'in_flight'
      AND d.locked_by = expired.locked_by AND d.lease_expires_at = expired.lease_expires_at
    RETURNING d.id, d.state
    """
)

# Per-endpoint status overrides of the endpoints in a claimed batch (read in the
# claim's transaction, so a batch sees one consistent set of rules).
SELECT_STATUS_OVERRIDES = text(
    """
    SELECT uid, status_overrides FROM endpoints
    WHERE uid = ANY(CAST(:uids AS text[])) AND status_overrides IS NOT NULL
    """
)

# When each delivery's first attempt started: the span in "8 attempts over 17 h".
SELECT_FIRST_ATTEMPT_TIMES = text(
    """
    SELECT delivery_id, min(started_at) AS first_at
    FROM delivery_attempts
    WHERE delivery_id = ANY(CAST(:ids AS bigint[]))
    GROUP BY delivery_id
    """
)

# A 410 Gone disables its endpoint (guarded: only if still enabled, so the first
# reason stays) and writes the audit entry in the same statement. The endpoint's
# other deliveries stay scheduled: the claim skips disabled endpoints, and
# re-enabling it lets them flow again. Nothing is dropped.
DISABLE_GONE_ENDPOINTS = text(
    """
    WITH gone AS (
        SELECT * FROM unnest(CAST(:uids AS text[]), CAST(:reasons AS text[]))
            AS g(uid, reason)
    ), disabled AS (
        UPDATE endpoints e
        SET enabled = false, disabled_reason = g.reason, disabled_at = :now, updated_at = :now
        FROM gone g
        WHERE e.uid = g.uid AND e.enabled
        RETURNING e.uid, e.disabled_reason
    ), audited AS (
        INSERT INTO audit_log (at, actor, action, target_type, target_id, reason, details)
        SELECT :now, 'worker:' || :worker_id, 'endpoint.disable', 'endpoint', uid,
               disabled_reason, '{"automatic": true, "status": 410}'::jsonb
        FROM disabled
        RETURNING 1
    )
    SELECT uid FROM disabled
    """
)
