"""endpoint health: breaker state, limits, ordering; event type priorities

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "endpoint_health",
        sa.Column("endpoint_id", sa.BigInteger(), nullable=False),
        sa.Column("max_in_flight", sa.Integer(), nullable=True),
        sa.Column("max_per_second", sa.Float(), nullable=True),
        sa.Column("ordered", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("dead_head", sa.Text(), server_default=sa.text("'block'"), nullable=False),
        sa.Column("breaker_state", sa.Text(), server_default=sa.text("'closed'"), nullable=False),
        sa.Column(
            "consecutive_failures", sa.Integer(), server_default=sa.text("0"), nullable=False
        ),
        sa.Column("window_started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("window_attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("window_failures", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("trips", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("opened_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("open_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("probe_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("ramp_started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("ramp_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("paused_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("tokens", sa.Float(), nullable=True),
        sa.Column("tokens_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("failing_since", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_failure", sa.Text(), nullable=True),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint(
            "breaker_state IN ('closed', 'open', 'half_open')",
            name=op.f("ck_endpoint_health_known_breaker_state"),
        ),
        sa.CheckConstraint(
            "dead_head IN ('block', 'skip')", name=op.f("ck_endpoint_health_known_dead_head")
        ),
        sa.CheckConstraint(
            "(max_in_flight IS NULL OR max_in_flight > 0)"
            " AND (max_per_second IS NULL OR max_per_second > 0)",
            name=op.f("ck_endpoint_health_positive_limits"),
        ),
        sa.ForeignKeyConstraint(
            ["endpoint_id"],
            ["endpoints.id"],
            name=op.f("fk_endpoint_health_endpoint_id_endpoints"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("endpoint_id", name=op.f("pk_endpoint_health")),
    )
    op.create_table(
        "event_type_priorities",
        sa.Column("event_type", sa.Text(), nullable=False),
        sa.Column("priority", sa.SmallInteger(), nullable=False),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint(
            "priority BETWEEN -100 AND 100", name=op.f("ck_event_type_priorities_priority_range")
        ),
        sa.PrimaryKeyConstraint("event_type", name=op.f("pk_event_type_priorities")),
    )
    op.create_index(
        "ix_deliveries_due_per_endpoint",
        "deliveries",
        ["endpoint_id", sa.literal_column("priority DESC"), "next_attempt_at"],
        unique=False,
        postgresql_where=sa.text("state = 'scheduled'"),
    )
    op.create_index(
        "ix_outbox_events_unrelayed_keys",
        "outbox_events",
        ["ordering_key", "id"],
        unique=False,
        postgresql_where=sa.text("relayed_at IS NULL AND ordering_key IS NOT NULL"),
    )
    op.create_index(
        "ix_deliveries_ordering",
        "deliveries",
        ["endpoint_id", "ordering_key", "event_id"],
        unique=False,
        postgresql_where=sa.text("ordering_key IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_deliveries_ordering", table_name="deliveries")
    op.drop_index("ix_outbox_events_unrelayed_keys", table_name="outbox_events")
    op.drop_index("ix_deliveries_due_per_endpoint", table_name="deliveries")
    op.drop_table("event_type_priorities")
    op.drop_table("endpoint_health")
