"""Every SQL statement of the delivery package, named for what it does.

Claims and outcome writes are one statement per batch. Every claim bumps the
delivery's `claims` counter and returns it; every write to an in-flight row (outcome,
release, rescue) is guarded by `state = 'in_flight'` and that claim number, so a worker
whose lease was rescued can never overwrite what happened since, not even when it
claimed the same delivery again itself (the worker name alone would match then).
"""

from __future__ import annotations

from sqlalchemy import text

# The claim and its gates live in delivery/claim_queries.py (they share fragments).
from delivery.claim_queries import CLAIM_DUE_DELIVERIES as CLAIM_DUE_DELIVERIES
from delivery.claim_queries import CLAIM_FOLDED as CLAIM_FOLDED
from delivery.claim_queries import LOCK_CLAIM_GATES as LOCK_CLAIM_GATES
from outbox.catalogue import OPERATIONAL_EVENT_TYPES_SQL
from outbox.sql.relay import HEALTH_GATED

# Write a batch of attempt outcomes: the delivery rows (fenced by the claim number) and
# the attempt rows. Returns the (id, claim) pairs that were still current; the rest were rescued
# in the meantime and add history only. An attempt is numbered by its claim, so a late
# outcome never repeats a newer attempt's number; writing the same outcome twice (a
# retry after a commit whose acknowledgement was lost) adds nothing. A delivery deleted
# meanwhile (its endpoint or event deleted while the request was out) gets no attempt
# row: its history went with it, and writing one would break the foreign key and fail the
# whole batch, every retry alike. Those come back with claims NULL.
RECORD_OUTCOMES = text(
    """
    WITH outcome AS (
        SELECT * FROM jsonb_to_recordset(CAST(:outcomes AS jsonb)) AS o(
            id bigint, claim int, state text, attempts int, next_attempt_at timestamptz,
            status_code int, error text, final_reason text, started_at timestamptz,
            duration_ms int, outcome text, response_excerpt text, request_headers jsonb
        )
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
        WHERE d.id = o.id AND d.state = 'in_flight' AND d.claims = o.claim
          AND d.locked_by = :worker_id
        RETURNING d.id, d.claims
    ), checked AS (
        -- whether the delivery still exists: known for the rows just updated; looked up
        -- (one probe) only for the rest, the late outcomes of lost claims
        SELECT o.*, (u.id IS NOT NULL OR EXISTS (
            SELECT 1 FROM deliveries x WHERE x.id = o.id)) AS present
        FROM outcome o LEFT JOIN updated u ON u.id = o.id
    ), recorded AS (
        INSERT INTO delivery_attempts
            (delivery_id, attempt_number, started_at, duration_ms, status_code, outcome,
             error, response_excerpt, request_headers, worker_id)
        SELECT o.id, o.claim, o.started_at, o.duration_ms, o.status_code, o.outcome,
               o.error, o.response_excerpt, o.request_headers, :worker_id
        FROM checked o
        WHERE o.present
        ON CONFLICT (delivery_id, attempt_number) DO NOTHING
        RETURNING 1
    )
    SELECT id, claims FROM updated
    UNION ALL
    SELECT id, NULL FROM checked WHERE NOT present
    """
)

# Hand back claimed deliveries that were never attempted (shutdown): no attempt spent.
# Fenced like outcomes: only claims that are still current are handed back.
RELEASE_CLAIMS = text(
    """
    UPDATE deliveries d
    SET state = 'scheduled', locked_by = NULL, lease_expires_at = NULL, updated_at = :now
    FROM unnest(CAST(:ids AS bigint[]), CAST(:claims AS int[])) AS c(id, claim)
    WHERE d.id = c.id AND d.state = 'in_flight' AND d.claims = c.claim
      AND d.locked_by = :worker_id
    RETURNING d.id
    """
)

