"""validate the delivery-mode CHECK that 0025 added NOT VALID

Validating takes only a SHARE UPDATE EXCLUSIVE lock on `endpoints` (reads and writes go
on) in a transaction of its own. Every row that existed before 0025 got the constant
default 'push', so the scan finds nothing wrong.

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


def downgrade() -> None:
    """Nothing: a validated CHECK is what 0025's NOT VALID one becomes; 0025 drops it."""
