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
INSERT_EVENT = text(
    """
    WITH current_type AS (
        -- the catalogue revision publish() validated against is still the current one
        SELECT COALESCE((SELECT revision FROM event_types WHERE name = :event_type), '')
               = :catalogue_revision AS ok
    ), tenant AS (
        SELECT id FROM tenants WHERE uid = :tenant AND (SELECT ok FROM current_type)
    ), inserted AS (
        INSERT INTO outbox_events
            (message_id, tenant_id, event_type, payload, idempotency_key, ordering_key,
             priority, traceparent)
        SELECT :message_id, tenant.id, :event_type, CAST(:payload AS jsonb), :idempotency_key,
               :ordering_key,
               COALESCE(CAST(:priority AS smallint),
                        (SELECT p.priority FROM event_type_priorities p
                         WHERE p.event_type = :event_type),
                        0),
               :traceparent
        FROM tenant
        ON CONFLICT (tenant_id, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
        RETURNING message_id
    ), woken AS (
        SELECT pg_notify('outbox_events', '') FROM inserted
        WHERE NOT EXISTS (SELECT 1 FROM outbox_events WHERE relayed_at IS NULL)
    )
    SELECT message_id FROM inserted LEFT JOIN woken ON true
    UNION ALL
    SELECT message_id FROM outbox_events
    WHERE tenant_id = (SELECT id FROM tenant) AND idempotency_key = :idempotency_key
      AND NOT EXISTS (SELECT 1 FROM inserted)
    UNION ALL
    -- an unknown tenant: nothing was inserted; publish() raises (refusing is the default)
    SELECT NULL WHERE NOT EXISTS (SELECT 1 FROM tenant) AND (SELECT ok FROM current_type)
    UNION ALL
    -- the catalogue changed since publish() cached the type: nothing was inserted;
    -- publish() re-reads the type, validates again and retries
    SELECT '' WHERE NOT (SELECT ok FROM current_type)
    """
)

# When a concurrent transaction inserted the same key after our statement's snapshot,
# the first query sees neither row; by now that transaction has committed.
FIND_EVENT_BY_IDEMPOTENCY_KEY = text(
    """
    SELECT message_id FROM outbox_events
    WHERE tenant_id = (SELECT id FROM tenants WHERE uid = :tenant)
      AND idempotency_key = :idempotency_key
    """
)


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

# An endpoint whose health row gates its claims (delivery/health.py): breaker not closed,
# a concurrency or rate limit, a ramp or a 429 pause (`h`: its endpoint_health row). One
# definition for the claim's gates, the claim's quick path and the relay's handoff, so
# that what one of them treats as ungated the others do too.
HEALTH_GATED = """(h.breaker_state <> 'closed' OR h.max_in_flight IS NOT NULL
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

_RELAY_COUNTS = """
    (SELECT count(*) FROM marked) AS events, (SELECT count(*) FROM fanned) AS deliveries,
    EXISTS (SELECT 1 FROM outbox_events WHERE relayed_at IS NULL AND validate_pending)
        AS to_validate
"""

# Claim, fan out and mark one batch in one statement (and so one transaction).
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
        -- a spotless breaker: its successes need no health write (delivery/health.py)
        COALESCE(h.breaker_state = 'closed' AND h.consecutive_failures = 0
                 AND h.window_failures = 0 AND h.failing_since IS NULL
                 AND h.paused_until IS NULL AND h.trips = 0, true) AS endpoint_spotless
    """


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


# Tenant scope of operator reads and writes: every such statement takes :scope_id, the
# internal id of the caller's tenant (NULL: unscoped), from outbox.tenants.scope_params,
# and keeps only rows of that tenant. Enforced here, in the queries, so a scoped caller
# cannot reach another tenant's row by any id (an unknown tenant is -1: nothing). The id
# is resolved first, not looked up in a subquery, so the planner sees a constant and its
# statistics: a small tenant's page then reads the (tenant_id, id) index instead of
# walking every delivery (9 ms -> 0.1 ms on 200,000 deliveries; scope_params also keeps
# PostgreSQL from settling on a generic plan that would walk them again).
def _in_scope(column: str) -> str:
    return f"(CAST(:scope_id AS bigint) IS NULL OR {column} = :scope_id)"


NOTIFY_DELIVERIES_DUE = text(f"SELECT pg_notify('{DELIVERIES_CHANNEL}', '')")

INSERT_ENDPOINT = text(
    """
    INSERT INTO endpoints
        (uid, tenant_id, all_tenants, url, description, event_types, signing_secret,
         signature_scheme, signing_public_key)
    SELECT :uid, t.id, :all_tenants, :url, :description, :event_types, :signing_secret,
           :signature_scheme, :public_key
    FROM tenants t WHERE t.uid = :tenant
    RETURNING id
    """
)

_ENDPOINT_COLUMNS = """
    e.id, e.uid, t.uid AS tenant, e.all_tenants, e.url, e.description, e.event_types,
    e.enabled, e.disabled_reason, e.disabled_at, e.created_at, e.signature_scheme,
    e.signing_public_key AS public_key, e.proxy_host AS proxy
"""

SELECT_ENDPOINTS = text(
    f"""
    SELECT {_ENDPOINT_COLUMNS}
    FROM endpoints e JOIN tenants t ON t.id = e.tenant_id
    WHERE {_in_scope("e.tenant_id")}
    ORDER BY e.id
    """
)