# Re-schedule deliveries whose worker died (lease expired). The CTE locks with SKIP
# LOCKED (a row a worker is writing right now is left alone) and remembers which
# claim it saw; the UPDATE re-checks state and claim number, so a delivery that
# finished meanwhile, or was claimed again (by any worker), is never touched.
# A rescue is not an attempt (nothing was recorded), but it is counted: the
# :max_rescues-th rescue makes the delivery dead, so a delivery that crashes every
# worker that tries it (a poison) cannot be rescued forever.
RESCUE_EXPIRED_LEASES = text(
    """
    WITH expired AS (
        SELECT id, claims, locked_by
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
    WHERE d.id = expired.id AND d.state = 'in_flight' AND d.claims = expired.claims
    RETURNING d.id, d.state
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


# -- endpoint health (delivery/health/) ------------------------------------------------

_HEALTH_COLUMNS = """
    h.max_in_flight, h.max_per_second, h.breaker_state, h.consecutive_failures,
    h.window_started_at, h.window_attempts, h.window_failures, h.trips, h.opened_at,
    h.open_until, h.probe_until, h.ramp_started_at, h.ramp_until, h.paused_until, h.tokens,
    h.tokens_at, h.failing_since, h.last_failure, h.adaptive, h.adaptive_limit,
    h.latency_baseline_ms, h.adaptive_window_at, h.adaptive_estimate
"""

# Whether candidate `t` is claimable but for a health gate: enabled, of an enabled tenant
# without caps (its own tenant: `t.tenant_id` comes from its delivery row). Primary-key
# probes (LIMIT 1: never a scan of a small table per candidate), for the few candidates
# QUICK_CLAIM_GATES returns.
_CLAIMABLE = """
    COALESCE((SELECT y.enabled AND y.tenant_id = t.tenant_id FROM endpoints y
              WHERE y.id = t.endpoint_id LIMIT 1)
             AND (SELECT y.enabled AND y.max_in_flight IS NULL AND y.max_per_second IS NULL
                  FROM tenants y WHERE y.id = t.tenant_id LIMIT 1),
             false)
"""

# Whether candidate `t` has a health gate (an in-flight limit, fixed or adaptive; a
# breaker; a ramp or pause): a primary-key probe of its health row (no row: no gate).
# Such a candidate is still taken by the quick path: open_gates locks just its row and
# works out its budget, instead of falling back to LOCK_CLAIM_GATES over every endpoint
# with due work (with every endpoint adaptive, every endpoint is gated).
_GATED = f"""
    COALESCE((SELECT {HEALTH_GATED} FROM endpoint_health h
              WHERE h.endpoint_id = t.endpoint_id LIMIT 1), false)
"""

# A claim's batch among many tenants, from the oldest due rows alone, without reading
# the head, endpoint, tenant and health rows of every endpoint with due work (with a
# thousand busy endpoints, LOCK_CLAIM_GATES' probes were most of a claim's cost). It
# walks the oldest due rows of the top due priority (ix_deliveries_due_ranked, an index
# range of at most :walk rows; the priorities in use are found by a probe or two each).
# Each tenant's first row there (leaving out :excluded endpoints, whose slots this
# worker has used up) is the head of its first turn: the indexes end with `id`, so it is
# exactly the head LOCK_CLAIM_GATES would find. Returned, in one row (a hundred rows
# cost the worker more to read than the statement costs to run): the oldest :limit of
# those first turns that are not :set_aside (the batch: `endpoint_ids` and their
# `tenant_ids`, oldest first), whether they and the set-aside ones are all `plain`
# (_CLAIMABLE without a health gate, _GATED), or else plain but for a health gate
# (`plain_or_gated`, and the gated ones: `gated_ids`), and `walked`, `spread` (tenants
# in the walk) and `lower` (work at a lower priority). health.open_gates takes the batch
# when it is :limit endpoints and every row returned is plain, or plain but for a health
# gate that it locked and found with budget left (one without budget: left out through
# :excluded, and the batch looked for again): that is then exactly
# health.choose_endpoints' batch over LOCK_CLAIM_GATES (priority; round robin across
# tenants; the oldest head; set-aside endpoints last), because every other candidate
# ranks behind it, and taking out one that is not claimable only moves its tenant's
# later endpoints up a turn, to places still behind it (a set-aside one ranks last
# whatever its turn, so its tenant's next endpoint could move ahead: those are checked
# too). Otherwise the claim falls back to LOCK_CLAIM_GATES. Nothing is locked here:
# open_gates locks the `gated_ids` health rows (LOCK_GATED_HEALTH), so an adaptive
# endpoint costs a claim one row lock, not a visit to every endpoint with due work.
QUICK_CLAIM_GATES = text(
    f"""
    WITH RECURSIVE levels AS (
        -- the scheduled priorities, highest first, until one has a due row (each probe in
        -- index order, LIMIT 1: never a scan, whatever the planner guesses is due)
        (SELECT d.priority, (
             SELECT x.next_attempt_at FROM deliveries x
             WHERE x.state = 'scheduled' AND x.priority = d.priority
             ORDER BY x.next_attempt_at LIMIT 1) <= :now AS due
         FROM deliveries d
         WHERE d.state = 'scheduled'
         ORDER BY d.priority DESC LIMIT 1)
        UNION ALL
        SELECT n.priority, n.due
        FROM levels l
        CROSS JOIN LATERAL (
            SELECT d.priority, (
                SELECT x.next_attempt_at FROM deliveries x
                WHERE x.state = 'scheduled' AND x.priority = d.priority
                ORDER BY x.next_attempt_at LIMIT 1) <= :now AS due
            FROM deliveries d
            WHERE NOT l.due AND d.state = 'scheduled' AND d.priority < l.priority
            ORDER BY d.priority DESC LIMIT 1
        ) n
    ), walk AS (
        SELECT d.endpoint_id, d.tenant_id, d.priority, d.next_attempt_at, d.id
        FROM deliveries d
        WHERE d.state = 'scheduled' AND d.next_attempt_at <= :now
          AND d.priority = (SELECT l.priority FROM levels l WHERE l.due)
        ORDER BY d.next_attempt_at, d.id
        LIMIT :walk
    ), firsts AS (
        SELECT DISTINCT ON (w.tenant_id) w.*,
               w.endpoint_id = ANY(CAST(:set_aside AS bigint[])) AS set_aside
        FROM walk w
        WHERE w.endpoint_id <> ALL(CAST(:excluded AS bigint[]))
        ORDER BY w.tenant_id, w.next_attempt_at, w.id
    ), batch AS (
        (SELECT f.* FROM firsts f WHERE NOT f.set_aside ORDER BY f.next_attempt_at, f.id
         LIMIT :limit)
        UNION ALL
        SELECT f.* FROM firsts f WHERE f.set_aside
    )
    SELECT array_agg(t.endpoint_id ORDER BY t.next_attempt_at, t.id)
               FILTER (WHERE NOT t.set_aside) AS endpoint_ids,
           array_agg(t.tenant_id ORDER BY t.next_attempt_at, t.id)
               FILTER (WHERE NOT t.set_aside) AS tenant_ids,
           COALESCE(bool_and(t.claimable AND NOT t.gated), false) AS plain,
           COALESCE(bool_and(t.claimable), false) AS plain_or_gated,
           array_agg(t.endpoint_id ORDER BY t.endpoint_id) FILTER (WHERE t.claimable AND t.gated)
               AS gated_ids,
           (SELECT count(*) FROM walk) AS walked,
           (SELECT count(*) FROM firsts) AS spread,
           (SELECT x.priority FROM deliveries x WHERE x.state = 'scheduled'
              AND x.priority < (SELECT l.priority FROM levels l WHERE l.due)
            ORDER BY x.priority DESC LIMIT 1) IS NOT NULL AS lower
    FROM (
        -- OFFSET 0: each probe once per row, not inlined into every aggregate using it
        SELECT t.*, {_CLAIMABLE} AS claimable, {_GATED} AS gated FROM batch t OFFSET 0
    ) t
    """
)

# The health rows of the gated endpoints in a quick batch (QUICK_CLAIM_GATES' `gated_ids`),
# locked like LOCK_CLAIM_GATES locks them: in id order, SKIP LOCKED (a row another worker
# holds is missing from the result, and the claim falls back to LOCK_CLAIM_GATES).
LOCK_GATED_HEALTH = text(
    f"""
    SELECT h.endpoint_id, {_HEALTH_COLUMNS}
    FROM endpoint_health h
    WHERE h.endpoint_id = ANY(CAST(:ids AS bigint[]))
    ORDER BY h.endpoint_id
    FOR UPDATE SKIP LOCKED
    """
)

# The health rows LOCK_CLAIM_GATES locked (kept out of its result: most endpoints are
# not gated, and a thousand rows of NULL columns cost more to fetch than this query).
SELECT_LOCKED_HEALTH = text(
    f"""
    SELECT h.endpoint_id, {_HEALTH_COLUMNS}
    FROM endpoint_health h WHERE h.endpoint_id = ANY(CAST(:ids AS bigint[]))
    """
)

# Leased deliveries per endpoint, across all processes. A separate statement on purpose:
# it runs after the health rows are locked, so its snapshot includes every claim that
# committed before we got the lock (a subquery in the locking statement would not).
COUNT_IN_FLIGHT = text(
    """
    SELECT endpoint_id, count(*) AS in_flight
    FROM deliveries
    WHERE endpoint_id = ANY(CAST(:ids AS bigint[])) AND state = 'in_flight'
    GROUP BY endpoint_id
    """
)

# In-flight deliveries per capped tenant, across all processes; run after the tenant rows
# are locked, like COUNT_IN_FLIGHT (the partial index keeps it to the in-flight rows).
COUNT_TENANT_IN_FLIGHT = text(
    """
    SELECT tenant_id, count(*) AS in_flight
    FROM deliveries
    WHERE tenant_id = ANY(CAST(:ids AS bigint[])) AND state = 'in_flight'
    GROUP BY tenant_id
    """
)

# Charge a claim to the token buckets of tenants capped per second (rows locked above).
SAVE_TENANT_BUCKETS = text(
    """
    INSERT INTO tenant_buckets AS b (tenant_id, tokens, tokens_at)
    SELECT * FROM unnest(CAST(:tenant_ids AS bigint[]), CAST(:tokens AS float8[]),
                         CAST(:tokens_at AS timestamptz[]))
    ON CONFLICT (tenant_id) DO UPDATE SET tokens = EXCLUDED.tokens, tokens_at = EXCLUDED.tokens_at
    """
)

# Health rows for an outcome batch, locked (waiting) in id order so writers never deadlock.
LOCK_ENDPOINT_HEALTH = text(
    f"""
    SELECT h.endpoint_id, {_HEALTH_COLUMNS}
    FROM endpoint_health h
    WHERE h.endpoint_id = ANY(CAST(:ids AS bigint[]))
    ORDER BY h.endpoint_id
    FOR UPDATE
    """
)

INSERT_MISSING_ENDPOINT_HEALTH = text(
    """
    INSERT INTO endpoint_health (endpoint_id)
    SELECT id FROM endpoints WHERE id = ANY(CAST(:ids AS bigint[])) ORDER BY id
    ON CONFLICT (endpoint_id) DO NOTHING
    """
)

# Write breaker and bucket state for a batch of endpoints (never the configured limits).
SAVE_ENDPOINT_HEALTH = text(
    """
    INSERT INTO endpoint_health AS h
        (endpoint_id, breaker_state, consecutive_failures, window_started_at, window_attempts,
         window_failures, trips, opened_at, open_until, probe_until, ramp_started_at,
         ramp_until, paused_until, tokens, tokens_at, failing_since, last_failure,
         adaptive_limit, latency_baseline_ms, adaptive_window_at, adaptive_estimate,
         updated_at)
    SELECT u.*, :now
    FROM unnest(
        CAST(:endpoint_id AS bigint[]), CAST(:breaker_state AS text[]),
        CAST(:consecutive_failures AS int[]), CAST(:window_started_at AS timestamptz[]),
        CAST(:window_attempts AS int[]), CAST(:window_failures AS int[]),
        CAST(:trips AS int[]), CAST(:opened_at AS timestamptz[]),
        CAST(:open_until AS timestamptz[]), CAST(:probe_until AS timestamptz[]),
        CAST(:ramp_started_at AS timestamptz[]), CAST(:ramp_until AS timestamptz[]),
        CAST(:paused_until AS timestamptz[]), CAST(:tokens AS float8[]),
        CAST(:tokens_at AS timestamptz[]), CAST(:failing_since AS timestamptz[]),
        CAST(:last_failure AS text[]), CAST(:adaptive_limit AS bigint[]),
        CAST(:latency_baseline_ms AS float8[]), CAST(:adaptive_window_at AS timestamptz[]),
        CAST(:adaptive_estimate AS float8[])
    ) AS u
    ON CONFLICT (endpoint_id) DO UPDATE SET
        breaker_state = EXCLUDED.breaker_state,
        consecutive_failures = EXCLUDED.consecutive_failures,
        window_started_at = EXCLUDED.window_started_at,
        window_attempts = EXCLUDED.window_attempts,
        window_failures = EXCLUDED.window_failures,
        trips = EXCLUDED.trips,
        opened_at = EXCLUDED.opened_at,
        open_until = EXCLUDED.open_until,
        probe_until = EXCLUDED.probe_until,
        ramp_started_at = EXCLUDED.ramp_started_at,
        ramp_until = EXCLUDED.ramp_until,
        paused_until = EXCLUDED.paused_until,
        tokens = EXCLUDED.tokens,
        tokens_at = EXCLUDED.tokens_at,
        failing_since = EXCLUDED.failing_since,
        last_failure = EXCLUDED.last_failure,
        adaptive_limit = EXCLUDED.adaptive_limit,
        latency_baseline_ms = EXCLUDED.latency_baseline_ms,
        adaptive_window_at = EXCLUDED.adaptive_window_at,
        adaptive_estimate = EXCLUDED.adaptive_estimate,
        updated_at = EXCLUDED.updated_at
    """
)

# Disable an endpoint that failed for too long; its deliveries stay scheduled.
AUTO_DISABLE_ENDPOINT = text(
    """
    UPDATE endpoints
    SET enabled = false, disabled_reason = :reason, disabled_at = :now, updated_at = :now
    WHERE id = :id AND enabled
    RETURNING uid
    """
)

SET_ENDPOINT_LIMITS = text(
    """
    INSERT INTO endpoint_health AS h (endpoint_id, max_in_flight, max_per_second, ordered,
                                      dead_head, adaptive)
    SELECT id, CAST(:max_in_flight AS int), CAST(:max_per_second AS float8),
           CAST(:ordered AS boolean), CAST(:dead_head AS text), CAST(:adaptive AS boolean)
    FROM endpoints WHERE uid = :uid
    ON CONFLICT (endpoint_id) DO UPDATE SET
        max_in_flight = EXCLUDED.max_in_flight,
        adaptive = EXCLUDED.adaptive,
        -- a changed setting starts the limiter afresh
        adaptive_limit = NULL, latency_baseline_ms = NULL, adaptive_window_at = NULL,
        adaptive_estimate = NULL,
        max_per_second = EXCLUDED.max_per_second,
        ordered = EXCLUDED.ordered,
        dead_head = EXCLUDED.dead_head,
        updated_at = now()
    RETURNING endpoint_id
    """
)

SELECT_ENDPOINT_HEALTH = text(
    """
    SELECT e.uid AS endpoint, e.enabled, e.disabled_reason,
           COALESCE(h.breaker_state, 'closed') AS breaker_state,
           COALESCE(h.consecutive_failures, 0) AS consecutive_failures,
           COALESCE(h.trips, 0) AS trips, h.open_until, h.paused_until, h.ramp_until,
           h.failing_since, h.last_failure, h.max_in_flight, h.max_per_second,
           COALESCE(h.ordered, false) AS ordered, COALESCE(h.dead_head, 'block') AS dead_head,
           COALESCE(h.adaptive, false) AS adaptive, h.adaptive_limit, h.latency_baseline_ms,
           (SELECT count(*) FROM deliveries d
            WHERE d.endpoint_id = e.id AND d.state = 'in_flight') AS in_flight,
           (SELECT count(*) FROM deliveries d
            WHERE d.endpoint_id = e.id AND d.state = 'scheduled') AS scheduled
    FROM endpoints e LEFT JOIN endpoint_health h ON h.endpoint_id = e.id
    ORDER BY e.id
    """
)

# One endpoint's concurrency for the admin API: its limits, its limiter and what is in
# flight (an index probe of the endpoint's in-flight deliveries).
SELECT_ENDPOINT_CONCURRENCY = text(
    """
    SELECT e.id, h.max_in_flight, COALESCE(h.adaptive, false) AS adaptive, h.adaptive_limit,
           h.latency_baseline_ms,
           (SELECT count(*) FROM deliveries d
            WHERE d.endpoint_id = e.id AND d.state = 'in_flight') AS in_flight
    FROM endpoints e LEFT JOIN endpoint_health h ON h.endpoint_id = e.id
    WHERE e.uid = :uid
    """
)

SELECT_ENDPOINT_LIMITS = text(
    """
    SELECT e.id, h.max_in_flight, h.max_per_second, COALESCE(h.ordered, false) AS ordered,
           COALESCE(h.dead_head, 'block') AS dead_head, COALESCE(h.adaptive, false) AS adaptive
    FROM endpoints e LEFT JOIN endpoint_health h ON h.endpoint_id = e.id
    WHERE e.uid = :uid
    """
)

# Operational `delivery.dead` events for one outcome batch (delivery/operational.py).
REPORT_DEAD_DELIVERIES = text("SELECT outbox_deliveries_dead(CAST(:ids AS bigint[]), :now, :limit)")

# Operational `delivery.held` events for one outcome batch (delivery/operational.py): one
# per delivery and hold (the key has the claim number: held again after a send-again is
# a new event), naming the owner; a held operational event reports nothing (no loops).
REPORT_HELD_DELIVERIES = text(
    f"""
    SELECT outbox_publish_operational(
        e.tenant_id, 'delivery.held',
        jsonb_build_object('endpoint_id', e.uid, 'delivery_id', x.id,
                           'message_id', o.message_id, 'event_type', o.event_type,
                           'attempts', x.attempts, 'reason', x.final_reason,
                           'owner', COALESCE(e.owner, t.owner)),
        'outbox:delivery.held:' || x.id::text || ':' || x.claims::text,
        :now)
    FROM deliveries x
    JOIN endpoints e ON e.id = x.endpoint_id
    JOIN outbox_events o ON o.id = x.event_id
    LEFT JOIN event_types t ON t.name = o.event_type
    WHERE x.id = ANY(CAST(:ids AS bigint[])) AND x.state = 'held'
      AND o.event_type NOT IN {OPERATIONAL_EVENT_TYPES_SQL}
    ORDER BY x.id
    """
)
