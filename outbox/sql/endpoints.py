"""Endpoints (outbox/endpoints.py, with their delivery rules in outbox/endpoint_rules.py
and custom headers in outbox/headers.py): where events go and the secrets that sign them.
Operator statements keep to the caller's tenant (outbox/sql/scope.py)."""

from __future__ import annotations

from sqlalchemy import text

from outbox.sql.retention import TALLY_PRUNED_ATTEMPTS
from outbox.sql.scope import in_scope

# Create an endpoint of a tenant given by uid (no row: the tenant does not exist). An
# :adaptive one gets its health row at once, adaptive without a maximum of its own (the
# worker's OUTBOX_ADAPTIVE_DEFAULT_MAX is its ceiling); a fixed one gets none, as before
# adaptive became the default. Existing endpoints are never touched: the column's
# default stays false, because health rows are also created later for old endpoints.
INSERT_ENDPOINT = text(
    """
    WITH inserted AS (
        INSERT INTO endpoints
            (uid, tenant_id, all_tenants, url, description, event_types, signing_secret,
             signature_scheme, signing_public_key, delivery_mode, payload_filter,
             feed_token_hash)
        SELECT :uid, t.id, :all_tenants, :url, :description, :event_types, :signing_secret,
               :signature_scheme, :public_key, :delivery_mode, CAST(:payload_filter AS text),
               CAST(:feed_token_hash AS text)
        FROM tenants t WHERE t.uid = :tenant
        RETURNING id
    ), health AS (
        INSERT INTO endpoint_health (endpoint_id, adaptive)
        SELECT id, true FROM inserted WHERE CAST(:adaptive AS boolean)
        RETURNING endpoint_id
    )
    SELECT id FROM inserted
    """
)

# What an endpoint shows of itself (never its secrets).
_ENDPOINT_COLUMNS = """
    e.id, e.uid, t.uid AS tenant, e.all_tenants, e.url, e.description, e.event_types,
    e.enabled, e.disabled_reason, e.disabled_at, e.created_at, e.signature_scheme,
    e.signing_public_key AS public_key, e.proxy_host AS proxy, e.delivery_mode,
    e.payload_filter,
    (SELECT count(*) FROM filter_skips s WHERE s.endpoint_id = e.id) AS filter_skips,
    COALESCE(e.on_ambiguous, 'retry') AS on_ambiguous, e.owner, e.operational_owner
"""

# Every endpoint in scope, oldest first.
SELECT_ENDPOINTS = text(
    f"""
    SELECT {_ENDPOINT_COLUMNS}
    FROM endpoints e JOIN tenants t ON t.id = e.tenant_id
    WHERE {in_scope("e.tenant_id")}
    ORDER BY e.id
    """
)

# One endpoint by its uid, in scope.
SELECT_ENDPOINT_BY_UID = text(
    f"""
    SELECT {_ENDPOINT_COLUMNS}
    FROM endpoints e JOIN tenants t ON t.id = e.tenant_id
    WHERE e.uid = :uid AND {in_scope("e.tenant_id")}
    """
)

# What an endpoint's failures do and whose they are (migration 0031): each column changes
# only when its :set_ flag says so; NULL clears an owner.
SET_ENDPOINT_FAILURE_POLICY = text(
    f"""
    UPDATE endpoints e
    SET on_ambiguous = CASE WHEN :set_on_ambiguous THEN CAST(:on_ambiguous AS text)
                            ELSE e.on_ambiguous END,
        owner = CASE WHEN :set_owner THEN CAST(:owner AS text) ELSE e.owner END,
        operational_owner = CASE WHEN :set_operational_owner
                                 THEN CAST(:operational_owner AS text)
                                 ELSE e.operational_owner END,
        updated_at = now()
    WHERE e.uid = :uid AND {in_scope("e.tenant_id")}
    RETURNING e.uid
    """
)

# Enable an endpoint, or disable it with a reason.
SET_ENDPOINT_ENABLED = text(
    f"""
    UPDATE endpoints
    SET enabled = :enabled,
        disabled_reason = CASE WHEN :enabled THEN NULL ELSE CAST(:reason AS text) END,
        disabled_at = CASE WHEN :enabled THEN NULL ELSE now() END,
        updated_at = now()
    WHERE uid = :uid AND {in_scope("tenant_id")}
    RETURNING id
    """
)

# An endpoint's own delivery rules (NULL means "use the global default").
SELECT_ENDPOINT_DELIVERY_RULES = text(
    """
    SELECT timeout_seconds, max_attempts, retry_schedule, status_overrides
    FROM endpoints WHERE uid = :uid
    """
)

