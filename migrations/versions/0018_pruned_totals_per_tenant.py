"""pruned_totals per tenant, so a tenant-scoped /metrics total never goes backwards

Retention (and deleting an endpoint or a tenant) tallies what it removes, so the
counters on /metrics stay monotonic. The tallies were kept for the whole installation
only, so a scrape scoped to one tenant dropped when that tenant's history was pruned.
They are now kept per tenant (`tenant_id`, no foreign key: a deleted tenant's tallies
still count in the installation's totals). Tallies from before this migration cannot
be attributed and stay under tenant_id 0, counted in unscoped totals only.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "pruned_totals",
        sa.Column("tenant_id", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
    )
    op.drop_constraint(op.f("pk_pruned_totals"), "pruned_totals", type_="primary")
    op.create_primary_key(op.f("pk_pruned_totals"), "pruned_totals", ["tenant_id", "name"])


def downgrade() -> None:
    op.execute(
        """
        CREATE TEMPORARY TABLE pruned_totals_summed ON COMMIT DROP AS
        SELECT name, sum(value) AS value FROM pruned_totals GROUP BY name;
        DELETE FROM pruned_totals;
        INSERT INTO pruned_totals (name, value) SELECT name, value FROM pruned_totals_summed;
        """
    )
    op.drop_constraint(op.f("pk_pruned_totals"), "pruned_totals", type_="primary")
    op.drop_column("pruned_totals", "tenant_id")
    op.create_primary_key(op.f("pk_pruned_totals"), "pruned_totals", ["name"])
