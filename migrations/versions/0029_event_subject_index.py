"""index outbox_events by (tenant_id, subject, id), built online

What it serves: `outbox.status_by_subject()` (a tenant's events about one document, newest
first), the deliveries filter by subject, and replay's "was a newer event of this subject
delivered?" check (outbox/sql/deliveries.py, SELECT_NEWER_DELIVERED), each an index range
instead of a scan of the event history. Partial (subject IS NOT NULL): events without a
subject cost nothing.

Built with CREATE INDEX CONCURRENTLY outside a transaction: SHARE UPDATE EXCLUSIVE on
outbox_events while it builds, so publishing and relaying go on. An INVALID index left by
a failed build (a lock_timeout, a cancel) is dropped and built again.

Revision ID: 0029
Revises: 0028
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0029"
down_revision = "0028"
branch_labels = None
depends_on = None

NAME = "ix_outbox_events_tenant_id_subject"


def upgrade() -> None:
    with op.get_context().autocommit_block():
        _drop_if_invalid()
        op.create_index(
            NAME,
            "outbox_events",
            ["tenant_id", "subject", "id"],
            postgresql_where=sa.text("subject IS NOT NULL"),
            postgresql_concurrently=True,
            if_not_exists=True,
        )


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.drop_index(
            NAME, table_name="outbox_events", postgresql_concurrently=True, if_exists=True
        )


def _drop_if_invalid() -> None:
    """A failed CONCURRENTLY build leaves an INVALID index that IF NOT EXISTS would keep."""
    invalid = f"SELECT 1 FROM pg_index WHERE indexrelid = to_regclass('{NAME}') AND NOT indisvalid"  # noqa: S608
    if op.get_context().as_sql:
        op.execute(
            f"DO $$ BEGIN IF EXISTS ({invalid}) THEN RAISE EXCEPTION 'index {NAME} is INVALID"
            f" (a failed concurrent build): run DROP INDEX CONCURRENTLY {NAME}; then this"
            " script again'; END IF; END $$"
        )
    elif op.get_bind().execute(sa.text(invalid)).first() is not None:
        op.drop_index(
            NAME, table_name="outbox_events", postgresql_concurrently=True, if_exists=True
        )
