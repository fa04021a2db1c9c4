"""console and portal sessions bound to their token and tenant; tokens may expire

A console session kept working for its whole lifetime after the token that opened it
was revoked, and sessions and portal links named their tenant by uid, so deleting a
tenant and creating another with the same uid handed the old sessions the new tenant's
data. Sessions now carry the token's row (`token_row`) and the tenant's internal id
(`tenant_id`), both foreign keys that cascade; portal links carry `tenant_id` too. A
token may have an expiry (`admin_tokens.expires_at`).

Online: three nullable columns without defaults (no rewrite) and foreign keys added NOT
VALID (validated by 0024 in a transaction of its own), each step under outbox.migrate's short lock_timeout. No index: sessions
are found by their primary key, and the tables are small (expired rows are pruned).
Sessions and links from before this migration have no token or tenant id and are
refused, so everyone signs in once more after the upgrade.

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # outbox.migrate runs this under a short lock_timeout and retries. The foreign keys
    # are added NOT VALID (no scan under the lock); 0024 validates them in a transaction
    # of its own, which takes only a SHARE UPDATE EXCLUSIVE lock: reads and writes go on.
    op.add_column("admin_tokens", sa.Column("expires_at", sa.DateTime(timezone=True)))
    for table in ("console_sessions", "portal_links"):
        op.add_column(table, sa.Column("tenant_id", sa.BigInteger()))
        _foreign_key(f"fk_{table}_tenant_id_tenants", table, "tenant_id", "tenants")
    op.add_column("console_sessions", sa.Column("token_row", sa.BigInteger()))
    _foreign_key(
        "fk_console_sessions_token_row_admin_tokens",
        "console_sessions",
        "token_row",
        "admin_tokens",
    )


def _foreign_key(name: str, table: str, column: str, target: str) -> None:
    """ON DELETE CASCADE, NOT VALID: enforced for new rows at once, validated by 0024."""
    op.execute(
        f"ALTER TABLE {table} ADD CONSTRAINT {name} FOREIGN KEY ({column})"
        f" REFERENCES {target} (id) ON DELETE CASCADE NOT VALID"
    )


def downgrade() -> None:
    op.drop_constraint(
        op.f("fk_console_sessions_token_row_admin_tokens"), "console_sessions", type_="foreignkey"
    )
    op.drop_column("console_sessions", "token_row")
    for table in ("portal_links", "console_sessions"):
        op.drop_constraint(op.f(f"fk_{table}_tenant_id_tenants"), table, type_="foreignkey")
        op.drop_column(table, "tenant_id")
    op.drop_column("admin_tokens", "expires_at")
