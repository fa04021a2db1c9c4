"""contract: drop the old state check (without 'held'); index the held deliveries

The old check `ck_deliveries_known_state` refuses 'held'; the new one (0031, validated
by 0032) allows it, so dropping the old one is the contract step (a brief lock, no scan).
`ix_deliveries_held` serves the held lists and counts (CLI, API, console, metrics) and is
built CONCURRENTLY in an autocommit block, so it blocks neither the relay nor the workers.

Revision ID: 0033
Revises: 0032
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0033"
down_revision = "0032"
branch_labels = None
depends_on = None

OLD_STATES = "'scheduled', 'in_flight', 'succeeded', 'dead', 'discarded'"


def upgrade() -> None:
    op.execute("ALTER TABLE deliveries DROP CONSTRAINT IF EXISTS ck_deliveries_known_state")
    with op.get_context().autocommit_block():
        _drop_if_invalid("ix_deliveries_held")
        op.create_index(
            "ix_deliveries_held",
            "deliveries",
            ["tenant_id", "id"],
            postgresql_where=sa.text("state = 'held'"),
            postgresql_concurrently=True,
            if_not_exists=True,
        )


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.drop_index(
            "ix_deliveries_held",
            table_name="deliveries",
            postgresql_concurrently=True,
            if_exists=True,
        )
    # Held rows cannot satisfy the old check: send them back to be tried again first.
    op.execute("UPDATE deliveries SET state = 'scheduled' WHERE state = 'held'")
    op.execute(
        "ALTER TABLE deliveries ADD CONSTRAINT ck_deliveries_known_state"
        f" CHECK (state IN ({OLD_STATES})) NOT VALID"
    )


def _drop_if_invalid(name: str) -> None:
    """A failed CONCURRENTLY build leaves an INVALID index that IF NOT EXISTS would keep."""
    # `name` is this module's constant, never input.
    invalid = f"SELECT 1 FROM pg_index WHERE indexrelid = to_regclass('{name}') AND NOT indisvalid"  # noqa: S608
    if op.get_context().as_sql:
        op.execute(
            f"DO $$ BEGIN IF EXISTS ({invalid}) THEN RAISE EXCEPTION 'index {name} is INVALID"
            f" (a failed concurrent build): run DROP INDEX CONCURRENTLY {name}; then this"
            " script again'; END IF; END $$"
        )
    elif op.get_bind().execute(sa.text(invalid)).first() is not None:
        op.drop_index(name, table_name="deliveries", postgresql_concurrently=True, if_exists=True)