SELECT_ENDPOINT_BY_UID = text(
    f"""
    SELECT {_ENDPOINT_COLUMNS}
    FROM endpoints e JOIN tenants t ON t.id = e.tenant_id
    WHERE e.uid = :uid AND {_in_scope("e.tenant_id")}
    """
)

SET_ENDPOINT_ENABLED = text(
    f"""
    UPDATE endpoints
    SET enabled = :enabled,
        disabled_reason = CASE WHEN :enabled THEN NULL ELSE CAST(:reason AS text) END,
        disabled_at = CASE WHEN :enabled THEN NULL ELSE now() END,
        updated_at = now()
    WHERE uid = :uid AND {_in_scope("tenant_id")}
    RETURNING id
    """
)

# Per-endpoint delivery rules (NULL means "use the global default").
SELECT_ENDPOINT_DELIVERY_RULES = text(
    """
    SELECT timeout_seconds, max_attempts, retry_schedule, status_overrides
    FROM endpoints WHERE uid = :uid
    """
)

SET_ENDPOINT_DELIVERY_RULES = text(
    """
    UPDATE endpoints
    SET timeout_seconds = :timeout_seconds, max_attempts = :max_attempts,
        retry_schedule = CAST(:retry_schedule AS double precision[]),
        status_overrides = CAST(:status_overrides AS jsonb), updated_at = now()
    WHERE uid = :uid
    RETURNING id
    """
)

SET_ENDPOINT_SIGNING_SECRET = text(
    "UPDATE endpoints SET signing_secret = :signing_secret, updated_at = now() WHERE id = :id"
)


# The tenant an audit row concerns: the one given, else the tenant of the endpoint or
# delivery it targets (so rows written anywhere, the send path included, are scoped
# without each caller looking it up). The regex guard keeps a non-numeric target id
# from reaching the bigint cast.
def _audit_tenant(target_type: str, target_id: str) -> str:
    return f"""COALESCE(CAST(:tenant_uid AS text), CASE {target_type}
        WHEN 'endpoint' THEN (SELECT atn.uid FROM endpoints ae JOIN tenants atn
                              ON atn.id = ae.tenant_id WHERE ae.uid = {target_id})
        WHEN 'delivery' THEN (SELECT atn.uid FROM deliveries ad JOIN tenants atn
                              ON atn.id = ad.tenant_id
                              WHERE ad.id = CASE WHEN {target_id} ~ '^[0-9]{{1,18}}$'
                                                 THEN CAST({target_id} AS bigint) END)
        END)"""


INSERT_AUDIT = text(
    f"""
    INSERT INTO audit_log
        (actor, action, target_type, target_id, reason, details, request_id, tenant_uid)
    VALUES (:actor, :action, :target_type, :target_id, :reason, CAST(:details AS jsonb),
            :request_id,
            {_audit_tenant("CAST(:target_type AS text)", "CAST(:target_id AS text)")})
    """
)


# --- operator tools (issue 5) ---------------------------------------------------------
# Search takes every filter as an optional bind parameter, so one prepared statement
# serves every combination. Paging is keyset on id (newest first): pass the last id seen.
_DELIVERY_FILTER = f"""
    {_in_scope("d.tenant_id")}
    AND (CAST(:states AS text[]) IS NULL OR d.state = ANY(CAST(:states AS text[])))
    AND (CAST(:endpoint AS text) IS NULL OR e.uid = :endpoint)
    AND (CAST(:event_type AS text) IS NULL OR ev.event_type = :event_type)
    AND (CAST(:message_id AS text) IS NULL OR ev.message_id = :message_id)
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

_DELIVERY_COLUMNS = """
    d.id, d.state, d.attempts, d.max_attempts, d.next_attempt_at, d.last_status_code,
    d.last_error, d.final_reason, d.replay_of, d.created_at, d.updated_at, d.completed_at,
    e.uid AS endpoint_uid, e.url AS endpoint_url, ev.message_id, ev.event_type,
    (SELECT t.uid FROM tenants t WHERE t.id = d.tenant_id) AS tenant
"""

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

COUNT_DELIVERIES = text(
    f"""
    SELECT count(*)
    FROM deliveries d
    JOIN endpoints e ON e.id = d.endpoint_id
    JOIN outbox_events ev ON ev.id = d.event_id
    WHERE {_DELIVERY_FILTER}
    """
)

SELECT_DELIVERY = text(
    f"""
    SELECT {_DELIVERY_COLUMNS}, ev.payload, ev.created_at AS event_created_at,
           ev.relayed_at AS event_relayed_at, d.locked_by, d.lease_expires_at
    FROM deliveries d
    JOIN endpoints e ON e.id = d.endpoint_id
    JOIN outbox_events ev ON ev.id = d.event_id
    WHERE d.id = :id AND {_in_scope("d.tenant_id")}
    """
)

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

SELECT_DELIVERY_STATES = text(
    f"""
    SELECT id, state FROM deliveries
    WHERE id = ANY(CAST(:ids AS bigint[])) AND {_in_scope("tenant_id")}
    """
)

# A replay locks the rows it replays, in id order (so concurrent replays never
# deadlock): a second replay of the same delivery waits for the first to commit and
# then sees its replay. The originals are terminal, so no worker ever waits on this.
LOCK_DELIVERIES_FOR_REPLAY = text(
    f"""
    SELECT id, state FROM deliveries
    WHERE id = ANY(CAST(:ids AS bigint[])) AND {_in_scope("tenant_id")}
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
        WHERE d.state = ANY(CAST(:allowed AS text[])) AND {_in_scope("d.tenant_id")}
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

