"""The relay: claim a batch of events, fan it out to deliveries, hand part of it to the
worker of its own process (outbox/relay.py). The claim (delivery/queries.py) shares two
fragments from here, HEALTH_GATED and claimed_columns, so the claim and the handoff agree
on what an ungated endpoint is and on what a worker gets of a delivery."""

from __future__ import annotations

from sqlalchemy import text

# The NOTIFY channels: new events (the relay listens), due deliveries (the workers).
EVENTS_CHANNEL = "outbox_events"
DELIVERIES_CHANNEL = "outbox_deliveries"

# The endpoint patterns that can match a batch event `b` (routing).
# Routing goes through the index endpoint_subscriptions (migration 0010): an endpoint
# pattern is '*', an exact event type, or a prefix ending in '.*', so the patterns that
# can match an event are '*', its type, and 'p.*' for every p that the type starts with
# followed by a dot ('a.b.c' -> 'a.*', 'a.b.*'). Each is one index probe for the event's
# tenant and one for all_tenants endpoints (tenant_id NULL): the cost follows the matching
# endpoints, not the number of endpoints.
#
# '*' means every application event: the service's own operational events
# (delivery/operational.py) reach only endpoints that name them, exactly or by prefix.
_CANDIDATE_PATTERNS = """
    SELECT '*' AS pattern
    WHERE b.event_type NOT IN ('endpoint.disabled', 'endpoint.breaker_opened',
                               'endpoint.recovered', 'delivery.dead', 'tenant.disabled')
    UNION ALL SELECT b.event_type
    UNION ALL SELECT left(b.event_type, i) || '*'
              FROM generate_series(1, length(b.event_type) - 1) AS i
              WHERE substr(b.event_type, i, 1) = '.'
"""

# The per-event-type retry rule of a batch event `b`.
# Max attempts of the most specific per-event-type rule (OUTBOX_EVENT_TYPE_RETRY):
# an exact type, then the longest 'prefix.*', then '*'. NULL when no rule matches.
_EVENT_TYPE_MAX_ATTEMPTS = """
    SELECT r.max_attempts
    FROM unnest(CAST(:rule_patterns AS text[]), CAST(:rule_max_attempts AS int[]))
         AS r(pattern, max_attempts)
    WHERE r.pattern = '*'
       OR r.pattern = b.event_type
       OR (right(r.pattern, 2) = '.*' AND starts_with(b.event_type, left(r.pattern, -1)))
    ORDER BY r.pattern = b.event_type DESC, length(r.pattern) DESC
    LIMIT 1
"""

# Whether an endpoint's health row holds its deliveries back from a plain claim.
# An endpoint whose health row gates its claims (delivery/health/): breaker not closed,
# a concurrency or rate limit, a ramp or a 429 pause (`h`: its endpoint_health row). One
# definition for the claim's gates, the claim's quick path and the relay's handoff, so
# that what one of them treats as ungated the others do too.
HEALTH_GATED = """(h.breaker_state <> 'closed' OR h.max_in_flight IS NOT NULL OR h.adaptive
                   OR h.max_per_second IS NOT NULL OR h.ramp_until > :now
                   OR h.paused_until > :now)"""

# The events of one relay pass: the oldest unrelayed, locked so other relays skip them.
_RELAY_PICK = """
    SELECT id, tenant_id, event_type, ordering_key, priority
    FROM outbox_events
    -- events from outbox_publish() wait for their schema check (Relay.run_once)
    WHERE relayed_at IS NULL AND NOT validate_pending
    ORDER BY id
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
"""

# One row per delivery the batch fans out to: (b, the batch row) x (e, the endpoint).
_RELAY_ROUTES = f"""
    FROM (
        -- routing: the event's own tenant's endpoints, plus those taking every tenant's
        SELECT DISTINCT b.id AS event_id, s.endpoint_id
        FROM batch b
        CROSS JOIN LATERAL ({_CANDIDATE_PATTERNS}) c
        -- two probes of (pattern, tenant_id) per candidate pattern, as a LATERAL so
        -- the planner cannot trade them for a scan of the tenant's whole catalogue
        CROSS JOIN LATERAL (
            SELECT endpoint_id FROM endpoint_subscriptions
            WHERE pattern = c.pattern AND tenant_id = b.tenant_id
            UNION ALL
            SELECT endpoint_id FROM endpoint_subscriptions
            WHERE pattern = c.pattern AND tenant_id IS NULL
        ) s
    ) r
    JOIN batch b ON b.id = r.event_id
    CROSS JOIN LATERAL (  -- a primary-key probe per route, never a scan of endpoints
        SELECT x.id, x.tenant_id, x.max_attempts FROM endpoints x
        WHERE x.id = r.endpoint_id AND x.enabled LIMIT 1
    ) e
"""

