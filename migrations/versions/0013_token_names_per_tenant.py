"""token names unique per tenant: a tenant's token names say nothing of other tenants'

An active token's name was unique across the installation, so creating a token named
"ci" for seller-7 failed when seller-8 had one: a tenant-scoped caller could learn that
another tenant's token exists. Names are now unique among unscoped tokens, and per
tenant among tenant-scoped ones.

Revision ID: 0013
Revises: 0010
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index("uq_admin_tokens_active_name", table_name="admin_tokens")
    op.create_index(
        "uq_admin_tokens_active_name",
        "admin_tokens",
        ["name"],
        unique=True,
        postgresql_where=sa.text("revoked_at IS NULL AND tenant_uid IS NULL"),
    )
    op.create_index(
        "uq_admin_tokens_active_tenant_uid_name",
        "admin_tokens",
        ["tenant_uid", "name"],
        unique=True,
        postgresql_where=sa.text("revoked_at IS NULL AND tenant_uid IS NOT NULL"),
    )


def downgrade() -> None:
    # Fails if two tenants hold active tokens of the same name: revoke one first.
    op.drop_index("uq_admin_tokens_active_tenant_uid_name", table_name="admin_tokens")
    op.drop_index("uq_admin_tokens_active_name", table_name="admin_tokens")
    op.create_index(
        "uq_admin_tokens_active_name",
        "admin_tokens",
        ["name"],
        unique=True,
        postgresql_where=sa.text("revoked_at IS NULL"),
    )
