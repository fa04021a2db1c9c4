"""claim fencing: deliveries.claims, attempt numbers unique per delivery

Every claim bumps `deliveries.claims`; outcome writes, releases and rescues must match
the value their claim returned, so a worker whose claim was rescued (and perhaps
claimed again, even by itself) can only add history. Attempt rows are numbered by
their claim, which makes the numbers unique per delivery: existing rows are renumbered
in their recorded order (a lost-lease write could have repeated a number) and each
delivery's counter starts after its highest attempt number.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "deliveries",
        sa.Column("claims", sa.Integer(), server_default=sa.text("0"), nullable=False),
    )
    op.execute(
        """
        UPDATE delivery_attempts a SET attempt_number = n.number
        FROM (SELECT id, row_number() OVER (
                  PARTITION BY delivery_id ORDER BY attempt_number, id) AS number
              FROM delivery_attempts) n
        WHERE a.id = n.id AND a.attempt_number <> n.number
        """
    )
    op.execute(
        """
        UPDATE deliveries d SET claims = m.last
        FROM (SELECT delivery_id, max(attempt_number) AS last
              FROM delivery_attempts GROUP BY delivery_id) m
        WHERE d.id = m.delivery_id
        """
    )
    op.drop_index("ix_delivery_attempts_delivery_id", table_name="delivery_attempts")
    op.create_index(
        "uq_delivery_attempts_delivery_id_attempt_number",
        "delivery_attempts",
        ["delivery_id", "attempt_number"],
        unique=True,
    )


def downgrade() -> None:
    op.drop_index("uq_delivery_attempts_delivery_id_attempt_number", table_name="delivery_attempts")
    op.create_index("ix_delivery_attempts_delivery_id", "delivery_attempts", ["delivery_id"])
    op.drop_column("deliveries", "claims")