# What a relay pass reports: events marked, deliveries fanned out, events to validate.
_RELAY_COUNTS = """
    (SELECT count(*) FROM marked) AS events, (SELECT count(*) FROM fanned) AS deliveries,
    EXISTS (SELECT 1 FROM outbox_events WHERE relayed_at IS NULL AND validate_pending)
        AS to_validate
"""

# Relay one batch: claim, fan out and mark it in one statement (and so one transaction).
# SKIP LOCKED lets several relays share the work; the relayed_at IS NULL filter
# (not an id watermark) means an event whose transaction commits after a later id
# was relayed is still picked up. The unique index on (event_id, endpoint_id) makes
# a second fan-out impossible even if two relays raced.
# The f-strings insert constant fragments, never input.
RELAY_BATCH = text(
    f"""
    WITH batch AS ({_RELAY_PICK}), fanned AS (
        INSERT INTO deliveries
            (event_id, endpoint_id, tenant_id, state, max_attempts, next_attempt_at, priority,
             ordering_key, created_at, updated_at)
        SELECT b.id, e.id, e.tenant_id, 'scheduled',
               COALESCE(e.max_attempts, ({_EVENT_TYPE_MAX_ATTEMPTS}), :max_attempts), :now,
               b.priority, b.ordering_key, :now, :now
        {_RELAY_ROUTES}
        ORDER BY b.id, e.id
        ON CONFLICT (event_id, endpoint_id) WHERE replay_of IS NULL DO NOTHING
        RETURNING 1
    ), marked AS (
        UPDATE outbox_events o SET relayed_at = :now
        FROM batch WHERE o.id = batch.id
        RETURNING 1
    )
    SELECT {_RELAY_COUNTS}
    """
)


def claimed_columns(delivery: str) -> str:
    """What a worker needs of each delivery it holds (delivery.worker's `_prepare`), for
    the claim (delivery/queries.py) and the relay's handoff alike: `delivery` is the
    alias of the claimed row, `e`, `ev` and `h` its endpoint, event and health row."""
    return f"""
        {delivery}.id, {delivery}.claims AS claim, {delivery}.attempts, {delivery}.max_attempts,
        e.uid AS endpoint_uid, e.url, e.signing_secret, e.previous_signing_secret,
        e.previous_secret_expires_at, e.timeout_seconds, e.retry_schedule,
        e.custom_headers, e.status_overrides, e.proxy_url,
        ev.message_id, ev.event_type, ev.payload::text AS payload_json,
        ev.created_at AS event_created_at, ev.traceparent,
        {delivery}.endpoint_id,
        -- a spotless breaker: its successes need no health write (delivery/health/);
        -- an adaptive endpoint's limiter learns from every answer, so it is never spotless
        COALESCE(h.breaker_state = 'closed' AND h.consecutive_failures = 0
                 AND h.window_failures = 0 AND h.failing_since IS NULL
                 AND h.paused_until IS NULL AND h.trips = 0
                 AND NOT h.adaptive, true) AS endpoint_spotless
    """


