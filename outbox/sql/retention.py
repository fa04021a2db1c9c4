"""Retention (delivery/retention.py): prune finished deliveries, their events and old audit
rows in small batches, and tally what goes so exported totals never go backwards."""

from __future__ import annotations

from sqlalchemy import text

# Tally deleted attempts into pruned_totals (a CTE named `tally`).
# Retention, deleting an endpoint and deleting a tenant all remove attempts; each goes
# through this tally so exported totals never go backwards. Tallies are kept per tenant
# (the delivery's), so a tenant's scoped totals do not either. The statement's
# `gone_attempts` returns (outcome, duration_ms, tenant_id); :buckets are the latency
# histogram's bounds (outbox.schema.LATENCY_BUCKETS).
TALLY_PRUNED_ATTEMPTS = """
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

# A member of a delivery group that keeps the group: a dead letter nobody replayed.
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

# Prune one batch of finished delivery groups, with their attempts (tallied).
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
    ), {TALLY_PRUNED_ATTEMPTS}, gone AS (
        DELETE FROM deliveries d USING doomed WHERE d.id = doomed.id RETURNING d.state
    )
    SELECT (SELECT count(*) FROM gone) AS deliveries,
           (SELECT count(*) FROM gone_attempts) AS attempts,
           (SELECT count(*) FROM tally) AS tallied
    """
)

# Prune relayed events with no delivery and no feed entry left.
# (All pruned, or nobody subscribed.) A pull endpoint's events stay while its feed
# entries do (PRUNE_FEED_ENTRIES), whatever happened to their pushes.
PRUNE_EVENTS = text(
    """
    WITH doomed AS (
        SELECT o.id FROM outbox_events o
        WHERE o.relayed_at IS NOT NULL AND o.relayed_at < :before
          AND NOT EXISTS (SELECT 1 FROM deliveries d WHERE d.event_id = o.id)
          AND NOT EXISTS (SELECT 1 FROM feed_entries f WHERE f.event_id = o.id)
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

# Prune the oldest audit rows, a batch at a time (OUTBOX_AUDIT_RETENTION_DAYS).
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

# Prune feed entries appended before the cutoff, oldest first, and move each feed's mark.
# endpoint_feeds.pruned_through becomes the highest position pruned, so a cursor older
# than it answers 410 (outbox/feeds.py). The feed rows are locked in endpoint order, as
# the relay locks them, so the two never deadlock.
PRUNE_FEED_ENTRIES = text(
    """
    WITH doomed AS (
        SELECT endpoint_id, position FROM feed_entries
        WHERE created_at < :before
        ORDER BY created_at
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    ), gone AS (
        DELETE FROM feed_entries f USING doomed d
        WHERE f.endpoint_id = d.endpoint_id AND f.position = d.position
        RETURNING f.endpoint_id, f.position
    ), tops AS (
        SELECT endpoint_id, max(position) AS top FROM gone GROUP BY endpoint_id
    ), locked AS (
        SELECT e.endpoint_id FROM endpoint_feeds e
        WHERE e.endpoint_id IN (SELECT endpoint_id FROM tops)
        ORDER BY e.endpoint_id
        FOR UPDATE
    ), marked AS (
        UPDATE endpoint_feeds e SET pruned_through = GREATEST(e.pruned_through, t.top)
        FROM tops t JOIN locked l ON l.endpoint_id = t.endpoint_id
        WHERE e.endpoint_id = t.endpoint_id
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM gone) AS entries, (SELECT count(*) FROM marked) AS feeds
    """
)

# Prune the record of events a payload filter could not evaluate, oldest first.
PRUNE_FILTER_SKIPS = text(
    """
    WITH doomed AS (
        SELECT endpoint_id, event_id FROM filter_skips
        WHERE created_at < :before ORDER BY created_at LIMIT :limit
    ), gone AS (
        DELETE FROM filter_skips s USING doomed d
        WHERE s.endpoint_id = d.endpoint_id AND s.event_id = d.event_id
        RETURNING 1
    )
    SELECT count(*) AS skips FROM gone
    """
)
