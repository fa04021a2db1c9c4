"""replay once: at most one pending replay per delivery, enforced by a unique index

Before this, two concurrent replays of one delivery (or four concurrent bulk
replays) could each insert a replay. Any such duplicates still pending are
discarded here, keeping the oldest replay of each delivery, so the index can be
built and nothing pending is sent twice; each one gets a final reason saying so.

Revision ID: 0008
Revises: 0013
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0013"
branch_labels = None
depends_on = None

_PENDING = "replay_of IS NOT NULL AND state IN ('scheduled', 'in_flight')"


def upgrade() -> None:
    op.execute(
        sa.text(
            """
            UPDATE deliveries d
            SET state = 'discarded', locked_by = NULL, lease_expires_at = NULL,
                final_reason = 'duplicate replay of delivery ' || d.replay_of
                    || ' discarded by migration 0008 (replay ' || keep.id || ' stays)',
                updated_at = now(), completed_at = now()
            FROM (
                SELECT DISTINCT ON (replay_of) replay_of, id
                FROM deliveries
                WHERE replay_of IS NOT NULL AND state IN ('scheduled', 'in_flight')
                ORDER BY replay_of, id
            ) keep
            WHERE d.replay_of = keep.replay_of AND d.id <> keep.id
              AND d.state IN ('scheduled', 'in_flight')
            """
        )
    )
    op.create_index(
        "uq_deliveries_one_pending_replay",
        "deliveries",
        ["replay_of"],
        unique=True,
        postgresql_where=sa.text(_PENDING),
    )


def downgrade() -> None:
    op.drop_index("uq_deliveries_one_pending_replay", table_name="deliveries")
