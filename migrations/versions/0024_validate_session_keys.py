"""validate the foreign keys 0022 added NOT VALID (sessions and links to tokens and tenants)

The expand step (0022) added the keys NOT VALID, so adding them scanned nothing under
its ACCESS EXCLUSIVE lock. Validating takes only a SHARE UPDATE EXCLUSIVE lock on the
referencing table (reads and writes go on) and a ROW SHARE lock on the referenced one,
and it runs in a transaction of its own, as squawk's constraint-missing-not-valid asks.
Every row that existed before 0022 has NULL in these columns, so the scan finds nothing
to check; new rows were checked as they were written.

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None

KEYS = (
    ("console_sessions", "fk_console_sessions_tenant_id_tenants"),
    ("portal_links", "fk_portal_links_tenant_id_tenants"),
    ("console_sessions", "fk_console_sessions_token_row_admin_tokens"),
)


def upgrade() -> None:
    for table, name in KEYS:
        op.execute(f"ALTER TABLE {table} VALIDATE CONSTRAINT {name}")


def downgrade() -> None:
    """Nothing: a validated key is what 0022's NOT VALID key becomes; 0022 drops it."""
