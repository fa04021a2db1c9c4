"""The event-type catalogue (outbox/catalogue.py): types, their schema versions, and the
relay's check of events published through SQL (validated, rejected, requeued)."""

from __future__ import annotations

from sqlalchemy import text

# One type as publish() caches it.
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

# What a type shows of itself, with its current version's schema and example.
_EVENT_TYPE_COLUMNS = """
    SELECT t.name, t.description, t.status, t.current_version, v.schema, v.example,
           t.created_at, t.updated_at
    FROM event_types t
    JOIN event_type_versions v ON v.event_type_id = t.id AND v.version = t.current_version
"""

# One type by name.
SELECT_EVENT_TYPE = text(_EVENT_TYPE_COLUMNS + " WHERE t.name = :name")

# Every type, by name.
SELECT_EVENT_TYPES = text(_EVENT_TYPE_COLUMNS + " ORDER BY t.name")

# A type's versions, oldest first.
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

# Create a type (no row: the name is taken).
INSERT_EVENT_TYPE = text(
    """
    INSERT INTO event_types (name, description) VALUES (:name, :description)
    ON CONFLICT (name) DO NOTHING
    RETURNING id
    """
)

# Add a schema version to a type.
INSERT_EVENT_TYPE_VERSION = text(
    """
    INSERT INTO event_type_versions (event_type_id, version, schema, example)
    VALUES (:id, :version, CAST(:schema AS jsonb), CAST(:example AS jsonb))
    """
)

# Lock a type row while it changes, so two changes draw distinct versions.
LOCK_EVENT_TYPE = text("SELECT id FROM event_types WHERE name = :name FOR UPDATE")

# Replace one version's example payload.
SET_EVENT_TYPE_EXAMPLE = text(
    """
    UPDATE event_type_versions SET example = CAST(:example AS jsonb)
    WHERE event_type_id = (SELECT id FROM event_types WHERE name = :name)
      AND version = :version
    """
)

# Change a type's current version, description or status.
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

# Claim a batch of events to validate: events written by outbox_publish() wait for the
# relay's schema check first.
CLAIM_EVENTS_TO_VALIDATE = text(
    """
    SELECT id, event_type, payload::text AS payload_json FROM outbox_events
    WHERE relayed_at IS NULL AND validate_pending
    ORDER BY id
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
    """
)

# Record a validation pass: valid events go on to the relay; rejected ones leave the
# queue with their reason.
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

# Rejected events, newest first, scoped by tenant uid.
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

# Put one rejected event back before the relay, validated again or not.
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
