"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "audit_log",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column(
            "at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.Column("actor", sa.Text(), nullable=False),
        sa.Column("action", sa.Text(), nullable=False),
        sa.Column("target_type", sa.Text(), nullable=False),
        sa.Column("target_id", sa.Text(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column(
            "details",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("request_id", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_log")),
    )
    op.create_index("ix_audit_log_at", "audit_log", ["at"], unique=False)
    op.create_table(
        "endpoints",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("uid", sa.Text(), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("description", sa.Text(), server_default=sa.text("''"), nullable=False),
        sa.Column("event_types", postgresql.ARRAY(sa.Text()), nullable=False),
        sa.Column("enabled", sa.Boolean(), server_default=sa.text("true"), nullable=False),
        sa.Column("disabled_reason", sa.Text(), nullable=True),
        sa.Column("disabled_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("signing_secret", sa.Text(), nullable=False),
        sa.Column("previous_signing_secret", sa.Text(), nullable=True),
        sa.Column("previous_secret_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("timeout_seconds", sa.Float(), nullable=True),
        sa.Column("max_attempts", sa.Integer(), nullable=True),
        sa.Column("retry_schedule", postgresql.ARRAY(sa.Float()), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint(
            "cardinality(event_types) > 0", name=op.f("ck_endpoints_has_event_types")
        ),
        sa.CheckConstraint(
            "enabled OR disabled_reason IS NOT NULL", name=op.f("ck_endpoints_disabled_has_reason")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_endpoints")),
        sa.UniqueConstraint("uid", name=op.f("uq_endpoints_uid")),
    )
    op.create_table(
        "outbox_events",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("message_id", sa.Text(), nullable=False),
        sa.Column("event_type", sa.Text(), nullable=False),
        sa.Column("payload", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("idempotency_key", sa.Text(), nullable=True),
        sa.Column("ordering_key", sa.Text(), nullable=True),
        sa.Column("priority", sa.SmallInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("relayed_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_outbox_events")),
        sa.UniqueConstraint("message_id", name=op.f("uq_outbox_events_message_id")),
    )
    op.create_index(
        "ix_outbox_events_unrelayed",
        "outbox_events",
        ["id"],
        unique=False,
        postgresql_where=sa.text("relayed_at IS NULL"),
    )
    op.create_index(
        "uq_outbox_events_idempotency_key",
        "outbox_events",
        ["idempotency_key"],
        unique=True,
        postgresql_where=sa.text("idempotency_key IS NOT NULL"),
    )
    op.create_table(
        "deliveries",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("event_id", sa.BigInteger(), nullable=False),
        sa.Column("endpoint_id", sa.BigInteger(), nullable=False),
        sa.Column("state", sa.Text(), server_default=sa.text("'scheduled'"), nullable=False),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("locked_by", sa.Text(), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_status_code", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("final_reason", sa.Text(), nullable=True),
        sa.Column("replay_of", sa.BigInteger(), nullable=True),
        sa.Column("priority", sa.SmallInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("ordering_key", sa.Text(), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "state <> 'in_flight' OR (locked_by IS NOT NULL AND lease_expires_at IS NOT NULL)",
            name=op.f("ck_deliveries_in_flight_is_leased"),
        ),
        sa.CheckConstraint(
            "state IN ('scheduled', 'in_flight', 'succeeded', 'dead', 'discarded')",
            name=op.f("ck_deliveries_known_state"),
        ),
        sa.CheckConstraint(
            "attempts >= 0 AND max_attempts > 0", name=op.f("ck_deliveries_attempt_counts")
        ),
        sa.ForeignKeyConstraint(
            ["endpoint_id"],
            ["endpoints.id"],
            name=op.f("fk_deliveries_endpoint_id_endpoints"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["event_id"],
            ["outbox_events.id"],
            name=op.f("fk_deliveries_event_id_outbox_events"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["replay_of"],
            ["deliveries.id"],
            name=op.f("fk_deliveries_replay_of_deliveries"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_deliveries")),
    )
    op.create_index(
        "ix_deliveries_due",
        "deliveries",
        [sa.literal_column("priority DESC"), "next_attempt_at"],
        unique=False,
        postgresql_where=sa.text("state = 'scheduled'"),
    )
    op.create_index(
        "ix_deliveries_endpoint_state", "deliveries", ["endpoint_id", "state"], unique=False
    )
    op.create_index(
        "ix_deliveries_leases",
        "deliveries",
        ["lease_expires_at"],
        unique=False,
        postgresql_where=sa.text("state = 'in_flight'"),
    )
    op.create_index(
        "ix_deliveries_replay_of",
        "deliveries",
        ["replay_of"],
        unique=False,
        postgresql_where=sa.text("replay_of IS NOT NULL"),
    )
    op.create_index(
        "uq_deliveries_first_per_endpoint",
        "deliveries",
        ["event_id", "endpoint_id"],
        unique=True,
        postgresql_where=sa.text("replay_of IS NULL"),
    )
    op.create_table(
        "delivery_attempts",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("delivery_id", sa.BigInteger(), nullable=False),
        sa.Column("attempt_number", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("duration_ms", sa.Integer(), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("outcome", sa.Text(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("response_excerpt", sa.Text(), nullable=True),
        sa.Column(
            "request_headers",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("worker_id", sa.Text(), nullable=False),
        sa.CheckConstraint(
            "outcome IN ('succeeded', 'retryable', 'permanent', 'ambiguous')",
            name=op.f("ck_delivery_attempts_known_outcome"),
        ),
        sa.ForeignKeyConstraint(
            ["delivery_id"],
            ["deliveries.id"],
            name=op.f("fk_delivery_attempts_delivery_id_deliveries"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_delivery_attempts")),
    )
    op.create_index(
        "ix_delivery_attempts_delivery_id", "delivery_attempts", ["delivery_id"], unique=False
    )


def downgrade() -> None:
    op.drop_index("ix_delivery_attempts_delivery_id", table_name="delivery_attempts")
    op.drop_table("delivery_attempts")
    op.drop_index(
        "uq_deliveries_first_per_endpoint",
        table_name="deliveries",
        postgresql_where=sa.text("replay_of IS NULL"),
    )
    op.drop_index(
        "ix_deliveries_replay_of",
        table_name="deliveries",
        postgresql_where=sa.text("replay_of IS NOT NULL"),
    )
    op.drop_index(
        "ix_deliveries_leases",
        table_name="deliveries",
        postgresql_where=sa.text("state = 'in_flight'"),
    )
    op.drop_index("ix_deliveries_endpoint_state", table_name="deliveries")
    op.drop_index(
        "ix_deliveries_due",
        table_name="deliveries",
        postgresql_where=sa.text("state = 'scheduled'"),
    )
    op.drop_table("deliveries")
    op.drop_index(
        "uq_outbox_events_idempotency_key",
        table_name="outbox_events",
        postgresql_where=sa.text("idempotency_key IS NOT NULL"),
    )
    op.drop_index(
        "ix_outbox_events_unrelayed",
        table_name="outbox_events",
        postgresql_where=sa.text("relayed_at IS NULL"),
    )
    op.drop_table("outbox_events")
    op.drop_table("endpoints")
    op.drop_index("ix_audit_log_at", table_name="audit_log")
    op.drop_table("audit_log")
