"""per-endpoint egress proxy: the URL encrypted at rest, host:port in the clear

An endpoint may send through its own egress proxy (a partner that allow-lists one
source address). The URL can carry credentials, so it is stored encrypted like the
signing secrets (outbox.crypto); `proxy_host` is only `host:port`, what operators and
the API are shown. Both nullable without defaults: adding them rewrites nothing.

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # ADD COLUMN takes a brief ACCESS EXCLUSIVE lock: outbox.migrate runs it under a
    # short lock_timeout and retries, so it never queues every claim behind it.
    op.add_column("endpoints", sa.Column("proxy_url", sa.Text(), nullable=True))
    op.add_column("endpoints", sa.Column("proxy_host", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("endpoints", "proxy_host")
    op.drop_column("endpoints", "proxy_url")
