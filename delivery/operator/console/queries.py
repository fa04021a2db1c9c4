"""Every SQL statement of the console and the portal, named for what it does."""

from __future__ import annotations

from sqlalchemy import text

from outbox.testevents import PING_EVENT_TYPE

# The tenant's internal id is looked up here, so a session names the tenant that exists
# now; a uid that does not exist inserts nothing (the caller says so).
INSERT_SESSION = text(
    """
    INSERT INTO console_sessions (id_hash, kind, actor, role, tenant_uid, tenant_id, token_row,
                                  csrf_token, created_at, expires_at)
    SELECT :id_hash, :kind, :actor, :role, t.uid, t.id, :token_row, :csrf_token, :now,
           :expires_at
    FROM (SELECT 1) one
    LEFT JOIN tenants t ON t.uid = CAST(:tenant_uid AS text)
    WHERE CAST(:tenant_uid AS text) IS NULL OR t.id IS NOT NULL
    RETURNING id_hash
    """
)

# A session is only as good as what opened it: the tenant it was opened for, by internal
# id (deleted: no session, and a new tenant with the same uid is another tenant; disabled:
# no portal), and for the console the token (revoked or expired: no session). Sessions
# from before migration 0022 have neither id and are no session either.
SELECT_SESSION = text(
    """
    SELECT s.kind, s.actor, s.role, t.uid AS tenant_uid, t.name AS tenant_name, s.csrf_token,
           s.expires_at
    FROM console_sessions s
    LEFT JOIN tenants t ON t.id = s.tenant_id
    LEFT JOIN admin_tokens k ON k.id = s.token_row
    WHERE s.id_hash = :id_hash AND s.expires_at > :now
      AND (CASE WHEN s.tenant_uid IS NULL THEN s.tenant_id IS NULL
                ELSE t.uid = s.tenant_uid AND (t.enabled OR s.kind = 'console') END)
      AND (s.kind = 'portal'
           OR (k.revoked_at IS NULL AND k.id IS NOT NULL
               AND (k.expires_at IS NULL OR k.expires_at > :now)))
    """
)

DELETE_SESSION = text("DELETE FROM console_sessions WHERE id_hash = :id_hash")

DELETE_EXPIRED_SESSIONS = text("DELETE FROM console_sessions WHERE expires_at < :now")

INSERT_PORTAL_LINK = text(
    """
    INSERT INTO portal_links (id_hash, tenant_uid, tenant_id, created_by, created_at, expires_at)
    SELECT :id_hash, t.uid, t.id, :actor, :now, :expires_at
    FROM tenants t WHERE t.uid = :tenant_uid AND t.enabled
    RETURNING tenant_uid
    """
)

# Single use: the first redeemer's UPDATE wins; a second finds used_at set. The link opens
# the tenant it was issued for (by internal id), only while that tenant is enabled; links
# from before migration 0022 have no tenant id and open nothing.
REDEEM_PORTAL_LINK = text(
    """
    UPDATE portal_links l SET used_at = :now
    FROM tenants t
    WHERE l.id_hash = :id_hash AND l.used_at IS NULL AND l.expires_at > :now
      AND t.id = l.tenant_id AND t.enabled
    RETURNING t.uid AS tenant_uid
    """
)

# Attempts per bucket by outcome, and attempt latency p50/p99 per bucket, over one chart
# range (charts.py): bounded on both sides so it reads the range by the started_at index,
# never the history. Buckets start on multiples of the bucket from 2000-01-01 UTC, as
# charts.bucket_starts counts them.
_BUCKET = (
    "date_bin(make_interval(secs => :bucket_seconds), a.started_at,"
    " TIMESTAMPTZ '2000-01-01 00:00:00+00')"
)
ATTEMPT_SERIES = text(
    f"""
    SELECT {_BUCKET} AS bucket,
           count(*) FILTER (WHERE a.outcome = 'succeeded') AS succeeded,
           count(*) FILTER (WHERE a.outcome = 'retryable') AS retryable,
           count(*) FILTER (WHERE a.outcome = 'permanent') AS permanent,
           count(*) FILTER (WHERE a.outcome = 'ambiguous') AS ambiguous,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY a.duration_ms) AS p50_ms,
           percentile_cont(0.99) WITHIN GROUP (ORDER BY a.duration_ms) AS p99_ms
    FROM delivery_attempts a
    JOIN deliveries d ON d.id = a.delivery_id
    WHERE a.started_at >= :since AND a.started_at <= :until
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
           h.max_in_flight, h.max_per_second, h.ordered, h.dead_head,
           COALESCE(h.adaptive, false) AS adaptive
    FROM endpoints e
    JOIN tenants t ON t.id = e.tenant_id
    LEFT JOIN endpoint_health h ON h.endpoint_id = e.id
    WHERE e.uid = :uid
    """
)

# Attempts per bucket of one endpoint (its page's charts), bounded like ATTEMPT_SERIES.
ENDPOINT_ATTEMPT_SERIES = text(
    f"""
    SELECT {_BUCKET} AS bucket,
           count(*) FILTER (WHERE a.outcome = 'succeeded') AS succeeded,
           count(*) FILTER (WHERE a.outcome = 'retryable') AS retryable,
           count(*) FILTER (WHERE a.outcome = 'permanent') AS permanent,
           count(*) FILTER (WHERE a.outcome = 'ambiguous') AS ambiguous,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY a.duration_ms) AS p50_ms,
           percentile_cont(0.99) WITHIN GROUP (ORDER BY a.duration_ms) AS p99_ms
    FROM delivery_attempts a
    JOIN deliveries d ON d.id = a.delivery_id
    WHERE a.started_at >= :since AND a.started_at <= :until
      AND d.endpoint_id = (SELECT id FROM endpoints WHERE uid = :uid)
    GROUP BY 1
    ORDER BY 1
    """
)

# What an endpoint's OAuth2 token did lately (its page): the last attempt that went out
# with a bearer token, and the last one that got none (the token endpoint failed). The
# tokens live in each worker's memory; the attempts are what the database knows. Bounded
# by `since` like ENDPOINT_ATTEMPT_SERIES (the attempts' started_at index).
SELECT_ENDPOINT_TOKEN_ACTIVITY = text(
    """
    SELECT used.started_at AS token_used_at, failed.started_at AS token_error_at,
           failed.error AS token_error
    FROM endpoints e
    LEFT JOIN LATERAL (
        SELECT a.started_at FROM delivery_attempts a JOIN deliveries d ON d.id = a.delivery_id
        WHERE d.endpoint_id = e.id AND a.started_at >= :since
          AND a.request_headers ->> 'authorization' IS NOT NULL
        ORDER BY a.started_at DESC LIMIT 1
    ) used ON true
    LEFT JOIN LATERAL (
        SELECT a.started_at, a.error
        FROM delivery_attempts a JOIN deliveries d ON d.id = a.delivery_id
        WHERE d.endpoint_id = e.id AND a.started_at >= :since
          AND starts_with(a.error, :oauth_failure)
        ORDER BY a.started_at DESC LIMIT 1
    ) failed ON true
    WHERE e.uid = :uid
    """
)
