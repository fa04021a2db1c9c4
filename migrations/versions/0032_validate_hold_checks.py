"""validate the checks 0031 added NOT VALID (the state check with 'held', the new columns)

VALIDATE CONSTRAINT takes only a SHARE UPDATE EXCLUSIVE lock (reads and writes go on)
while it scans, in a transaction of its own, as squawk's constraint-missing-not-valid
asks. Every delivery's state is one of the old five, all allowed by the new check; the
new columns are NULL in every existing row.

Revision ID: 0032
Revises: 0031
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0032"
down_revision = "0031"
branch_labels = None
depends_on = None

CHECKS = (
    ("deliveries", "ck_deliveries_known_state_held"),
    ("endpoints", "ck_endpoints_known_on_ambiguous"),
    ("endpoints", "ck_endpoints_owner_format"),
    ("endpoints", "ck_endpoints_operational_owner_format"),
    ("event_types", "ck_event_types_known_on_ambiguous"),
    ("event_types", "ck_event_types_owner_format"),
    ("event_types", "ck_event_types_alert_thresholds"),
)


def upgrade() -> None:
    for table, name in CHECKS:
        op.execute(f"ALTER TABLE {table} VALIDATE CONSTRAINT {name}")


def downgrade() -> None:
    """Nothing: a validated check is what 0031's NOT VALID one becomes; 0031 drops it."""