# Replace an endpoint's delivery rules.
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

# Change what is given of an endpoint (NULL: keep; the set_ flags tell "clear" from "keep").
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
    WHERE uid = :uid AND {in_scope("tenant_id")}
    RETURNING id
    """
)

# Install a new signing secret and keep the old one signing until the grace ends.
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
    WHERE uid = :uid AND {in_scope("tenant_id")}
    RETURNING id
    """
)

# An endpoint's pending and total deliveries (what deleting it would remove).
COUNT_ENDPOINT_DELIVERIES = text(
    f"""
    SELECT count(*) FILTER (WHERE d.state IN ('scheduled', 'in_flight')) AS pending,
           count(*) AS total
    FROM deliveries d JOIN endpoints e ON e.id = d.endpoint_id
    WHERE e.uid = :uid AND {in_scope("e.tenant_id")}
    """
)

# Delete an endpoint with its history (ON DELETE CASCADE); its attempts go through the
# same tally as retention, so exported totals never go backwards.
DELETE_ENDPOINT = text(
    f"""
    WITH target AS (
        SELECT id FROM endpoints WHERE uid = :uid AND {in_scope("tenant_id")} FOR UPDATE
    ), gone_attempts AS (
        DELETE FROM delivery_attempts a USING deliveries d, target t
        WHERE a.delivery_id = d.id AND d.endpoint_id = t.id
        RETURNING a.outcome, a.duration_ms, d.tenant_id
    ), {TALLY_PRUNED_ATTEMPTS}, gone AS (
        DELETE FROM endpoints e USING target t WHERE e.id = t.id RETURNING e.id
    )
    SELECT (SELECT count(*) FROM gone) AS endpoints,
           (SELECT count(*) FROM gone_attempts) AS attempts,
           (SELECT count(*) FROM tally) AS tallied
    """
)

# Every stored secret, encrypted (the key check at start, `outbox keys rotate`).
SELECT_STORED_SECRETS = text(
    """
    SELECT id, uid, signing_secret, previous_signing_secret, custom_headers, proxy_url,
           client_certificate, oauth_client
    FROM endpoints ORDER BY id
    """
)

# One endpoint's encrypted signing secret, in scope (revealing it to a person).
SELECT_ENDPOINT_SECRET = text(
    f"SELECT uid, signing_secret FROM endpoints WHERE uid = :uid AND {in_scope('tenant_id')}"
)

# Store an endpoint's secrets re-encrypted under the current key.
SET_ENDPOINT_SECRETS = text(
    """
    UPDATE endpoints
    SET signing_secret = :signing_secret, previous_signing_secret = :previous_signing_secret,
        custom_headers = :custom_headers, proxy_url = :proxy_url,
        client_certificate = :client_certificate, oauth_client = :oauth_client,
        updated_at = now()
    WHERE id = :id
    """
)

# Reset an endpoint's health when an operator enables it.
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

# Set an endpoint's own egress proxy (outbox/endpoints.py, set_proxy); in the caller's scope.
SET_ENDPOINT_PROXY = text(
    f"""
    UPDATE endpoints SET proxy_url = :proxy_url, proxy_host = :proxy_host, updated_at = now()
    WHERE uid = :uid AND {in_scope("tenant_id")}
    RETURNING id
    """
)

# An endpoint's custom headers, encrypted.
SELECT_ENDPOINT_HEADERS = text("SELECT custom_headers FROM endpoints WHERE uid = :uid")

# Replace an endpoint's custom headers.
SET_ENDPOINT_HEADERS = text(
    """
    UPDATE endpoints SET custom_headers = :custom_headers, updated_at = now()
    WHERE uid = :uid
    RETURNING id
    """
)

# Set an endpoint's client certificate (mutual TLS) and OAuth2 client credentials, both
# encrypted, with their display summaries (outbox/endpoint_auth.py); in the caller's scope.
SET_ENDPOINT_CLIENT_AUTH = text(
    f"""
    UPDATE endpoints
    SET client_certificate = :client_certificate,
        client_certificate_info = :client_certificate_info,
        oauth_client = :oauth_client, oauth_client_info = :oauth_client_info,
        updated_at = now()
    WHERE uid = :uid AND {in_scope("tenant_id")}
    RETURNING id
    """
)

# An endpoint's authenticated-delivery settings as stored, in the caller's scope.
SELECT_ENDPOINT_CLIENT_AUTH = text(
    f"""
    SELECT uid, url, client_certificate, client_certificate_info, oauth_client,
           oauth_client_info
    FROM endpoints WHERE uid = :uid AND {in_scope("tenant_id")}
    """
)
