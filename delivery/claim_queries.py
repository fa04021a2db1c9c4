"""The claim and its gates: the worker's claim statements (delivery/worker/claiming.py).

Kept apart from delivery/queries.py, which re-exports them, because they share
fragments: the endpoints with due work (LOCK_CLAIM_GATES, CLAIM_FOLDED) and the claim
itself (CLAIM_DUE_DELIVERIES, CLAIM_FOLDED).
"""

from __future__ import annotations

from sqlalchemy import text

from outbox.sql.relay import HEALTH_GATED, claimed_columns


def _claim(endpoints: str, per_endpoint: str) -> str:
    """The claim's CTEs, `gate` to `due` (the rows to claim, locked): it visits the
    endpoints of `endpoints` (a FROM item naming `live(endpoint_id)`) and takes at most
    `per_endpoint` (an SQL expression) rows of each."""
    return f"""
    gate AS (
        SELECT * FROM unnest(CAST(:gate_ids AS bigint[]), CAST(:gate_budgets AS int[]))
            AS g(endpoint_id, budget)
    ), tenant_gate AS (
        SELECT * FROM unnest(CAST(:tenant_gate_ids AS bigint[]),
                             CAST(:tenant_gate_budgets AS int[]))
            AS g(tenant_id, budget)
    ), candidates AS (
        SELECT c.id, c.tenant_id, c.priority, c.next_attempt_at,
               row_number() OVER (
                   PARTITION BY c.endpoint_id, c.priority ORDER BY c.next_attempt_at, c.id
               ) AS turn
        -- Only the endpoints with scheduled work (LOCK_CLAIM_GATES found them), never
        -- every endpoint: the claim's cost follows the due work.
        -- (LATERAL ... LIMIT 1: one primary-key probe per endpoint, never a scan)
        FROM {endpoints}
        CROSS JOIN LATERAL (
            SELECT x.id, x.enabled, x.all_tenants FROM endpoints x
            WHERE x.id = live.endpoint_id LIMIT 1
        ) e
        LEFT JOIN gate g ON g.endpoint_id = e.id
        LEFT JOIN LATERAL (
            SELECT x.ordered, x.dead_head FROM endpoint_health x WHERE x.endpoint_id = e.id
            LIMIT 1
        ) h ON true
        CROSS JOIN LATERAL (
            SELECT d.id, d.endpoint_id, d.tenant_id, d.priority, d.next_attempt_at
            FROM deliveries d
            WHERE d.endpoint_id = e.id AND d.state = 'scheduled' AND d.next_attempt_at <= :now
              AND (d.ordering_key IS NULL OR h.ordered IS NOT TRUE OR NOT EXISTS (
                  SELECT 1 FROM deliveries p
                  WHERE p.endpoint_id = d.endpoint_id AND p.ordering_key = d.ordering_key
                    AND p.id <> d.id
                    -- an all-tenants endpoint orders each tenant's keys apart
                    AND (NOT e.all_tenants
                         OR (SELECT t.tenant_id FROM outbox_events t WHERE t.id = p.event_id)
                          = (SELECT t.tenant_id FROM outbox_events t WHERE t.id = d.event_id))
                    AND (p.state = 'in_flight'
                         OR (p.event_id < d.event_id AND p.state = 'scheduled')
                         -- a held delivery holds its key until an operator acts
                         OR (p.event_id < d.event_id AND p.state = 'held')
                         OR (p.event_id < d.event_id AND p.state = 'dead'
                             AND h.dead_head = 'block'
                             AND NOT EXISTS (
                                 SELECT 1 FROM deliveries r WHERE r.replay_of = p.id)))
              ) AND NOT EXISTS (
                  -- an earlier event of the key not fanned out yet (several relays);
                  -- ordering keys are the application's, scoped to the event's tenant
                  SELECT 1 FROM outbox_events o
                  WHERE o.ordering_key = d.ordering_key AND o.relayed_at IS NULL
                    AND o.id < d.event_id
                    AND o.tenant_id = (SELECT t.tenant_id FROM outbox_events t
                                       WHERE t.id = d.event_id)
              ))
            ORDER BY d.priority DESC, d.next_attempt_at, d.id
            -- the per-endpoint share is about twice this endpoint's fair share of the batch, so
            -- a thousand busy endpoints lock a few rows each, not a batch each.
            LIMIT LEAST(COALESCE(g.budget, :limit), :limit, {per_endpoint})
            -- Rows another claimer holds are skipped here, not only at the end: otherwise
            -- concurrent claimers on one endpoint all see the same head rows and all but
            -- one come back empty. Locks on candidates not picked end with this statement's
            -- transaction, a few milliseconds later.
            FOR UPDATE OF d SKIP LOCKED
        ) c
        WHERE e.enabled AND COALESCE(g.budget, :limit) > 0
    ), ranked AS (
        -- Round robin across tenants first, then across each tenant's endpoints: a tenant
        -- with a flood on many endpoints still gets one turn per round, like any other.
        SELECT c.*,
               row_number() OVER (
                   PARTITION BY c.tenant_id, c.priority ORDER BY c.turn, c.next_attempt_at, c.id
               ) AS tenant_turn,
               row_number() OVER (
                   PARTITION BY c.tenant_id
                   ORDER BY c.priority DESC, c.turn, c.next_attempt_at, c.id
               ) AS tenant_rank
        FROM candidates c
    ), picked AS (
        SELECT r.id, r.priority, r.tenant_turn, r.turn, r.next_attempt_at
        FROM ranked r LEFT JOIN tenant_gate t ON t.tenant_id = r.tenant_id
        -- a capped tenant's budget (max in flight, max per second) for this claim
        WHERE t.budget IS NULL OR r.tenant_rank <= t.budget
        ORDER BY r.priority DESC, r.tenant_turn, r.turn, r.next_attempt_at, r.id
        LIMIT 2 * :limit
    ), due AS (
        SELECT d.id
        FROM deliveries d JOIN picked p ON p.id = d.id
        WHERE d.state = 'scheduled'
        ORDER BY p.priority DESC, p.tenant_turn, p.turn, p.next_attempt_at, p.id
        LIMIT :limit
        FOR UPDATE OF d SKIP LOCKED
    )
    """


