"""Every SQL statement of the console and the portal, named for what it does."""

from __future__ import annotations

from sqlalchemy import text

from outbox.testevents import PING_EVENT_TYPE

INSERT_SESSION = text(
    """
    INSERT INTO console_sessions (id_hash, kind, actor, role, tenant_uid, csrf_token,
                                  created_at, expires_at)
    VALUES (:id_hash, :kind, :actor, :role, :tenant_uid, :csrf_token, :now, :expires_at)
    """
)

# A session whose tenant was deleted (or disabled, for the portal) is no session at all.
SELECT_SESSION = text(
    """
    SELECT s.kind, s.actor, s.role, s.tenant_uid, s.csrf_token, s.expires_at
    FROM console_sessions s
    WHERE s.id_hash = :id_hash AND s.expires_at > :now
      AND (s.tenant_uid IS NULL OR EXISTS (
          SELECT 1 FROM tenants t
          WHERE t.uid = s.tenant_uid AND (t.enabled OR s.kind = 'console')))
    """
)

DELETE_SESSION = text("DELETE FROM console_sessions WHERE id_hash = :id_hash")

DELETE_EXPIRED_SESSIONS = text("DELETE FROM console_sessions WHERE expires_at < :now")

INSERT_PORTAL_LINK = text(
    """
    INSERT INTO portal_links (id_hash, tenant_uid, created_by, created_at, expires_at)
    SELECT :id_hash, t.uid, :actor, :now, :expires_at
    FROM tenants t WHERE t.uid = :tenant_uid AND t.enabled
    RETURNING tenant_uid
    """
)

# Single use: the first redeemer's UPDATE wins; a second finds used_at set.
REDEEM_PORTAL_LINK = text(
    """
    UPDATE portal_links SET used_at = :now
    WHERE id_hash = :id_hash AND used_at IS NULL AND expires_at > :now
    RETURNING tenant_uid
    """
)

# Deliveries per minute by outcome, and attempt latency p50/p99 per minute, over a window.
ATTEMPT_SERIES = text(
    """
    SELECT date_trunc('minute', a.started_at) AS minute,
           count(*) FILTER (WHERE a.outcome = 'succeeded') AS succeeded,
           count(*) FILTER (WHERE a.outcome = 'retryable') AS retryable,
           count(*) FILTER (WHERE a.outcome = 'permanent') AS permanent,
           count(*) FILTER (WHERE a.outcome = 'ambiguous') AS ambiguous,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY a.duration_ms) AS p50_ms,
           percentile_cont(0.99) WITHIN GROUP (ORDER BY a.duration_ms) AS p99_ms
    FROM delivery_attempts a
    JOIN deliveries d ON d.id = a.delivery_id
    WHERE a.started_at >= :since
      AND (CAST(:tenant_uid AS text) IS NULL
           OR d.tenant_id = (SELECT id FROM tenants WHERE uid = :tenant_uid))
    GROUP BY 1
    ORDER BY 1
    """
)

SELECT_TENANTS_OVERVIEW = text(
    """
    SELECT t.uid, t.name, t.enabled, t.disabled_reason,
           (SELECT count(*) FROM endpoints e WHERE e.tenant_id = t.id) AS endpoints,
           (SELECT count(*) FROM deliveries d
            WHERE d.tenant_id = t.id AND d.state IN ('scheduled', 'in_flight')) AS pending,
           (SELECT count(*) FROM deliveries d
            WHERE d.tenant_id = t.id AND d.state = 'dead') AS dead
    FROM tenants t
    WHERE (CAST(:tenant_uid AS text) IS NULL OR t.uid = :tenant_uid)
    ORDER BY t.uid
    LIMIT :limit
    """
)


# --- the console's own reads ---------------------------------------------------------------
# Searches, lookups and actions are outbox's own (tenant scope included); these add what
# the pages need beyond them.
_TENANT_ID = "(SELECT st.id FROM tenants st WHERE st.uid = CAST(:tenant_uid AS text))"

# Event types a tenant can subscribe to: the catalogue's active types (outbox event-types),
# those of its latest deliveries (its own index) and those published for it among the
# latest events of all. Every read is bounded, so the page costs the same however long
# the history is and however small the tenant. The test ping is not a subscription.
SELECT_TENANT_EVENT_TYPES = text(
    f"""
    SELECT event_type FROM (
        SELECT ev.event_type
        FROM (SELECT event_id FROM deliveries WHERE tenant_id = {_TENANT_ID}
              ORDER BY id DESC LIMIT 5000) d
        JOIN outbox_events ev ON ev.id = d.event_id
        UNION
        SELECT recent.event_type
        FROM (SELECT tenant_id, event_type FROM outbox_events ORDER BY id DESC LIMIT 5000) recent
        WHERE recent.tenant_id = {_TENANT_ID}
        UNION
        (SELECT name FROM event_types WHERE status = 'active' ORDER BY name LIMIT 200)
    ) types
    WHERE event_type <> '{PING_EVENT_TYPE}'
    ORDER BY event_type
    LIMIT 200
    """
)

# One endpoint's configuration beyond the basics: limits, retry policy, rules, health.
SELECT_ENDPOINT_SETTINGS = text(
    """
    SELECT e.timeout_seconds, e.max_attempts, e.retry_schedule, e.status_overrides,
           e.all_tenants, t.uid AS tenant_uid, e.previous_secret_expires_at,
           h.max_in_flight, h.max_per_second, h.ordered, h.dead_head
    FROM endpoints e
    JOIN tenants t ON t.id = e.tenant_id
    LEFT JOIN endpoint_health h ON h.endpoint_id = e.id
    WHERE e.uid = :uid
    """
)

# Attempts per minute of one endpoint (its page's charts).
ENDPOINT_ATTEMPT_SERIES = text(
    """
    SELECT date_trunc('minute', a.started_at) AS minute,
           count(*) FILTER (WHERE a.outcome = 'succeeded') AS succeeded,
           count(*) FILTER (WHERE a.outcome = 'retryable') AS retryable,
           count(*) FILTER (WHERE a.outcome = 'permanent') AS permanent,
           count(*) FILTER (WHERE a.outcome = 'ambiguous') AS ambiguous,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY a.duration_ms) AS p50_ms,
           percentile_cont(0.99) WITHIN GROUP (ORDER BY a.duration_ms) AS p99_ms
    FROM delivery_attempts a
    JOIN deliveries d ON d.id = a.delivery_id
    WHERE a.started_at >= :since AND d.endpoint_id = (SELECT id FROM endpoints WHERE uid = :uid)
    GROUP BY 1
    ORDER BY 1
    """
)
