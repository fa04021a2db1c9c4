"""The relay: claim a batch of events, fan it out to deliveries, hand part of it to the
worker of its own process (outbox/relay.py). The claim (delivery/queries.py) shares two
fragments from here, HEALTH_GATED and claimed_columns, so the claim and the handoff agree
on what an ungated endpoint is and on what a worker gets of a delivery."""

from __future__ import annotations

from sqlalchemy import text

from outbox.catalogue import OPERATIONAL_EVENT_TYPES_SQL

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
_OPERATIONAL = OPERATIONAL_EVENT_TYPES_SQL
_CANDIDATE_PATTERNS = f"""
    SELECT '*' AS pattern
    WHERE b.event_type NOT IN {_OPERATIONAL}
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
# `owner`: the owner an operational event names (its payload's), for routing to endpoints
# that take one owner's operational events only.
_RELAY_PICK = f"""
    -- the payload only for filtered endpoints (_RELAY_ROUTES): read with the row already
    -- fetched, once per event rather than one more probe per filtered route
    SELECT id, tenant_id, event_type, ordering_key, priority, payload,
           CASE WHEN event_type IN {_OPERATIONAL} THEN payload ->> 'owner' END AS owner
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
        SELECT x.id, x.tenant_id, x.max_attempts, x.delivery_mode,
               -- the payload filter (outbox/filters.py): true, false, or NULL when it
               -- could not be evaluated on this payload; evaluated only for an endpoint
               -- that has one
               CASE WHEN x.payload_filter IS NULL THEN true
                    ELSE outbox_payload_matches(b.payload, x.payload_filter) END AS matched
        FROM endpoints x
        WHERE x.id = r.endpoint_id AND x.enabled
          -- an endpoint subscribed for one owner (migration 0031) gets that owner's
          -- operational events only; application events are not filtered
          AND (x.operational_owner IS NULL OR b.event_type NOT IN {_OPERATIONAL}
               OR b.owner = x.operational_owner)
        LIMIT 1
    ) e
"""

# The routes of a batch (`routed`: event_id, endpoint_id, delivery_mode, matched) that
# feed an endpoint's catch-up feed (migration 0025), appended to it in event order.
# `feed_heads` takes each fed endpoint's endpoint_feeds row lock, in endpoint order (so
# two relays never deadlock), until the commit: a concurrent relay appending to the same
# endpoint waits and numbers after it, so positions are in commit order and a reader
# that has seen position n can never have missed a smaller one. Events whose filter
# could not be evaluated are recorded in filter_skips (counted, never silent).
_FEED_AND_SKIPS = """
    feed_routes AS (
        SELECT event_id, endpoint_id,
               row_number() OVER (PARTITION BY endpoint_id ORDER BY event_id) AS n,
               count(*) OVER (PARTITION BY endpoint_id) AS total
        FROM routed WHERE matched AND delivery_mode <> 'push'
    ), feed_heads AS (
        INSERT INTO endpoint_feeds AS f (endpoint_id, last_position)
        SELECT endpoint_id, count(*) FROM feed_routes GROUP BY endpoint_id ORDER BY endpoint_id
        ON CONFLICT (endpoint_id)
            DO UPDATE SET last_position = f.last_position + excluded.last_position
        RETURNING f.endpoint_id, f.last_position
    ), fed AS (
        INSERT INTO feed_entries (endpoint_id, position, event_id, created_at)
        SELECT r.endpoint_id, h.last_position - r.total + r.n, r.event_id, :now
        FROM feed_routes r JOIN feed_heads h ON h.endpoint_id = r.endpoint_id
        RETURNING 1
    ), skipped AS (
        INSERT INTO filter_skips (endpoint_id, event_id, created_at)
        SELECT endpoint_id, event_id, :now FROM routed WHERE matched IS NULL
        ON CONFLICT DO NOTHING
        RETURNING 1
    )
"""

# What a relay pass reports: events marked, deliveries fanned out, events to validate.
_RELAY_COUNTS = """
    (SELECT count(*) FROM marked) AS events, (SELECT count(*) FROM fanned) AS deliveries,
    (SELECT count(*) FROM fed) AS fed, (SELECT count(*) FROM skipped) AS skipped,
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
    WITH batch AS ({_RELAY_PICK}), routed AS (
        SELECT b.id AS event_id, e.id AS endpoint_id, e.tenant_id, b.priority, b.ordering_key,
               COALESCE(e.max_attempts, ({_EVENT_TYPE_MAX_ATTEMPTS}), :max_attempts)
                   AS max_attempts,
               e.delivery_mode, e.matched
        {_RELAY_ROUTES}
    ), fanned AS (
        -- a pull-only endpoint gets no delivery row: nothing for a worker to claim
        INSERT INTO deliveries
            (event_id, endpoint_id, tenant_id, state, max_attempts, next_attempt_at, priority,
             ordering_key, created_at, updated_at)
        SELECT r.event_id, r.endpoint_id, r.tenant_id, 'scheduled', r.max_attempts, :now,
               r.priority, r.ordering_key, :now, :now
        FROM routed r
        WHERE r.matched AND r.delivery_mode <> 'pull'
        ORDER BY r.event_id, r.endpoint_id
        ON CONFLICT (event_id, endpoint_id) WHERE replay_of IS NULL DO NOTHING
        RETURNING 1
    ), {_FEED_AND_SKIPS}, marked AS (
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
        e.custom_headers, e.status_overrides, e.proxy_url, e.client_certificate,
        e.oauth_client,
        -- hold an ambiguous outcome for a person when the endpoint or the event type says
        -- so (migration 0031; delivery/worker/outcomes.py)
        (e.on_ambiguous IS NOT DISTINCT FROM 'hold' OR EXISTS (
            SELECT 1 FROM event_types t
            WHERE t.name = ev.event_type AND t.on_ambiguous = 'hold')) AS hold_ambiguous,
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
               e.delivery_mode, e.matched,
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
        WHERE r.matched AND r.delivery_mode <> 'pull'
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
    ), {_FEED_AND_SKIPS}, marked AS (
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
