"""custom endpoint headers, encrypted at rest

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # JSON of {name: value}, encrypted like the signing secrets (outbox.crypto).
    op.add_column("endpoints", sa.Column("custom_headers", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("endpoints", "custom_headers")
