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

# Re-schedule deliveries whose worker died (lease expired). The inner SELECT locks
# with SKIP LOCKED; the outer WHERE re-checks, so a delivery that finished meanwhile
# (no longer in_flight, or leased again) is never touched.
RESCUE_EXPIRED_LEASES = text(
    """
    UPDATE deliveries d
    SET state = 'scheduled', locked_by = NULL, lease_expires_at = NULL,
        next_attempt_at = :now, updated_at = :now,
        last_error = 'lease expired: the worker stopped before recording an outcome'
    WHERE d.id IN (
        SELECT id FROM deliveries
        WHERE state = 'in_flight' AND lease_expires_at < :now
        ORDER BY lease_expires_at
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    ) AND d.state = 'in_flight' AND d.lease_expires_at < :now
    RETURNING d.id
    """
)
