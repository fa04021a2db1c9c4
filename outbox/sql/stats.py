"""What `outbox stats`, the admin API's stats and /metrics count (outbox/stats.py), each
scoped to the caller's tenant (outbox/sql/scope.py)."""

from __future__ import annotations

from sqlalchemy import text

from outbox.sql.scope import in_scope

# How many deliveries are in each state.
STATS_COUNTS_BY_STATE = text(
    f"SELECT state, count(*) AS n FROM deliveries WHERE {in_scope('tenant_id')} GROUP BY state"
)

# The oldest due delivery and how many are due.
# Due deliveries of enabled endpoints only: a disabled endpoint's backlog waits on
# purpose and has an alert of its own.
STATS_OLDEST_DUE = text(
    f"""
    SELECT min(d.next_attempt_at) AS oldest_due, count(*) AS due
    FROM deliveries d JOIN endpoints e ON e.id = d.endpoint_id
    WHERE d.state = 'scheduled' AND d.next_attempt_at <= :now AND e.enabled
      AND {in_scope("d.tenant_id")}
    """
)

# The oldest unrelayed event and how many wait for the relay.
# A scoped caller sees its own tenant's events (the ones it published).
STATS_RELAY_LAG = text(
    f"""
    SELECT min(created_at) AS oldest_unrelayed, count(*) AS unrelayed
    FROM outbox_events WHERE relayed_at IS NULL AND {in_scope("tenant_id")}
    """
)

# The attempts in scope: attempts are scoped through their delivery's tenant.
_SCOPED_ATTEMPTS = f"""
    delivery_attempts a WHERE (CAST(:scope_id AS bigint) IS NULL OR EXISTS (
        SELECT 1 FROM deliveries sd WHERE sd.id = a.delivery_id AND {in_scope("sd.tenant_id")}))
"""

# What happened in the window: attempts, successes, dead letters, events published.
STATS_WINDOW_RATES = text(
    f"""
    SELECT
        (SELECT count(*) FROM {_SCOPED_ATTEMPTS}
         AND started_at >= :since AND started_at <= :now) AS attempts,
        (SELECT count(*) FROM {_SCOPED_ATTEMPTS}
         AND started_at >= :since AND started_at <= :now AND outcome = 'succeeded')
            AS attempts_succeeded,
        (SELECT count(*) FROM deliveries
         WHERE state = 'succeeded' AND completed_at >= :since AND completed_at <= :now
           AND {in_scope("tenant_id")})
            AS succeeded,
        (SELECT count(*) FROM deliveries
         WHERE state = 'dead' AND completed_at >= :since AND completed_at <= :now
           AND {in_scope("tenant_id")}) AS dead,
        (SELECT count(*) FROM deliveries
         WHERE state = 'dead' AND completed_at >= :previous AND completed_at < :since
           AND {in_scope("tenant_id")})
            AS dead_previous_window,
        (SELECT count(*) FROM outbox_events
         WHERE created_at >= :since AND created_at <= :now AND {in_scope("tenant_id")})
            AS published
    """
)