# Discarding is terminal; in-flight rows are left alone (the attempt may be landing).
DISCARD_DELIVERIES = text(
    f"""
    UPDATE deliveries
    SET state = 'discarded', final_reason = :reason, locked_by = NULL, lease_expires_at = NULL,
        updated_at = :now, completed_at = :now
    WHERE id = ANY(CAST(:ids AS bigint[])) AND state IN ('scheduled', 'dead')
      AND {_in_scope("tenant_id")}
    RETURNING id
    """
)

# Many audit rows in one statement (bulk replay and discard).
INSERT_AUDIT_MANY = text(
    f"""
    INSERT INTO audit_log
        (actor, action, target_type, target_id, reason, details, request_id, tenant_uid)
    SELECT :actor, :action, :target_type, t.target_id, :reason, CAST(t.details AS jsonb),
           :request_id, {_audit_tenant("CAST(:target_type AS text)", "t.target_id")}
    FROM unnest(CAST(:target_ids AS text[]), CAST(:details AS text[])) AS t(target_id, details)
    """
)

SELECT_AUDIT = text(
    """
    SELECT id, at, actor, action, target_type, target_id, reason, details, request_id,
           tenant_uid AS tenant
    FROM audit_log
    WHERE (CAST(:scope AS text) IS NULL OR tenant_uid = :scope)
      AND (CAST(:actor AS text) IS NULL OR actor = :actor)
      AND (CAST(:action AS text) IS NULL OR action = :action OR starts_with(action, :action || '.'))
      AND (CAST(:target_id AS text) IS NULL OR target_id = :target_id)
      AND (CAST(:since AS timestamptz) IS NULL OR at >= :since)
      AND (CAST(:before_id AS bigint) IS NULL OR id < :before_id)
    ORDER BY id DESC
    LIMIT :limit
    """
)

UPDATE_ENDPOINT = text(
    f"""
    UPDATE endpoints
    SET url = COALESCE(CAST(:url AS text), url),
        description = COALESCE(CAST(:description AS text), description),
        event_types = COALESCE(CAST(:event_types AS text[]), event_types),
        timeout_seconds = CASE WHEN :set_timeout THEN CAST(:timeout_seconds AS float8)
                               ELSE timeout_seconds END,
        max_attempts = CASE WHEN :set_max_attempts THEN CAST(:max_attempts AS integer)
                            ELSE max_attempts END,
        updated_at = now()
    WHERE uid = :uid AND {_in_scope("tenant_id")}
    RETURNING id
    """
)

# The current secret becomes the previous one until the grace period ends; the worker
# signs with both meanwhile, so receivers can switch at their own pace.
ROTATE_ENDPOINT_SECRET = text(
    f"""
    UPDATE endpoints
    SET previous_signing_secret = signing_secret,
        previous_secret_expires_at = :expires_at,
        signing_secret = :signing_secret,
        signature_scheme = :signature_scheme,
        signing_public_key = :public_key,
        updated_at = now()
    WHERE uid = :uid AND {_in_scope("tenant_id")}
    RETURNING id
    """
)

COUNT_ENDPOINT_DELIVERIES = text(
    f"""
    SELECT count(*) FILTER (WHERE d.state IN ('scheduled', 'in_flight')) AS pending,
           count(*) AS total
    FROM deliveries d JOIN endpoints e ON e.id = d.endpoint_id
    WHERE e.uid = :uid AND {_in_scope("e.tenant_id")}
    """
)

# Deleting an endpoint removes its history (ON DELETE CASCADE); the attempts go
# through the same tally as retention so exported totals never go backwards. Tallies
# are kept per tenant (the delivery's), so a tenant's scoped totals do not either.
# `gone_attempts` returns (outcome, duration_ms, tenant_id).
_TALLY_PRUNED_ATTEMPTS = """
    tally AS (
        INSERT INTO pruned_totals (tenant_id, name, value)
        SELECT tenant_id, name, sum(value) FROM (
            SELECT tenant_id, 'attempts:' || outcome, 1::float8 FROM gone_attempts
            UNION ALL
            SELECT tenant_id, 'attempt_seconds_sum', duration_ms / 1000.0 FROM gone_attempts
            UNION ALL
            SELECT tenant_id, 'attempt_seconds_le:' || b, 1 FROM gone_attempts,
                   unnest(CAST(:buckets AS float8[])) AS b
            WHERE duration_ms / 1000.0 <= b
        ) AS t(tenant_id, name, value)
        GROUP BY tenant_id, name
        ON CONFLICT (tenant_id, name)
            DO UPDATE SET value = pruned_totals.value + excluded.value
        RETURNING 1
    )
"""

DELETE_ENDPOINT = text(
    f"""
    WITH target AS (
        SELECT id FROM endpoints WHERE uid = :uid AND {_in_scope("tenant_id")} FOR UPDATE
    ), gone_attempts AS (
        DELETE FROM delivery_attempts a USING deliveries d, target t
        WHERE a.delivery_id = d.id AND d.endpoint_id = t.id
        RETURNING a.outcome, a.duration_ms, d.tenant_id
    ), {_TALLY_PRUNED_ATTEMPTS}, gone AS (
        DELETE FROM endpoints e USING target t WHERE e.id = t.id RETURNING e.id
    )
    SELECT (SELECT count(*) FROM gone) AS endpoints,
           (SELECT count(*) FROM gone_attempts) AS attempts,
           (SELECT count(*) FROM tally) AS tallied
    """
)

