"""An event type's workflow settings (outbox/workflows.py): hold on ambiguity, owner,
alert thresholds (migration 0031), and the per-type alert measures (outbox/stats.py)."""

from __future__ import annotations

from sqlalchemy import text

from outbox.sql.scope import in_scope

_WORKFLOW_COLUMNS = """
    SELECT t.name, COALESCE(t.on_ambiguous, 'retry') AS on_ambiguous, t.owner,
           t.alert_oldest_seconds, t.alert_error_rate, t.alert_processing_p95_seconds
    FROM event_types t
"""

# One type's settings, by name.
SELECT_WORKFLOW = text(_WORKFLOW_COLUMNS + " WHERE t.name = :name")

# Every type with a threshold set: the per-type alert signals evaluate these only.
SELECT_WORKFLOWS_WITH_THRESHOLDS = text(
    _WORKFLOW_COLUMNS
    + """ WHERE t.alert_oldest_seconds IS NOT NULL OR t.alert_error_rate IS NOT NULL
             OR t.alert_processing_p95_seconds IS NOT NULL
          ORDER BY t.name LIMIT :limit"""
)

# Change what is flagged; a NULL value with its flag set clears the field.
SET_WORKFLOW = text(
    """
    UPDATE event_types
    SET on_ambiguous = CASE WHEN :set_on_ambiguous THEN CAST(:on_ambiguous AS text)
                            ELSE on_ambiguous END,
        owner = CASE WHEN :set_owner THEN CAST(:owner AS text) ELSE owner END,
        alert_oldest_seconds = CASE WHEN :set_oldest THEN CAST(:oldest AS double precision)
                                    ELSE alert_oldest_seconds END,
        alert_error_rate = CASE WHEN :set_error_rate
                                THEN CAST(:error_rate AS double precision)
                                ELSE alert_error_rate END,
        alert_processing_p95_seconds = CASE WHEN :set_p95 THEN CAST(:p95 AS double precision)
                                            ELSE alert_processing_p95_seconds END,
        updated_at = now()
    WHERE name = :name
    RETURNING name
    """
)

# Per event type (those with thresholds, :types), in scope, bounded by the window:
# - the oldest due delivery (ix_deliveries_due_ranked: scheduled rows only, the backlog);
# - the window's attempts and failures (ix_delivery_attempts_started_at, the window only);
# - p95 of processing time, event created -> delivery succeeded, over deliveries that
#   succeeded in the window (ix_deliveries_completed_at, the window only).
# Event types are joined by primary key per row; nothing reads history outside the window.
WORKFLOW_MEASURES = text(
    f"""
    WITH types AS (SELECT unnest(CAST(:types AS text[])) AS event_type),
    due AS (
        SELECT ev.event_type, min(d.next_attempt_at) AS oldest_due
        FROM deliveries d JOIN outbox_events ev ON ev.id = d.event_id
        WHERE d.state = 'scheduled' AND d.next_attempt_at <= :now
          AND ev.event_type = ANY(CAST(:types AS text[])) AND {in_scope("d.tenant_id")}
        GROUP BY ev.event_type
    ), tried AS (
        SELECT ev.event_type, count(*) AS attempts,
               count(*) FILTER (WHERE a.outcome <> 'succeeded') AS failed
        FROM delivery_attempts a
        JOIN deliveries d ON d.id = a.delivery_id
        JOIN outbox_events ev ON ev.id = d.event_id
        WHERE a.started_at >= :since AND a.started_at <= :now
          AND ev.event_type = ANY(CAST(:types AS text[])) AND {in_scope("d.tenant_id")}
        GROUP BY ev.event_type
    ), done AS (
        SELECT ev.event_type,
               percentile_cont(0.95) WITHIN GROUP (
                   ORDER BY extract(epoch FROM d.completed_at - ev.created_at)) AS p95_seconds
        FROM deliveries d JOIN outbox_events ev ON ev.id = d.event_id
        WHERE d.state = 'succeeded' AND d.completed_at >= :since AND d.completed_at <= :now
          AND ev.event_type = ANY(CAST(:types AS text[])) AND {in_scope("d.tenant_id")}
        GROUP BY ev.event_type
    )
    SELECT types.event_type, due.oldest_due, COALESCE(tried.attempts, 0) AS attempts,
           COALESCE(tried.failed, 0) AS failed, done.p95_seconds
    FROM types
    LEFT JOIN due ON due.event_type = types.event_type
    LEFT JOIN tried ON tried.event_type = types.event_type
    LEFT JOIN done ON done.event_type = types.event_type
    ORDER BY types.event_type
    """
)