# Lease the rows of `due` (_claim) to :worker_id, bump their claim number, and return
# what the worker needs of each (outbox.sql.relay.claimed_columns).
_CLAIM_DUE = f"""
    UPDATE deliveries d
    SET state = 'in_flight', locked_by = :worker_id, lease_expires_at = :lease_expires_at,
        updated_at = :now, claims = d.claims + 1
    FROM due, outbox_events ev, endpoints e LEFT JOIN endpoint_health h ON h.endpoint_id = e.id
    WHERE d.id = due.id AND ev.id = d.event_id AND e.id = d.endpoint_id
      AND d.state = 'scheduled'
    RETURNING {claimed_columns("d")}
"""


# Claim due deliveries of enabled endpoints and lease them; the claim commits before
# any HTTP request starts. It starts from :endpoint_ids, at most :limit endpoints with
# due work chosen from their heads (LOCK_CLAIM_GATES, health.choose_endpoints), so idle
# endpoints cost nothing, a thousand busy ones cost a batch's worth, and a disabled
# tenant's deliveries wait. delivery/health/ passes a budget for each gated
# endpoint (breaker open or half-open, limits, ramp, 429 pause) and each capped tenant;
# the others are unlimited.
#   fairness: each endpoint offers at most its budget (LATERAL, on its own index), rows
#     are taken round-robin across tenants (`tenant_turn`), and within a tenant across
#     its endpoints (`turn`), within a priority: a tenant's flood delays another
#     tenant's first due delivery by at most one batch;
#   priority: higher first across all endpoints, so a low-priority flood delays due
#     high-priority work by at most the batch already claimed;
#   ordering (endpoints with `ordered`): only the head of each ordering key is offered:
#     nothing of that key in flight, nothing earlier scheduled or held, and in 'block' mode no
#     earlier dead delivery that was neither replayed nor discarded; and no earlier
#     event of the key still waiting for the relay.
# Candidates are over-picked (2 * limit) and locked with SKIP LOCKED, so two workers
# claiming at once both get a full batch.
# (The f-string inserts outbox.sql.relay.claimed_columns, a constant fragment, never input.)
CLAIM_DUE_DELIVERIES = text(
    f"""
    WITH {_claim("unnest(CAST(:endpoint_ids AS bigint[])) AS live(endpoint_id)", ":per_endpoint")}
    {_CLAIM_DUE}
    """
)

