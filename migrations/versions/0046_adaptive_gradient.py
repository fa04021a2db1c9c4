"""adaptive concurrency: the gradient limiter's unrounded limit

The gradient limiter (delivery/health/adaptive.py) moves an endpoint's limit by
fractions of a request per outcome batch; `adaptive_limit` (what the claim gate reads)
is its whole part, and `adaptive_estimate` keeps the rest so small steps add up. A
nullable column without a default: adding it rewrites nothing.

Revision ID: 0046
Revises: 0041
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0046"
down_revision = "0041"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # ADD COLUMN takes a brief ACCESS EXCLUSIVE lock: outbox.migrate runs it under a
    # short lock_timeout and retries, so it never queues every claim behind it.
    op.add_column("endpoint_health", sa.Column("adaptive_estimate", sa.Float(), nullable=True))


def downgrade() -> None:
    op.drop_column("endpoint_health", "adaptive_estimate")
