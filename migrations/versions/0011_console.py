"""console and portal sessions; single-use portal links

Revision ID: 0011
Revises: 0009
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0009"
branch_labels = None
depends_on = None


def _now(name: str) -> sa.Column[sa.DateTime]:
    return sa.Column(
        name, sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False
    )


def upgrade() -> None:
    op.create_table(
        "console_sessions",
        sa.Column("id_hash", sa.Text(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("actor", sa.Text(), nullable=False),
        sa.Column("role", sa.Text(), nullable=False),
        sa.Column("tenant_uid", sa.Text(), nullable=True),
        sa.Column("csrf_token", sa.Text(), nullable=False),
        _now("created_at"),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "kind IN ('console', 'portal')", name=op.f("ck_console_sessions_known_kind")
        ),
        sa.CheckConstraint(
            "role IN ('viewer', 'operator')", name=op.f("ck_console_sessions_known_role")
        ),
        sa.CheckConstraint(
            "kind <> 'portal' OR tenant_uid IS NOT NULL",
            name=op.f("ck_console_sessions_portal_has_tenant"),
        ),
        sa.PrimaryKeyConstraint("id_hash", name=op.f("pk_console_sessions")),
    )
    op.create_index(op.f("ix_console_sessions_expires_at"), "console_sessions", ["expires_at"])
    op.create_table(
        "portal_links",
        sa.Column("id_hash", sa.Text(), nullable=False),
        sa.Column("tenant_uid", sa.Text(), nullable=False),
        sa.Column("created_by", sa.Text(), nullable=False),
        _now("created_at"),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("used_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id_hash", name=op.f("pk_portal_links")),
    )
    op.create_index(op.f("ix_portal_links_expires_at"), "portal_links", ["expires_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_portal_links_expires_at"), table_name="portal_links")
    op.drop_table("portal_links")
    op.drop_index(op.f("ix_console_sessions_expires_at"), table_name="console_sessions")
    op.drop_table("console_sessions")
