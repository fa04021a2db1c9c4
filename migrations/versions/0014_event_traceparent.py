"""outbox_events.traceparent: the W3C trace context publish() ran in (OpenTelemetry)

Nullable and only written when the application traces with OpenTelemetry, so the
delivery attempts continue the application's trace.

Revision ID: 0014
Revises: 0008
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("outbox_events", sa.Column("traceparent", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("outbox_events", "traceparent")
