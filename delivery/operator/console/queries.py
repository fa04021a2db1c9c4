"""Every SQL statement of the console and the portal, named for what it does."""

from __future__ import annotations

from sqlalchemy import text

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

SELECT_TOKEN_TENANT = text("SELECT tenant_uid FROM admin_tokens WHERE id = :id")
