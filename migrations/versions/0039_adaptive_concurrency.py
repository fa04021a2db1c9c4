"""adaptive concurrency per endpoint: the opt-in flag and the limiter's shared state

An endpoint that opts in (`outbox endpoints limits UID --concurrency adaptive`) gets an
in-flight limit that the workers move between 1 and its `max_in_flight` (AIMD,
delivery/health/adaptive.py). The state lives on the endpoint's health row, next to the
breaker, so every worker process reads it under the same row lock the claim gate takes
and the outcome write updates it in the same statement as the breaker. `adaptive` has a
constant default and the others are nullable: adding them rewrites nothing.

Revision ID: 0039
Revises: 0037
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0039"
down_revision = "0037"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # ADD COLUMN takes a brief ACCESS EXCLUSIVE lock: outbox.migrate runs it under a
    # short lock_timeout and retries, so it never queues every claim behind it.
    op.add_column(
        "endpoint_health",
        sa.Column("adaptive", sa.Boolean(), nullable=False, server_default=sa.false()),
    )
    op.add_column("endpoint_health", sa.Column("adaptive_limit", sa.BigInteger(), nullable=True))
    op.add_column("endpoint_health", sa.Column("latency_baseline_ms", sa.Float(), nullable=True))
    op.add_column(
        "endpoint_health",
        sa.Column("adaptive_window_at", sa.DateTime(timezone=True), nullable=True),
    )


def downgrade() -> None:
    op.drop_column("endpoint_health", "adaptive_window_at")
    op.drop_column("endpoint_health", "latency_baseline_ms")
    op.drop_column("endpoint_health", "adaptive_limit")
    op.drop_column("endpoint_health", "adaptive")