# The endpoints with a due delivery, each enabled and of an enabled tenant, with its head
# (first due row in claim order): CTEs `pending`, `heads_due` and `live`.
_DUE_HEADS = """
    pending AS (
        -- the first row of each endpoint in index order is its head: highest priority,
        -- earliest, lowest id (claim order); the recursion jumps from one endpoint to the next
        (SELECT endpoint_id, priority, next_attempt_at, id FROM deliveries
         WHERE state = 'scheduled'
         ORDER BY endpoint_id, priority DESC, next_attempt_at, id LIMIT 1)
        UNION ALL
        SELECT n.*
        FROM pending p
        CROSS JOIN LATERAL (
            SELECT d.endpoint_id, d.priority, d.next_attempt_at, d.id FROM deliveries d
            WHERE d.state = 'scheduled' AND d.endpoint_id > p.endpoint_id
            ORDER BY d.endpoint_id, d.priority DESC, d.next_attempt_at, d.id LIMIT 1
        ) n
    ), heads_due AS (
        -- each endpoint's first due row; a second probe only where the head is not due
        SELECT p.endpoint_id, h.priority, h.next_attempt_at, h.id
        FROM pending p
        CROSS JOIN LATERAL (
            SELECT p.priority, p.next_attempt_at, p.id WHERE p.next_attempt_at <= :now
            UNION ALL
            (SELECT d.priority, d.next_attempt_at, d.id FROM deliveries d
             WHERE p.next_attempt_at > :now AND d.endpoint_id = p.endpoint_id
               AND d.state = 'scheduled' AND d.next_attempt_at <= :now
             ORDER BY d.priority DESC, d.next_attempt_at, d.id LIMIT 1)
        ) h
    ), live AS (
        -- LATERAL ... LIMIT 1: primary-key probes for these endpoints only
        SELECT e.id AS endpoint_id, e.tenant_id, t.max_in_flight AS tenant_max_in_flight,
               t.max_per_second AS tenant_max_per_second,
               (t.max_in_flight IS NOT NULL OR t.max_per_second IS NOT NULL) AS tenant_capped,
               p.priority AS head_priority, p.next_attempt_at AS head_due_at, p.id AS head_id
        FROM heads_due p
        CROSS JOIN LATERAL (
            SELECT x.id, x.tenant_id FROM endpoints x
            WHERE x.id = p.endpoint_id AND x.enabled LIMIT 1
        ) e
        CROSS JOIN LATERAL (
            SELECT x.max_in_flight, x.max_per_second FROM tenants x
            WHERE x.id = e.tenant_id AND x.enabled LIMIT 1
        ) t
    )
"""

# Everything a claim needs to know before it claims, visiting only endpoints that have
# scheduled work: a skip scan of ix_deliveries_due_per_endpoint_ranked finds them (one index
# probe per such endpoint; idle endpoints are never read). One row per such endpoint
# that has a due delivery, is enabled and whose tenant is enabled (a disabled tenant's
# deliveries wait), with its head (first due row in claim order): delivery/health/
# chooses from these heads the endpoints the claim will visit (at most one per slot).
# The health rows of gated endpoints and the rows of capped tenants are locked with
# SKIP LOCKED: `locked` / `tenant_locked` is false when another worker holds one, and
# that endpoint or tenant is skipped by this claim. Tenant rows are locked FOR NO KEY
# UPDATE, which does not conflict with the key-share locks of foreign-key checks (the
# relay inserting deliveries) and serialises claimers on the tenant's bucket.
LOCK_CLAIM_GATES = text(
    f"""
    WITH RECURSIVE {_DUE_HEADS}, needed AS (
        SELECT l.endpoint_id
        FROM live l
        CROSS JOIN LATERAL (
            SELECT 1 FROM endpoint_health h
            WHERE h.endpoint_id = l.endpoint_id
              AND {HEALTH_GATED}
            LIMIT 1
        ) h
    ), locked AS (
        SELECT h.*
        FROM endpoint_health h
        WHERE h.endpoint_id = ANY(ARRAY(SELECT endpoint_id FROM needed))
        ORDER BY h.endpoint_id
        FOR UPDATE SKIP LOCKED
    ), tenant_locked AS (
        SELECT t.id
        FROM tenants t
        WHERE t.id = ANY(ARRAY(SELECT tenant_id FROM live WHERE tenant_capped))
        ORDER BY t.id
        FOR NO KEY UPDATE SKIP LOCKED
    )
    SELECT l.endpoint_id, l.tenant_id, n.endpoint_id IS NOT NULL AS gated,
           h.endpoint_id IS NOT NULL AS locked,
           l.tenant_capped, tl.id IS NOT NULL AS tenant_locked,
           l.tenant_max_in_flight, l.tenant_max_per_second,
           l.head_priority, l.head_due_at, l.head_id,
           b.tokens AS tenant_tokens, b.tokens_at AS tenant_tokens_at
    FROM live l
    LEFT JOIN needed n ON n.endpoint_id = l.endpoint_id
    LEFT JOIN (SELECT endpoint_id FROM locked) h ON h.endpoint_id = l.endpoint_id
    LEFT JOIN tenant_locked tl ON tl.id = l.tenant_id
    LEFT JOIN LATERAL (
        SELECT x.tokens, x.tokens_at FROM tenant_buckets x WHERE x.tenant_id = tl.id LIMIT 1
    ) b ON true
    ORDER BY l.endpoint_id
    """
)

