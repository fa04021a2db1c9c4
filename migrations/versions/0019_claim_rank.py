"""The due indexes end with `id`: due rows are in the claim's exact order

A claim takes each endpoint's due rows, and ranks endpoints by their heads, in
(priority, due time, id) order. Rows due at the same moment (a relay batch shares one
timestamp) were in heap order in both indexes, so an endpoint's "head" depended on where
its rows happened to be stored, and a claim sorted every row of that moment to take a few.
With `id` last, both indexes hold the claim's order: an endpoint's head is its first due
row in that order, and a claim among many tenants finds the batch by walking
ix_deliveries_due from the front (delivery/queries.py, RANK_CLAIM_GATES).

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def _index(name: str, *columns: str | sa.ColumnElement[object]) -> None:
    op.drop_index(name, table_name="deliveries")
    op.create_index(
        name,
        "deliveries",
        list(columns),
        unique=False,
        postgresql_where=sa.text("state = 'scheduled'"),
    )


def upgrade() -> None:
    _index("ix_deliveries_due", sa.literal_column("priority DESC"), "next_attempt_at", "id")
    _index(
        "ix_deliveries_due_per_endpoint",
        "endpoint_id",
        sa.literal_column("priority DESC"),
        "next_attempt_at",
        "id",
    )


def downgrade() -> None:
    _index("ix_deliveries_due", sa.literal_column("priority DESC"), "next_attempt_at")
    _index(
        "ix_deliveries_due_per_endpoint",
        "endpoint_id",
        sa.literal_column("priority DESC"),
        "next_attempt_at",
    )
