"""Tables of operator access and its trail: audit log, API tokens, sessions, portal links."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    DateTime,
    ForeignKey,
    Identity,
    Index,
    Table,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB

from outbox.schema_base import _now_column, metadata

audit_log = Table(
    "audit_log",
    metadata,
    Column("id", BigInteger, Identity(always=False), primary_key=True),
    _now_column("at"),
    Column("actor", Text, nullable=False),
    Column("action", Text, nullable=False),
    Column("target_type", Text, nullable=False),
    Column("target_id", Text),
    Column("reason", Text),
    Column("details", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("request_id", Text),
    # The tenant the action concerned, when it concerned one (a tenant-scoped caller reads
    # only these rows). Text, not a key: the audit trail outlives a deleted tenant.
    Column("tenant_uid", Text),
    Index("ix_audit_log_at", "at"),
    Index("ix_audit_log_tenant_uid_at", "tenant_uid", "at"),
)

# Bearer tokens of the admin HTTP API (migration 0005). A token is
# `obx_<token_id>_<secret>`: token_id finds the row, and only a SHA-256 of the
# secret is stored, compared in constant time.
admin_tokens = Table(
    "admin_tokens",
    metadata,
    Column("id", BigInteger, Identity(always=False), primary_key=True),
    Column("token_id", Text, nullable=False, unique=True),
    Column("name", Text, nullable=False),
    Column("role", Text, nullable=False),
    Column("secret_hash", Text, nullable=False),
    Column("created_by", Text, nullable=False),
    _now_column("created_at"),
    Column("last_used_at", DateTime(timezone=True)),
    Column("revoked_at", DateTime(timezone=True)),
    # NULL: sees everything. Else the tenant uid the token is confined to. Text, not a key,
    # so a token whose tenant was deleted is refused by name (deleting revokes it too).
    Column("tenant_uid", Text),
    # NULL: never expires. Past it the token is refused, and so are the console sessions
    # it opened (migration 0022).
    Column("expires_at", DateTime(timezone=True)),
    CheckConstraint("role IN ('viewer', 'operator')", name="known_role"),
    # Active names are unique among unscoped tokens, and per tenant among scoped ones, so
    # a tenant's names reveal nothing of another tenant's tokens (migration 0013).
    Index(
        "uq_admin_tokens_active_name",
        "name",
        unique=True,
        postgresql_where=text("revoked_at IS NULL AND tenant_uid IS NULL"),
    ),
    Index(
        "uq_admin_tokens_active_tenant_uid_name",
        "tenant_uid",
        "name",
        unique=True,
        postgresql_where=text("revoked_at IS NULL AND tenant_uid IS NOT NULL"),
    ),
)

# Sessions of the web console and the tenant portal (migration 0011). The cookie holds a
# random id; only its SHA-256 is stored. `tenant_uid` confines a session to one tenant
# (every portal session, and console sessions opened with a tenant-scoped token).
# Migration 0022 binds a session to what opened it: `token_row` (the console's token; a
# revoked or expired token ends the session) and `tenant_id` (the tenant's internal id, so
# a deleted tenant's sessions go with it and a re-created uid does not revive them). Rows
# from before 0022 have neither and count as no session.
console_sessions = Table(
    "console_sessions",
    metadata,
    Column("id_hash", Text, primary_key=True),
    Column("kind", Text, nullable=False),
    Column("actor", Text, nullable=False),
    Column("role", Text, nullable=False),
    Column("tenant_uid", Text),
    Column("csrf_token", Text, nullable=False),
    Column("token_row", BigInteger, ForeignKey("admin_tokens.id", ondelete="CASCADE")),
    Column("tenant_id", BigInteger, ForeignKey("tenants.id", ondelete="CASCADE")),
    _now_column("created_at"),
    Column("expires_at", DateTime(timezone=True), nullable=False),
    CheckConstraint("kind IN ('console', 'portal')", name="known_kind"),
    CheckConstraint("role IN ('viewer', 'operator')", name="known_role"),
    CheckConstraint("kind <> 'portal' OR tenant_uid IS NOT NULL", name="portal_has_tenant"),
    Index("ix_console_sessions_expires_at", "expires_at"),
)

# Single-use, short-lived links into the tenant portal, issued by an operator. Only the
# SHA-256 of the link's secret is stored; `used_at` makes a second use fail. `tenant_id`
# (migration 0022) ties a link to the tenant it was issued for, not to its uid.
portal_links = Table(
    "portal_links",
    metadata,
    Column("id_hash", Text, primary_key=True),
    Column("tenant_uid", Text, nullable=False),
    Column("tenant_id", BigInteger, ForeignKey("tenants.id", ondelete="CASCADE")),
    Column("created_by", Text, nullable=False),
    _now_column("created_at"),
    Column("expires_at", DateTime(timezone=True), nullable=False),
    Column("used_at", DateTime(timezone=True)),
    Index("ix_portal_links_expires_at", "expires_at"),
)
