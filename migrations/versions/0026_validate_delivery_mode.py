"""validate the delivery-mode CHECK and the feed entries' foreign key that 0025 added NOT VALID

Validating takes only a SHARE UPDATE EXCLUSIVE lock on the table (reads and writes go
on) in a transaction of its own; the foreign key's check reads outbox_events under ROW
SHARE. Every row that existed before 0025 got the constant default 'push', and
feed_entries was empty, so the scans find nothing wrong.

Revision ID: 0026
Revises: 0025
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE endpoints VALIDATE CONSTRAINT ck_endpoints_known_delivery_mode")
    op.execute(
        "ALTER TABLE feed_entries VALIDATE CONSTRAINT fk_feed_entries_event_id_outbox_events"
    )


def downgrade() -> None:
    """Nothing: a validated CHECK is what 0025's NOT VALID one becomes; 0025 drops it."""