# A group is one event's deliveries to one endpoint (the first delivery and its
# replays); it is pruned whole, so a replay never outlives the row it points at and
# no two replays can collide on the first-delivery unique index. A group goes when
# every member finished before the cutoff and no member is a dead letter nobody
# replayed, unless that dead letter is older than its own, longer, cutoff.
# Seeds come from the completed_at index in age order; LIMIT keeps each batch small.
_UNRESOLVED_DEAD = """
    m.state = 'dead'
    AND NOT EXISTS (SELECT 1 FROM deliveries r WHERE r.replay_of = m.id)
    AND (CAST(:dead_before AS timestamptz) IS NULL OR m.completed_at >= :dead_before)
"""

PRUNE_DELIVERIES = text(
    f"""
    WITH seed AS (
        SELECT s.event_id, s.endpoint_id
        FROM deliveries s
        WHERE s.state IN ('succeeded', 'dead', 'discarded') AND s.completed_at < :before
          AND NOT EXISTS (
              SELECT 1 FROM deliveries m
              WHERE m.event_id = s.event_id AND m.endpoint_id = s.endpoint_id
                AND (m.state IN ('scheduled', 'in_flight')
                     OR m.completed_at IS NULL
                     OR m.completed_at >= :before
                     OR ({_UNRESOLVED_DEAD}))
          )
        ORDER BY s.completed_at
        LIMIT :limit
    ), groups AS (
        SELECT DISTINCT event_id, endpoint_id FROM seed
    ), doomed AS (
        SELECT d.id, d.tenant_id FROM deliveries d JOIN groups g USING (event_id, endpoint_id)
        FOR UPDATE OF d
    ), gone_attempts AS (
        DELETE FROM delivery_attempts a USING doomed WHERE a.delivery_id = doomed.id
        RETURNING a.outcome, a.duration_ms, doomed.tenant_id
    ), {_TALLY_PRUNED_ATTEMPTS}, gone AS (
        DELETE FROM deliveries d USING doomed WHERE d.id = doomed.id RETURNING d.state
    )
    SELECT (SELECT count(*) FROM gone) AS deliveries,
           (SELECT count(*) FROM gone_attempts) AS attempts,
           (SELECT count(*) FROM tally) AS tallied
    """
)

# Relayed events with no delivery left (all pruned, or nobody subscribed).
PRUNE_EVENTS = text(
    """
    WITH doomed AS (
        SELECT o.id FROM outbox_events o
        WHERE o.relayed_at IS NOT NULL AND o.relayed_at < :before
          AND NOT EXISTS (SELECT 1 FROM deliveries d WHERE d.event_id = o.id)
        ORDER BY o.relayed_at
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    ), gone AS (
        DELETE FROM outbox_events o USING doomed WHERE o.id = doomed.id RETURNING o.tenant_id
    ), tally AS (
        INSERT INTO pruned_totals (tenant_id, name, value)
        SELECT tenant_id, 'events', count(*) FROM gone GROUP BY tenant_id
        ON CONFLICT (tenant_id, name) DO UPDATE SET value = pruned_totals.value + excluded.value
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM gone) AS events, (SELECT count(*) FROM tally) AS tallied
    """
)

# Tallies of pruned rows, of one tenant or (unscoped) all, the pre-0018 ones included.
SELECT_PRUNED_TOTALS = text(
    f"""
    SELECT name, sum(value) AS value FROM pruned_totals
    WHERE {_in_scope("tenant_id")}
    GROUP BY name
    """
)

# The oldest audit rows, a batch at a time (OUTBOX_AUDIT_RETENTION_DAYS).
PRUNE_AUDIT = text(
    """
    WITH doomed AS (
        SELECT id FROM audit_log WHERE at < :before ORDER BY at LIMIT :limit
    ), gone AS (
        DELETE FROM audit_log a USING doomed WHERE a.id = doomed.id RETURNING 1
    )
    SELECT count(*) AS audit FROM gone
    """
)

# Refused API calls are aggregated: one row per actor, client, status and reason per
# interval, whose details.count grows. The lookup walks ix_audit_log_at from the
# interval's start, which holds few rows precisely because they are aggregated.
BUMP_REFUSAL = text(
    """
    UPDATE audit_log
    SET details = details || jsonb_build_object(
            'count', COALESCE(CAST(details ->> 'count' AS bigint), 1) + :count,
            'last_at', CAST(:last_at AS text)),
        request_id = :request_id
    WHERE id = (
        SELECT id FROM audit_log
        WHERE at >= :since AND action = 'api.refused' AND actor = :actor AND reason = :reason
          AND details ->> 'client' IS NOT DISTINCT FROM CAST(:client AS text)
          AND details ->> 'status' = CAST(:status AS text)
          AND tenant_uid IS NOT DISTINCT FROM CAST(:tenant AS text)
        ORDER BY id LIMIT 1
    )
    RETURNING id
    """
)

INSERT_REFUSAL = text(
    """
    INSERT INTO audit_log
        (at, actor, action, target_type, target_id, reason, details, request_id, tenant_uid)
    VALUES (:now, :actor, 'api.refused', 'http', :target_id, :reason, CAST(:details AS jsonb),
            :request_id, :tenant)
    """
)