# The gates folded into the claim: one statement, committing by itself, for the common
# case where the gates have nothing to say. It finds the endpoints with due work as
# LOCK_CLAIM_GATES does (`live`) and claims from all of them at once, as
# CLAIM_DUE_DELIVERIES would after health.choose_endpoints, but only when the claim is
# `plain`: no such endpoint has a health gate (HEALTH_GATED), no such tenant has a cap,
# and at most :limit of them have a slot left here (:gate_ids / :gate_budgets: this
# worker's slots per endpoint, nothing else). Then choose_endpoints would visit every
# one of them (their order only matters when some are left out), `more` is false and
# no gate row needs a lock or a write, so the claim is this one statement: no gate
# statement before it, no gate write after it, and its transaction's BEGIN goes out
# with it (outbox.direct, generic_plans: two round trips, not four). Otherwise it
# claims nothing and says so (`gates_plain` false), and the worker claims through the
# gates (health.open_gates).
# One row per claimed delivery (the claim's columns), each with `gates_plain`,
# `gates_spread` (tenants with due work) and `gates_barren` (endpoints visited that had
# nothing claimable: per-key ordering held every due row); one row with NULL claim
# columns when nothing was claimed.
CLAIM_FOLDED = text(
    f"""
    WITH RECURSIVE {_DUE_HEADS}, open_heads AS (
        SELECT l.endpoint_id, l.tenant_id,
               l.tenant_capped OR COALESCE((
                   SELECT {HEALTH_GATED} FROM endpoint_health h
                   WHERE h.endpoint_id = l.endpoint_id LIMIT 1), false) AS gated,
               COALESCE(s.budget, :limit) > 0 AS open
        FROM live l
        LEFT JOIN unnest(CAST(:gate_ids AS bigint[]), CAST(:gate_budgets AS int[]))
            AS s(endpoint_id, budget) ON s.endpoint_id = l.endpoint_id
    ), verdict AS (
        SELECT NOT COALESCE(bool_or(o.gated), false)
                   AND count(*) FILTER (WHERE o.open) <= :limit AS plain,
               count(DISTINCT o.tenant_id) AS spread,
               -- Gates.params' per-endpoint share: twice the batch over the endpoints
               ceil(2.0 * :limit / GREATEST(1, count(*) FILTER (WHERE o.open)))::int
                   AS per_endpoint
        FROM open_heads o
    ), chosen AS (
        SELECT o.endpoint_id FROM open_heads o, verdict v WHERE v.plain AND o.open
    ), {_claim("chosen live", "(SELECT v.per_endpoint FROM verdict v)")}, claimed AS (
        {_CLAIM_DUE}
    )
    SELECT v.plain AS gates_plain, v.spread AS gates_spread,
           ARRAY(SELECT endpoint_id FROM chosen
                 EXCEPT SELECT endpoint_id FROM claimed) AS gates_barren,
           c.*
    FROM verdict v LEFT JOIN claimed c ON true
    """
)
