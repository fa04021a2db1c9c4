"""operator tools: admin API tokens, pruned-row totals, retention indexes

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "admin_tokens",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("token_id", sa.Text(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("role", sa.Text(), nullable=False),
        sa.Column("secret_hash", sa.Text(), nullable=False),
        sa.Column("created_by", sa.Text(), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "role IN ('viewer', 'operator')", name=op.f("ck_admin_tokens_known_role")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_admin_tokens")),
        sa.UniqueConstraint("token_id", name=op.f("uq_admin_tokens_token_id")),
    )
    op.create_index(
        "uq_admin_tokens_active_name",
        "admin_tokens",
        ["name"],
        unique=True,
        postgresql_where=sa.text("revoked_at IS NULL"),
    )
    op.create_table(
        "pruned_totals",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("value", sa.Float(), server_default=sa.text("0"), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_pruned_totals")),
    )
    op.create_index(
        "ix_deliveries_event_id_endpoint_id",
        "deliveries",
        ["event_id", "endpoint_id"],
        unique=False,
    )
    op.create_index(
        "ix_deliveries_completed_at",
        "deliveries",
        ["completed_at"],
        unique=False,
        postgresql_where=sa.text("state IN ('succeeded', 'dead', 'discarded')"),
    )
    op.create_index(
        "ix_outbox_events_relayed_at",
        "outbox_events",
        ["relayed_at"],
        unique=False,
        postgresql_where=sa.text("relayed_at IS NOT NULL"),
    )
    op.create_index(
        "ix_delivery_attempts_started_at", "delivery_attempts", ["started_at"], unique=False
    )


def downgrade() -> None:
    op.drop_index("ix_delivery_attempts_started_at", table_name="delivery_attempts")
    op.drop_index("ix_outbox_events_relayed_at", table_name="outbox_events")
    op.drop_index("ix_deliveries_completed_at", table_name="deliveries")
    op.drop_index("ix_deliveries_event_id_endpoint_id", table_name="deliveries")
    op.drop_table("pruned_totals")
    op.drop_index("uq_admin_tokens_active_name", table_name="admin_tokens")
    op.drop_table("admin_tokens")