# Relay one batch and hand part of it to this process's worker, already claimed.
# RELAY_BATCH, handing part of the fan-out straight to the worker of the relay's own
# process (Relay's `handoff`): those deliveries are inserted already claimed (in flight,
# claim number 1, leased to :worker_id until :lease_expires_at), which saves the worker
# a claim transaction and the relay a NOTIFY. Only what a claim would take at once
# without consulting anything goes this way: an enabled endpoint with no health gate
# (breaker closed, no limits, no ramp, no 429 pause) that is not ordered, whose tenant is
# enabled and uncapped; at most :handoff_limit rows, and per endpoint at most its slots
# left in that worker (:slot_endpoint_ids / :slot_counts, else :endpoint_slots).
# Everything else is inserted scheduled, exactly as RELAY_BATCH does. The lease and the
# claim number fence a handed-off delivery like any claimed one: if the process dies
# after this commits, the reaper reschedules it when the lease expires.
# One row per handed-off delivery (the claim's columns, CLAIM_DUE_DELIVERIES), each
# with the counts; a single row with NULL claim columns when none was handed off.
RELAY_BATCH_HANDOFF = text(
    f"""
    WITH batch AS ({_RELAY_PICK}), routed AS (
        SELECT b.id AS event_id, e.id AS endpoint_id, e.tenant_id, b.priority, b.ordering_key,
               COALESCE(e.max_attempts, ({_EVENT_TYPE_MAX_ATTEMPTS}), :max_attempts)
                   AS max_attempts,
               NOT EXISTS (
                   SELECT 1 FROM endpoint_health h
                   WHERE h.endpoint_id = e.id
                     AND ({HEALTH_GATED} OR h.ordered)
               ) AND EXISTS (
                   SELECT 1 FROM tenants t
                   WHERE t.id = e.tenant_id AND t.enabled
                     AND t.max_in_flight IS NULL AND t.max_per_second IS NULL
               ) AS free
        {_RELAY_ROUTES}
    ), slots AS (
        SELECT * FROM unnest(CAST(:slot_endpoint_ids AS bigint[]), CAST(:slot_counts AS int[]))
            AS s(endpoint_id, slots)
    ), within_endpoint AS (
        SELECT r.*,
               r.free AND row_number() OVER (
                   PARTITION BY r.free, r.endpoint_id ORDER BY r.event_id
               ) <= COALESCE(s.slots, :endpoint_slots) AS fits
        FROM routed r LEFT JOIN slots s ON s.endpoint_id = r.endpoint_id
    ), handed AS (
        SELECT w.*,
               w.fits AND row_number() OVER (
                   PARTITION BY w.fits ORDER BY w.event_id, w.endpoint_id
               ) <= :handoff_limit AS handed
        FROM within_endpoint w
    ), fanned AS (
        INSERT INTO deliveries
            (event_id, endpoint_id, tenant_id, state, max_attempts, next_attempt_at, priority,
             ordering_key, created_at, updated_at, locked_by, lease_expires_at, claims)
        SELECT h.event_id, h.endpoint_id, h.tenant_id,
               CASE WHEN h.handed THEN 'in_flight' ELSE 'scheduled' END,
               h.max_attempts, :now, h.priority, h.ordering_key, :now, :now,
               CASE WHEN h.handed THEN CAST(:worker_id AS text) END,
               CASE WHEN h.handed THEN CAST(:lease_expires_at AS timestamptz) END,
               CASE WHEN h.handed THEN 1 ELSE 0 END
        FROM handed h
        ORDER BY h.event_id, h.endpoint_id
        ON CONFLICT (event_id, endpoint_id) WHERE replay_of IS NULL DO NOTHING
        RETURNING id, event_id, endpoint_id, state, claims, attempts, max_attempts
    ), marked AS (
        UPDATE outbox_events o SET relayed_at = :now
        FROM batch WHERE o.id = batch.id
        RETURNING 1
    ), claimed AS (
        SELECT {claimed_columns("f")}
        FROM fanned f
        JOIN outbox_events ev ON ev.id = f.event_id
        JOIN endpoints e ON e.id = f.endpoint_id
        LEFT JOIN endpoint_health h ON h.endpoint_id = e.id
        WHERE f.state = 'in_flight'
    )
    SELECT counts.*, c.*
    FROM (SELECT {_RELAY_COUNTS}) counts LEFT JOIN claimed c ON true
    """
)

# Wake the workers: deliveries are due.
NOTIFY_DELIVERIES_DUE = text(f"SELECT pg_notify('{DELIVERIES_CHANNEL}', '')")

# Publish the storm-bounded summaries of dead deliveries whose minute is over (migration 0009).
FLUSH_OPERATIONAL_SUMMARIES = text("SELECT outbox_flush_operational_summaries(:now)")
