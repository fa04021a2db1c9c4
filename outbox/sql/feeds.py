"""Catch-up feeds (outbox/feeds.py) and payload filters (outbox/filters.py): the feed
token, the delivery mode, a page of a feed, and the filter's checks in PostgreSQL."""

from __future__ import annotations

from sqlalchemy import text

from outbox.sql.scope import in_scope

# An endpoint's feed settings, in scope.
SELECT_ENDPOINT_FEED = text(
    f"""
    SELECT e.id, e.uid, e.delivery_mode, e.payload_filter, e.feed_token_hash IS NOT NULL
               AS has_feed_token,
           COALESCE(f.last_position, 0) AS last_position,
           COALESCE(f.pruned_through, 0) AS pruned_through,
           (SELECT count(*) FROM filter_skips s WHERE s.endpoint_id = e.id) AS filter_skips
    FROM endpoints e LEFT JOIN endpoint_feeds f ON f.endpoint_id = e.id
    WHERE e.uid = :uid AND {in_scope("e.tenant_id")}
    """
)

# Set an endpoint's delivery mode (push, pull, both), in scope.
SET_DELIVERY_MODE = text(
    f"""
    UPDATE endpoints SET delivery_mode = :mode, updated_at = now()
    WHERE uid = :uid AND {in_scope("tenant_id")}
    RETURNING id
    """
)

# Set or clear an endpoint's payload filter, in scope.
SET_PAYLOAD_FILTER = text(
    f"""
    UPDATE endpoints SET payload_filter = CAST(:filter AS text), updated_at = now()
    WHERE uid = :uid AND {in_scope("tenant_id")}
    RETURNING id
    """
)

# Make sure an endpoint has its feed row (the relay creates it on first append too).
ENSURE_ENDPOINT_FEED = text(
    "INSERT INTO endpoint_feeds (endpoint_id) VALUES (:id) ON CONFLICT (endpoint_id) DO NOTHING"
)

# Store a new feed token's hash (NULL revokes), in scope.
SET_FEED_TOKEN = text(
    f"""
    UPDATE endpoints SET feed_token_hash = :token_hash, updated_at = now()
    WHERE uid = :uid AND {in_scope("tenant_id")}
    RETURNING id
    """
)

# The endpoint a feed token names, with what signing a page needs (never scoped: the
# token is the credential, checked against feed_token_hash by the caller).
SELECT_FEED_OWNER = text(
    """
    SELECT e.id, e.uid, e.feed_token_hash, e.delivery_mode, e.signing_secret,
           e.previous_signing_secret, e.previous_secret_expires_at,
           COALESCE(f.last_position, 0) AS last_position,
           COALESCE(f.pruned_through, 0) AS pruned_through
    FROM endpoints e LEFT JOIN endpoint_feeds f ON f.endpoint_id = e.id
    WHERE e.uid = :uid
    """
)

# One page of a feed: a range scan of the feed_entries primary key (endpoint, position),
# and a primary-key probe per entry for its event. Never touches another endpoint's rows.
SELECT_FEED_PAGE = text(
    """
    SELECT f.position, ev.message_id, ev.event_type, ev.payload::text AS payload_json,
           ev.created_at AS event_created_at
    FROM feed_entries f JOIN outbox_events ev ON ev.id = f.event_id
    WHERE f.endpoint_id = :endpoint_id AND f.position > :after
    ORDER BY f.position
    LIMIT :limit
    """
)

# A filter's canonical form: PostgreSQL parses it (raises on a syntax error).
NORMALIZE_FILTER = text("SELECT CAST(CAST(:filter AS jsonpath) AS text) AS normalized")

# A filter evaluated on an empty object, raising: tells a predicate from a plain path.
PROBE_FILTER = text("SELECT jsonb_path_match_tz('{}'::jsonb, CAST(:filter AS jsonpath))")

# Which of these deliveries belong to a pull-only endpoint (a replay would POST to it).
SELECT_PULL_ONLY_DELIVERIES = text(
    """
    SELECT d.id, e.uid FROM deliveries d JOIN endpoints e ON e.id = d.endpoint_id
    WHERE d.id = ANY(CAST(:ids AS bigint[])) AND e.delivery_mode = 'pull'
    ORDER BY d.id
    """
)