# Each endpoint's health: recent attempts, backlog, breaker.
# Per endpoint: the window's attempts (success rate, latency percentiles) and the
# current backlog. An endpoint counts as auto-disabled when no operator's
# 'endpoint.disable' audit row explains its current disablement (rows by a worker,
# by 'system', or with details.automatic = true are not an operator's).
STATS_ENDPOINTS = text(
    f"""
    WITH recent AS (
        SELECT d.endpoint_id, a.outcome, a.duration_ms
        FROM delivery_attempts a JOIN deliveries d ON d.id = a.delivery_id
        WHERE a.started_at >= :since AND a.started_at <= :now AND {in_scope("d.tenant_id")}
    ), per AS (
        SELECT endpoint_id,
               count(*) AS attempts,
               count(*) FILTER (WHERE outcome = 'succeeded') AS succeeded,
               percentile_cont(0.5) WITHIN GROUP (ORDER BY duration_ms) AS p50_ms,
               percentile_cont(0.99) WITHIN GROUP (ORDER BY duration_ms) AS p99_ms
        FROM recent GROUP BY endpoint_id
    ), backlog AS (
        SELECT endpoint_id,
               count(*) FILTER (WHERE state IN ('scheduled', 'in_flight')) AS pending,
               count(*) FILTER (WHERE state = 'dead') AS dead
        FROM deliveries WHERE state IN ('scheduled', 'in_flight', 'dead')
          AND {in_scope("tenant_id")}
        GROUP BY endpoint_id
    )
    SELECT e.uid, (SELECT t.uid FROM tenants t WHERE t.id = e.tenant_id) AS tenant,
           e.all_tenants, e.url, e.enabled, e.disabled_reason, e.disabled_at,
           COALESCE(per.attempts, 0) AS attempts, COALESCE(per.succeeded, 0) AS succeeded,
           per.p50_ms, per.p99_ms,
           COALESCE(backlog.pending, 0) AS pending, COALESCE(backlog.dead, 0) AS dead,
           (NOT e.enabled AND NOT EXISTS (
               SELECT 1 FROM audit_log al
               WHERE al.action = 'endpoint.disable' AND al.target_id = e.uid
                 AND al.at >= e.disabled_at
                 AND NOT COALESCE((al.details ->> 'automatic')::boolean, false)
                 AND NOT starts_with(al.actor, 'worker:')
                 AND NOT starts_with(al.actor, 'system')
           )) AS auto_disabled,
           COALESCE(h.breaker_state, 'closed') AS breaker_state,
           h.opened_at, h.open_until, h.probe_until, h.paused_until,
           COALESCE(h.consecutive_failures, 0) AS consecutive_failures,
           COALESCE(h.trips, 0) AS trips,
           CASE WHEN h.adaptive THEN COALESCE(h.adaptive_limit, LEAST(h.max_in_flight, 4))
           END AS adaptive_limit,
           CASE WHEN h.adaptive THEN h.max_in_flight END AS adaptive_max
    FROM endpoints e
    LEFT JOIN per ON per.endpoint_id = e.id
    LEFT JOIN backlog ON backlog.endpoint_id = e.id
    -- The breaker is written by delivery/health/; a missing row is a closed breaker.
    LEFT JOIN endpoint_health h ON h.endpoint_id = e.id
    WHERE {in_scope("e.tenant_id")}
    ORDER BY e.id
    """
)

# The commonest errors of the window's failed attempts.
STATS_TOP_ERRORS = text(
    f"""
    SELECT a.error, count(DISTINCT a.delivery_id) AS deliveries, count(*) AS attempts,
           count(DISTINCT d.endpoint_id) AS endpoints, max(a.started_at) AS last_seen
    FROM delivery_attempts a JOIN deliveries d ON d.id = a.delivery_id
    WHERE a.started_at >= :since AND a.started_at <= :now
      AND a.outcome <> 'succeeded' AND a.error IS NOT NULL
      AND {in_scope("d.tenant_id")}
    GROUP BY a.error
    ORDER BY deliveries DESC, attempts DESC, a.error
    LIMIT :limit
    """
)

# Events published and relayed, for /metrics.
# Totals for /metrics, in one scan each. `bucket` counts the histogram bounds below
# an attempt's duration (width_bucket over bounds + 1 ms, durations being whole
# milliseconds), i.e. the index of the smallest bound it fits under; the caller
# accumulates the buckets.
METRICS_EVENTS = text(
    f"""
    SELECT count(*) AS published, count(relayed_at) AS relayed FROM outbox_events
    WHERE {in_scope("tenant_id")}
    """
)

# Attempts per outcome and latency bucket, for /metrics.
METRICS_ATTEMPTS = text(
    f"""
    SELECT outcome, width_bucket(duration_ms, CAST(:bounds_ms_plus_one AS int[])) AS bucket,
           count(*) AS n, sum(duration_ms) / 1000.0 AS seconds
    FROM {_SCOPED_ATTEMPTS}
    GROUP BY 1, 2
    """
)

# Tallies of pruned rows (outbox/sql/retention.py), of one tenant or (unscoped) all,
# the pre-0018 ones included.
SELECT_PRUNED_TOTALS = text(
    f"""
    SELECT name, sum(value) AS value FROM pruned_totals
    WHERE {in_scope("tenant_id")}
    GROUP BY name
    """
)

# Dead and held deliveries per owner (the endpoint's, else the event type's; migration
# 0031). Only dead and held rows are read (ix_deliveries_held for held); at most :limit
# owners (the metric label's cardinality cap), the most failures first.
STATS_FAILURES_BY_OWNER = text(
    f"""
    SELECT COALESCE(e.owner, t.owner) AS owner,
           count(*) FILTER (WHERE d.state = 'dead') AS dead,
           count(*) FILTER (WHERE d.state = 'held') AS held
    FROM deliveries d
    JOIN endpoints e ON e.id = d.endpoint_id
    JOIN outbox_events ev ON ev.id = d.event_id
    LEFT JOIN event_types t ON t.name = ev.event_type
    WHERE d.state IN ('dead', 'held') AND {in_scope("d.tenant_id")}
    GROUP BY 1
    ORDER BY count(*) DESC, 1
    LIMIT :limit
    """
)