# Admin API tokens.
INSERT_TOKEN = text(
    """
    INSERT INTO admin_tokens (token_id, name, role, secret_hash, created_by, tenant_uid,
                              expires_at)
    VALUES (:token_id, :name, :role, :secret_hash, :created_by, :tenant_uid, :expires_at)
    RETURNING id, token_id, name, role, created_by, created_at, last_used_at, revoked_at,
              tenant_uid AS tenant, expires_at
    """
)

SELECT_TOKENS = text(
    """
    SELECT id, token_id, name, role, created_by, created_at, last_used_at, revoked_at,
           tenant_uid AS tenant, expires_at
    FROM admin_tokens
    WHERE (CAST(:include_revoked AS boolean) OR revoked_at IS NULL)
      AND (CAST(:scope AS text) IS NULL OR tenant_uid = :scope)
    ORDER BY id
    """
)

# Revoked rows too, so a token revoked because its tenant was deleted can say so.
SELECT_TOKEN_FOR_AUTH = text(
    """
    SELECT k.id, k.name, k.role, k.secret_hash, k.revoked_at, k.tenant_uid, k.expires_at,
           (k.tenant_uid IS NULL OR EXISTS (SELECT 1 FROM tenants t WHERE t.uid = k.tenant_uid))
               AS tenant_exists
    FROM admin_tokens k
    WHERE k.token_id = :token_id
    """
)

TOUCH_TOKEN = text("UPDATE admin_tokens SET last_used_at = :now WHERE id = :id")

SELECT_TOKENS_TO_REVOKE = text(
    """
    SELECT id, token_id, tenant_uid FROM admin_tokens
    WHERE (name = :name OR token_id = :name) AND revoked_at IS NULL
      AND (CAST(:scope AS text) IS NULL OR tenant_uid = :scope)
    ORDER BY id
    """
)

REVOKE_TOKEN = text(
    """
    UPDATE admin_tokens SET revoked_at = :now
    WHERE id = :id AND revoked_at IS NULL
    RETURNING token_id, tenant_uid
    """
)


# --- stats, alerts and metrics (issue 5) ---------------------------------------------

STATS_COUNTS_BY_STATE = text(
    f"SELECT state, count(*) AS n FROM deliveries WHERE {_in_scope('tenant_id')} GROUP BY state"
)

# Due deliveries of enabled endpoints only: a disabled endpoint's backlog waits on
# purpose and has an alert of its own.
STATS_OLDEST_DUE = text(
    f"""
    SELECT min(d.next_attempt_at) AS oldest_due, count(*) AS due
    FROM deliveries d JOIN endpoints e ON e.id = d.endpoint_id
    WHERE d.state = 'scheduled' AND d.next_attempt_at <= :now AND e.enabled
      AND {_in_scope("d.tenant_id")}
    """
)

# A scoped caller sees its own tenant's events (the ones it published).
STATS_RELAY_LAG = text(
    f"""
    SELECT min(created_at) AS oldest_unrelayed, count(*) AS unrelayed
    FROM outbox_events WHERE relayed_at IS NULL AND {_in_scope("tenant_id")}
    """
)

