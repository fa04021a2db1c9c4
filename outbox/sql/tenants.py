"""Tenants (outbox/tenants.py): the owners of endpoints, and the plan setting their scope
needs. Tenant reads are scoped by uid (:scope), not by internal id."""

from __future__ import annotations

from sqlalchemy import text

from outbox.sql.retention import TALLY_PRUNED_ATTEMPTS

# Create a tenant (no row: the uid is taken).
INSERT_TENANT = text(
    """
    INSERT INTO tenants (uid, name, metadata)
    VALUES (:uid, :name, CAST(:metadata AS jsonb))
    ON CONFLICT (uid) DO NOTHING
    RETURNING id
    """
)

# What a tenant shows of itself, with its endpoint count.
_TENANT_COLUMNS = """
    t.id, t.uid, t.name, t.metadata, t.enabled, t.disabled_reason, t.disabled_at,
    t.max_in_flight, t.max_per_second, t.created_at, t.updated_at,
    (SELECT count(*) FROM endpoints e WHERE e.tenant_id = t.id) AS endpoints
"""

# A page of tenants, in scope.
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

# One tenant by uid, in scope.
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

# How many of a tenant's deliveries are in each state.
TENANT_DELIVERY_STATES = text(
    "SELECT state, count(*) AS n FROM deliveries WHERE tenant_id = :id GROUP BY state"
)

# Change what is given of a tenant: name, metadata, caps (the set_ flags clear a cap).
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

# Enable a tenant, or disable it with a reason.
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

# Lock a tenant row for the rest of the transaction (deleting it).
LOCK_TENANT = text("SELECT id FROM tenants WHERE uid = :uid FOR UPDATE")

# Delete a tenant's deliveries and their attempts, tallied first.
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
    ), {TALLY_PRUNED_ATTEMPTS}, events AS (
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

# Delete the tenant row (its endpoints, events, sessions and links cascade).
DELETE_TENANT = text("DELETE FROM tenants WHERE id = :id RETURNING uid")

# Revoke every live token of a tenant.
REVOKE_TENANT_TOKENS = text(
    """
    UPDATE admin_tokens SET revoked_at = :now
    WHERE tenant_uid = :uid AND revoked_at IS NULL
    RETURNING token_id
    """
)

# A tenant's internal id by uid (no row: no such tenant).
TENANT_EXISTS = text("SELECT id FROM tenants WHERE uid = :uid")

# Plan each scoped statement for its tenant, for the rest of the transaction
# (outbox.tenants.scope_params says why).
FORCE_CUSTOM_PLANS = text("SET LOCAL plan_cache_mode = force_custom_plan")

# How many tenants are enabled and disabled, for /metrics.
METRICS_TENANTS = text("SELECT enabled, count(*) AS n FROM tenants GROUP BY enabled")
