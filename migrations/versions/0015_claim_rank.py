"""ix_deliveries_due gains `id`: the claim walks due rows in its exact order

The claim ranks endpoints by their first due delivery in (priority, due time, id)
order; with many busy endpoints it finds them by walking this index from the front
(delivery/queries.py, RANK_CLAIM_GATES). Rows due at the same moment (a relay batch
shares one timestamp) are then already in id order, so the walk reads a batch's worth
of entries instead of sorting every row with that timestamp.

Revision ID: 0015
Revises: 0011
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0011"
branch_labels = None
depends_on = None


def _due_index(*columns: str) -> None:
    op.drop_index("ix_deliveries_due", table_name="deliveries")
    op.create_index(
        "ix_deliveries_due",
        "deliveries",
        [sa.literal_column("priority DESC"), *columns],
        unique=False,
        postgresql_where=sa.text("state = 'scheduled'"),
    )


def upgrade() -> None:
    _due_index("next_attempt_at", "id")


def downgrade() -> None:
    _due_index("next_attempt_at")