# Attempts are scoped through their delivery's tenant.
_SCOPED_ATTEMPTS = f"""
    delivery_attempts a WHERE (CAST(:scope_id AS bigint) IS NULL OR EXISTS (
        SELECT 1 FROM deliveries sd WHERE sd.id = a.delivery_id AND {_in_scope("sd.tenant_id")}))
"""

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
           AND {_in_scope("tenant_id")})
            AS succeeded,
        (SELECT count(*) FROM deliveries
         WHERE state = 'dead' AND completed_at >= :since AND completed_at <= :now
           AND {_in_scope("tenant_id")}) AS dead,
        (SELECT count(*) FROM deliveries
         WHERE state = 'dead' AND completed_at >= :previous AND completed_at < :since
           AND {_in_scope("tenant_id")})
            AS dead_previous_window,
        (SELECT count(*) FROM outbox_events
         WHERE created_at >= :since AND created_at <= :now AND {_in_scope("tenant_id")})
            AS published
    """
)

# Per endpoint: the window's attempts (success rate, latency percentiles) and the
# current backlog. An endpoint counts as auto-disabled when no operator's
# 'endpoint.disable' audit row explains its current disablement (rows by a worker,
# by 'system', or with details.automatic = true are not an operator's).
STATS_ENDPOINTS = text(
    f"""
    WITH recent AS (
        SELECT d.endpoint_id, a.outcome, a.duration_ms
        FROM delivery_attempts a JOIN deliveries d ON d.id = a.delivery_id
        WHERE a.started_at >= :since AND a.started_at <= :now AND {_in_scope("d.tenant_id")}
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
          AND {_in_scope("tenant_id")}
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
           COALESCE(h.trips, 0) AS trips
    FROM endpoints e
    LEFT JOIN per ON per.endpoint_id = e.id
    LEFT JOIN backlog ON backlog.endpoint_id = e.id
    -- The breaker is written by delivery/health.py; a missing row is a closed breaker.
    LEFT JOIN endpoint_health h ON h.endpoint_id = e.id
    WHERE {_in_scope("e.tenant_id")}
    ORDER BY e.id
    """
)

STATS_TOP_ERRORS = text(
    f"""
    SELECT a.error, count(DISTINCT a.delivery_id) AS deliveries, count(*) AS attempts,
           count(DISTINCT d.endpoint_id) AS endpoints, max(a.started_at) AS last_seen
    FROM delivery_attempts a JOIN deliveries d ON d.id = a.delivery_id
    WHERE a.started_at >= :since AND a.started_at <= :now
      AND a.outcome <> 'succeeded' AND a.error IS NOT NULL
      AND {_in_scope("d.tenant_id")}
    GROUP BY a.error
    ORDER BY deliveries DESC, attempts DESC, a.error
    LIMIT :limit
    """
)

# Totals for /metrics, in one scan each. `bucket` counts the histogram bounds below
# an attempt's duration (width_bucket over bounds + 1 ms, durations being whole
# milliseconds), i.e. the index of the smallest bound it fits under; the caller
# accumulates the buckets.
METRICS_EVENTS = text(
    f"""
    SELECT count(*) AS published, count(relayed_at) AS relayed FROM outbox_events
    WHERE {_in_scope("tenant_id")}
    """
)

METRICS_ATTEMPTS = text(
    f"""
    SELECT outcome, width_bucket(duration_ms, CAST(:bounds_ms_plus_one AS int[])) AS bucket,
           count(*) AS n, sum(duration_ms) / 1000.0 AS seconds
    FROM {_SCOPED_ATTEMPTS}
    GROUP BY 1, 2
    """
)

METRICS_TENANTS = text("SELECT enabled, count(*) AS n FROM tenants GROUP BY enabled")

SELECT_STORED_SECRETS = text(
    """
    SELECT id, uid, signing_secret, previous_signing_secret, custom_headers, proxy_url
    FROM endpoints ORDER BY id
    """
)

SELECT_ENDPOINT_SECRET = text(
    f"SELECT uid, signing_secret FROM endpoints WHERE uid = :uid AND {_in_scope('tenant_id')}"
)

SET_ENDPOINT_SECRETS = text(
    """
    UPDATE endpoints
    SET signing_secret = :signing_secret, previous_signing_secret = :previous_signing_secret,
        custom_headers = :custom_headers, proxy_url = :proxy_url, updated_at = now()
    WHERE id = :id
    """
)


# Default priorities per event type (`outbox priorities`).
SET_EVENT_TYPE_PRIORITY = text(
    """
    INSERT INTO event_type_priorities (event_type, priority, updated_at)
    VALUES (:event_type, :priority, now())
    ON CONFLICT (event_type) DO UPDATE SET priority = EXCLUDED.priority, updated_at = now()
    """
)

DELETE_EVENT_TYPE_PRIORITY = text(
    "DELETE FROM event_type_priorities WHERE event_type = :event_type RETURNING event_type"
)

SELECT_EVENT_TYPE_PRIORITIES = text(
    "SELECT event_type, priority FROM event_type_priorities ORDER BY priority DESC, event_type"
)

# An operator enabled the endpoint: forget the failure streak (auto-disable starts over)
# and let the breaker send one probe first; its success closes it and starts the ramp.
RESET_ENDPOINT_HEALTH_ON_ENABLE = text(
    """
    UPDATE endpoint_health
    SET breaker_state = 'open', open_until = NULL, probe_until = NULL, opened_at = now(),
        consecutive_failures = 0, window_started_at = NULL, window_attempts = 0,
        window_failures = 0, trips = 0, failing_since = NULL, paused_until = NULL,
        tokens = NULL, tokens_at = NULL, updated_at = now()
    WHERE endpoint_id = :id
    """
)

# An endpoint's own egress proxy (outbox/endpoints.py, set_proxy); in the caller's scope.
SET_ENDPOINT_PROXY = text(
    f"""
    UPDATE endpoints SET proxy_url = :proxy_url, proxy_host = :proxy_host, updated_at = now()
    WHERE uid = :uid AND {_in_scope("tenant_id")}
    RETURNING id
    """
)

SELECT_ENDPOINT_HEADERS = text("SELECT custom_headers FROM endpoints WHERE uid = :uid")

SET_ENDPOINT_HEADERS = text(
    """
    UPDATE endpoints SET custom_headers = :custom_headers, updated_at = now()
    WHERE uid = :uid
    RETURNING id
    """
)

# -- tenants (outbox/tenants.py) -----------------------------------------------------------

INSERT_TENANT = text(
    """
    INSERT INTO tenants (uid, name, metadata)
    VALUES (:uid, :name, CAST(:metadata AS jsonb))
    ON CONFLICT (uid) DO NOTHING
    RETURNING id
    """
)

_TENANT_COLUMNS = """
    t.id, t.uid, t.name, t.metadata, t.enabled, t.disabled_reason, t.disabled_at,
    t.max_in_flight, t.max_per_second, t.created_at, t.updated_at,
    (SELECT count(*) FROM endpoints e WHERE e.tenant_id = t.id) AS endpoints
"""

# Keyset paging on the uid: a tenant list can be long (one per customer).
SELECT_TENANTS = text(
    f"""
    SELECT {_TENANT_COLUMNS}
    FROM tenants t
    WHERE (CAST(:scope AS text) IS NULL OR t.uid = :scope)
      AND (CAST(:after AS text) IS NULL OR t.uid > :after)
      AND (CAST(:enabled AS boolean) IS NULL OR t.enabled = :enabled)
    ORDER BY t.uid
    LIMIT :limit
    """
)

SELECT_TENANT = text(
    f"""
    SELECT {_TENANT_COLUMNS}
    FROM tenants t
    WHERE t.uid = :uid AND (CAST(:scope AS text) IS NULL OR t.uid = :scope)
    """
)

# What `outbox tenants show` counts. Deliveries are the tenant's own (its endpoints');
# `other_pending` are deliveries of its events to other tenants' all-tenants endpoints,
# which deleting the tenant (and so its events) would remove too.
TENANT_COUNTS = text(
    """
    SELECT
        (SELECT count(*) FROM endpoints e WHERE e.tenant_id = :id AND e.all_tenants)
            AS all_tenants_endpoints,
        (SELECT count(*) FROM outbox_events o WHERE o.tenant_id = :id) AS events,
        (SELECT count(*) FROM outbox_events o WHERE o.tenant_id = :id AND o.relayed_at IS NULL)
            AS unrelayed_events,
        (SELECT count(*) FROM deliveries d
         WHERE d.tenant_id <> :id AND d.state IN ('scheduled', 'in_flight')
           AND d.event_id IN (SELECT o.id FROM outbox_events o WHERE o.tenant_id = :id))
            AS other_pending,
        (SELECT count(*) FROM admin_tokens k
         WHERE k.tenant_uid = :uid AND k.revoked_at IS NULL) AS tokens
    """
)

TENANT_DELIVERY_STATES = text(
    "SELECT state, count(*) AS n FROM deliveries WHERE tenant_id = :id GROUP BY state"
)

UPDATE_TENANT = text(
    """
    UPDATE tenants
    SET name = COALESCE(CAST(:name AS text), name),
        metadata = COALESCE(CAST(:metadata AS jsonb), metadata),
        max_in_flight = CASE WHEN :set_max_in_flight THEN CAST(:max_in_flight AS integer)
                             ELSE max_in_flight END,
        max_per_second = CASE WHEN :set_max_per_second THEN CAST(:max_per_second AS float8)
                              ELSE max_per_second END,
        updated_at = COALESCE(CAST(:now AS timestamptz), now())
    WHERE uid = :uid
    RETURNING id
    """
)

SET_TENANT_ENABLED = text(
    """
    UPDATE tenants
    SET enabled = :enabled,
        disabled_reason = CASE WHEN :enabled THEN NULL ELSE CAST(:reason AS text) END,
        disabled_at = CASE WHEN :enabled THEN NULL ELSE CAST(:now AS timestamptz) END,
        updated_at = :now
    WHERE uid = :uid
    RETURNING id
    """
)

LOCK_TENANT = text("SELECT id FROM tenants WHERE uid = :uid FOR UPDATE")

# Deleting a tenant removes its endpoints, events and their deliveries (ON DELETE
# CASCADE), including deliveries of its events to other tenants' all-tenants endpoints.
# Their attempts and the events go through the same tally as retention, so the totals
# on /metrics never go backwards.
DELETE_TENANT_ATTEMPTS_TALLIED = text(
    f"""
    WITH doomed AS (
        SELECT d.id, d.tenant_id FROM deliveries d WHERE d.tenant_id = :id
        UNION
        SELECT d.id, d.tenant_id FROM deliveries d
        WHERE d.event_id IN (SELECT o.id FROM outbox_events o WHERE o.tenant_id = :id)
    ), gone_attempts AS (
        DELETE FROM delivery_attempts a USING doomed WHERE a.delivery_id = doomed.id
        RETURNING a.outcome, a.duration_ms, doomed.tenant_id
    ), {_TALLY_PRUNED_ATTEMPTS}, events AS (
        INSERT INTO pruned_totals (tenant_id, name, value)
        SELECT :id, 'events', count(*) FROM outbox_events o WHERE o.tenant_id = :id
        HAVING count(*) > 0
        ON CONFLICT (tenant_id, name) DO UPDATE SET value = pruned_totals.value + excluded.value
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM doomed) AS deliveries,
           (SELECT count(*) FROM gone_attempts) AS attempts,
           (SELECT count(*) FROM tally) + (SELECT count(*) FROM events) AS tallied
    """
)

DELETE_TENANT = text("DELETE FROM tenants WHERE id = :id RETURNING uid")

REVOKE_TENANT_TOKENS = text(
    """
    UPDATE admin_tokens SET revoked_at = :now
    WHERE tenant_uid = :uid AND revoked_at IS NULL
    RETURNING token_id
    """
)

TENANT_EXISTS = text("SELECT id FROM tenants WHERE uid = :uid")

# For the rest of the transaction (outbox.tenants.scope_params says why).
FORCE_CUSTOM_PLANS = text("SET LOCAL plan_cache_mode = force_custom_plan")

# -- the event-type catalogue (outbox/catalogue.py) ---------------------------------------

# What publish() caches about one type: the current schema and the revision token its
# INSERT_EVENT compares against.
SELECT_EVENT_TYPE_FOR_PUBLISH = text(
    """
    SELECT t.revision, t.status, t.current_version AS version, v.schema
    FROM event_types t
    JOIN event_type_versions v ON v.event_type_id = t.id AND v.version = t.current_version
    WHERE t.name = :name
    """
)

_EVENT_TYPE_COLUMNS = """
    SELECT t.name, t.description, t.status, t.current_version, v.schema, v.example,
           t.created_at, t.updated_at
    FROM event_types t
    JOIN event_type_versions v ON v.event_type_id = t.id AND v.version = t.current_version
"""

SELECT_EVENT_TYPE = text(_EVENT_TYPE_COLUMNS + " WHERE t.name = :name")

SELECT_EVENT_TYPES = text(_EVENT_TYPE_COLUMNS + " ORDER BY t.name")

SELECT_EVENT_TYPE_VERSIONS = text(
    """
    SELECT v.version, v.schema, v.example, v.created_at
    FROM event_type_versions v JOIN event_types t ON t.id = v.event_type_id
    WHERE t.name = :name ORDER BY v.version
    """
)

# One version's schema, for a `$ref` to urn:outbox:event-type:NAME:VERSION (bundled in).
SELECT_EVENT_TYPE_VERSION_SCHEMA = text(
    """
    SELECT v.schema
    FROM event_type_versions v JOIN event_types t ON t.id = v.event_type_id
    WHERE t.name = :name AND v.version = :version
    """
)

INSERT_EVENT_TYPE = text(
    """
    INSERT INTO event_types (name, description) VALUES (:name, :description)
    ON CONFLICT (name) DO NOTHING
    RETURNING id
    """
)

INSERT_EVENT_TYPE_VERSION = text(
    """
    INSERT INTO event_type_versions (event_type_id, version, schema, example)
    VALUES (:id, :version, CAST(:schema AS jsonb), CAST(:example AS jsonb))
    """
)

LOCK_EVENT_TYPE = text("SELECT id FROM event_types WHERE name = :name FOR UPDATE")

SET_EVENT_TYPE_EXAMPLE = text(
    """
    UPDATE event_type_versions SET example = CAST(:example AS jsonb)
    WHERE event_type_id = (SELECT id FROM event_types WHERE name = :name)
      AND version = :version
    """
)

# Every change draws a new revision: publishers holding the old one re-read the type.
UPDATE_EVENT_TYPE = text(
    """
    UPDATE event_types
    SET current_version = :version,
        description = COALESCE(CAST(:description AS text), description),
        status = COALESCE(CAST(:status AS text), status),
        revision = gen_random_uuid()::text,
        updated_at = now()
    WHERE name = :name
    """
)

# Events written by outbox_publish() wait for the relay's schema check first.
CLAIM_EVENTS_TO_VALIDATE = text(
    """
    SELECT id, event_type, payload::text AS payload_json FROM outbox_events
    WHERE relayed_at IS NULL AND validate_pending
    ORDER BY id
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
    """
)

# Valid events go on to the relay; rejected ones leave the queue with their reason.
FINISH_VALIDATION = text(
    """
    UPDATE outbox_events o
    SET validate_pending = false,
        relayed_at = CASE WHEN r.reason IS NOT NULL THEN CAST(:now AS timestamptz) END,
        rejected_at = CASE WHEN r.reason IS NOT NULL THEN CAST(:now AS timestamptz) END,
        rejected_reason = r.reason
    FROM (
        SELECT i.id, x.reason
        FROM unnest(CAST(:ids AS bigint[])) AS i(id)
        LEFT JOIN unnest(CAST(:rejected AS bigint[]), CAST(:reasons AS text[])) AS x(id, reason)
          ON x.id = i.id
    ) r
    WHERE o.id = r.id
    """
)

SELECT_REJECTED_EVENTS = text(
    """
    SELECT o.message_id, t.uid AS tenant, o.event_type, o.rejected_at,
           o.rejected_reason AS reason, o.payload::text AS payload_json
    FROM outbox_events o JOIN tenants t ON t.id = o.tenant_id
    WHERE o.rejected_at IS NOT NULL AND (CAST(:scope AS text) IS NULL OR t.uid = :scope)
    ORDER BY o.id DESC
    LIMIT :limit
    """
)

REQUEUE_REJECTED_EVENT = text(
    """
    UPDATE outbox_events
    SET relayed_at = NULL, rejected_at = NULL, rejected_reason = NULL,
        validate_pending = :validate
    WHERE message_id = :message_id AND rejected_at IS NOT NULL
      AND (CAST(:scope AS text) IS NULL
           OR tenant_id = (SELECT st.id FROM tenants st WHERE st.uid = CAST(:scope AS text)))
    RETURNING id, (SELECT uid FROM tenants WHERE id = tenant_id) AS tenant
    """
)

# The storm-bounded summaries of dead deliveries whose minute is over (migration 0009).
FLUSH_OPERATIONAL_SUMMARIES = text("SELECT outbox_flush_operational_summaries(:now)")

# A test event for one endpoint (`outbox endpoints test`): the event is born relayed, so
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


# -- migrations (outbox/migrate.py) ------------------------------------------------------

# A session-level advisory lock: one `outbox migrate` at a time per database (two deploy
# jobs starting at once). Tried, never waited for inside a transaction: a waiting
# transaction would hold a snapshot that the other run's CONCURRENTLY build waits out.
MIGRATION_LOCK_KEY = 0x6F7574626F78  # "outbox"
TRY_MIGRATION_LOCK = text("SELECT pg_try_advisory_lock(:key)").bindparams(key=MIGRATION_LOCK_KEY)
RELEASE_MIGRATION_LOCK = text("SELECT pg_advisory_unlock(:key)").bindparams(key=MIGRATION_LOCK_KEY)
# Who holds it: a bigint key is stored as classid (high half) and objid (low half).
MIGRATION_LOCK_HOLDER = text(
    """
    SELECT pid FROM pg_locks
    WHERE locktype = 'advisory' AND granted AND objsubid = 1
      AND (classid::bigint << 32) + objid::bigint = :key
    """
).bindparams(key=MIGRATION_LOCK_KEY)
