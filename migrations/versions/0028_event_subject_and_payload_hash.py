"""outbox_events.subject and outbox_events.payload_hash (issue 24)

- `subject`: the document an event is about ("invoice/inv_7"), given to publish(); the
  application asks `outbox.status_by_subject()` about it, operators filter deliveries by it,
  and replay checks it for a newer event of the same subject (0029 indexes it).
- `payload_hash`: sha256 of the payload's canonical text (PostgreSQL's rendering of the
  jsonb value: keys in one fixed order, one fixed spacing), written for events that carry
  an idempotency key. A second publish with the same key compares it, so the same key with
  another payload is refused (outbox.IdempotencyConflict). Rows written before this column
  (or by an older release during a rolling upgrade) have NULL; the comparison computes the
  hash from their payload on the fly, the same way, so they compare exactly like new rows.

Online: both columns are nullable without defaults, so adding them rewrites nothing; the
brief ACCESS EXCLUSIVE lock runs under outbox.migrate's short lock_timeout, with retries.

Revision ID: 0028
Revises: 0026
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0028"
down_revision = "0026"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("outbox_events", sa.Column("subject", sa.Text(), nullable=True))
    op.add_column("outbox_events", sa.Column("payload_hash", postgresql.BYTEA(), nullable=True))


def downgrade() -> None:
    op.drop_column("outbox_events", "payload_hash")
    op.drop_column("outbox_events", "subject")
