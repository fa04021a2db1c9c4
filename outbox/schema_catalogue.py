"""Tables of the event-type catalogue: which events exist and the versioned schema of each."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    Float,
    ForeignKey,
    Identity,
    Integer,
    Table,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB

from outbox.schema_base import OWNER_FORMAT, _now_column, metadata

# The event-type catalogue (migration 0009): which events exist and what is in them.
# A type's schema is versioned: `update` adds a version, older ones stay readable.
# `revision` changes with every change (new version, deprecate, archive), so publish()
# can check in its own INSERT that the schema it validated against is still current.
EVENT_TYPE_STATUSES = ("active", "deprecated", "archived")

event_types = Table(
    "event_types",
    metadata,
    Column("id", BigInteger, Identity(always=False), primary_key=True),
    Column("name", Text, nullable=False, unique=True),
    Column("description", Text, nullable=False, server_default=text("''")),
    Column("status", Text, nullable=False, server_default=text("'active'")),
    Column("current_version", Integer, nullable=False, server_default=text("1")),
    # A fresh random token on every change (not a counter): a cached entry can never be
    # mistaken for another database's catalogue that happens to have the same count.
    Column("revision", Text, nullable=False, server_default=text("(gen_random_uuid())::text")),
    # Migration 0031: what an ambiguous outcome does, the owning team, and the thresholds
    # of this workflow's alert signals (NULL: no per-type signal).
    Column("on_ambiguous", Text),
    Column("owner", Text),
    Column("alert_oldest_seconds", Float),
    Column("alert_error_rate", Float),
    Column("alert_processing_p95_seconds", Float),
    _now_column("created_at"),
    _now_column("updated_at"),
    CheckConstraint("status IN ('active', 'deprecated', 'archived')", name="known_status"),
    CheckConstraint("on_ambiguous IN ('retry', 'hold')", name="known_on_ambiguous"),
    CheckConstraint(f"owner ~ '{OWNER_FORMAT}'", name="owner_format"),
    CheckConstraint(
        "(alert_oldest_seconds IS NULL OR alert_oldest_seconds > 0)"
        " AND (alert_error_rate IS NULL OR (alert_error_rate > 0 AND alert_error_rate <= 1))"
        " AND (alert_processing_p95_seconds IS NULL OR alert_processing_p95_seconds > 0)",
        name="alert_thresholds",
    ),
    CheckConstraint(
        "name ~ '^[A-Za-z0-9][A-Za-z0-9_-]*([.][A-Za-z0-9][A-Za-z0-9_-]*)*$'"
        " AND length(name) <= 200",
        name="name_format",
    ),
)

event_type_versions = Table(
    "event_type_versions",
    metadata,
    Column(
        "event_type_id",
        BigInteger,
        ForeignKey("event_types.id", ondelete="CASCADE"),
        primary_key=True,
    ),
    Column("version", Integer, primary_key=True),
    Column("schema", JSONB, nullable=False),
    Column("example", JSONB),
    _now_column("created_at"),
)
