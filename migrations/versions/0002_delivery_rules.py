"""delivery rules: per-endpoint status overrides, rescue counter

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "endpoints",
        sa.Column("status_overrides", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    )
    op.add_column(
        "deliveries",
        sa.Column("rescues", sa.Integer(), server_default=sa.text("0"), nullable=False),
    )


def downgrade() -> None:
    op.drop_column("deliveries", "rescues")
    op.drop_column("endpoints", "status_overrides")
