"""The due indexes in claim order (priority, due time, id), built online under new names

What 0019 did, online. Both indexes are built with CREATE INDEX CONCURRENTLY before
the old ones go (DROP INDEX CONCURRENTLY), so the claim always has an index to walk and
neither build blocks the relay's inserts or the workers' updates.

Locks: SHARE UPDATE EXCLUSIVE on `deliveries` while each index builds (reads and
writes go on; only other DDL and VACUUM wait) and, for the drops, an exclusive lock
on the old index alone, taken once no transaction is using it. The builds wait for
transactions already running when they start, at most lock_timeout each time, and
are retried. Build time: one pass over the table per index (every delivery, although
only the scheduled ones are indexed): 0.9-1.3 s for the whole migration over 1,000,000
deliveries on the bench machine, while publishing 200 events/s never took longer than
0.05 s and deliveries never paused longer than 0.08 s. Done the old way (0019's drop and
CREATE INDEX) the same builds stopped deliveries for their whole duration, 0.45 s here,
growing with the table (bench/results/migration-stall-2026-12-01.json, `python -m bench --only
migration`).

Both paths end the same: a database at 0019 (the indexes already end with `id`) gets
them rebuilt under the new names; one at 0018 (0019 now does nothing) gets them for
the first time. An index left INVALID by a failed concurrent build (a lock_timeout,
a cancel) is dropped and built again; the offline SQL (`outbox migrate --sql`) stops
with a message instead, since it cannot look first.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

SCHEDULED = sa.text("state = 'scheduled'")
PRIORITY = sa.literal_column("priority DESC")
# name -> columns, in the claim's order (delivery/queries.py, RANK_CLAIM_GATES).
RANKED = {
    "ix_deliveries_due_ranked": [PRIORITY, "next_attempt_at", "id"],
    "ix_deliveries_due_per_endpoint_ranked": ["endpoint_id", PRIORITY, "next_attempt_at", "id"],
}
# What 0019 left (and what a downgrade puts back): the same columns under the old names.
OLD = {
    "ix_deliveries_due": RANKED["ix_deliveries_due_ranked"],
    "ix_deliveries_due_per_endpoint": RANKED["ix_deliveries_due_per_endpoint_ranked"],
}


def upgrade() -> None:
    with op.get_context().autocommit_block():
        _build(RANKED)
        for name in OLD:
            op.drop_index(
                name, table_name="deliveries", postgresql_concurrently=True, if_exists=True
            )


def downgrade() -> None:
    with op.get_context().autocommit_block():
        _build(OLD)
        for name in RANKED:
            op.drop_index(
                name, table_name="deliveries", postgresql_concurrently=True, if_exists=True
            )


def _build(indexes: dict[str, list[str | sa.ColumnElement[object]]]) -> None:
    for name, columns in indexes.items():
        _drop_if_invalid(name)
        op.create_index(
            name,
            "deliveries",
            columns,
            postgresql_where=SCHEDULED,
            postgresql_concurrently=True,
            if_not_exists=True,
        )


def _drop_if_invalid(name: str) -> None:
    """A failed CONCURRENTLY build leaves an INVALID index that IF NOT EXISTS would keep."""
    # `name` is one of this module's constants, never input.
    invalid = f"SELECT 1 FROM pg_index WHERE indexrelid = to_regclass('{name}') AND NOT indisvalid"  # noqa: S608
    if op.get_context().as_sql:
        op.execute(
            f"DO $$ BEGIN IF EXISTS ({invalid}) THEN RAISE EXCEPTION 'index {name} is INVALID"
            f" (a failed concurrent build): run DROP INDEX CONCURRENTLY {name}; then this"
            " script again'; END IF; END $$"
        )
    elif op.get_bind().execute(sa.text(invalid)).first() is not None:
        op.drop_index(name, table_name="deliveries", postgresql_concurrently=True, if_exists=True)
