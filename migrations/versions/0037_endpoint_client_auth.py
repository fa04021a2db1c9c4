"""per-endpoint authenticated delivery: a client certificate (mutual TLS) and OAuth2
client credentials, each encrypted at rest, with a display summary in the clear

`client_certificate` holds the certificate and key PEM and `oauth_client` the token URL,
client id, secret and scope, both encrypted like the signing secrets (outbox.crypto).
`client_certificate_info` and `oauth_client_info` are what operators and the API are
shown (subject, fingerprint and expiry; token URL, client id and scope), as JSON text.
All nullable without defaults: adding them rewrites nothing.

Revision ID: 0037
Revises: 0033
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0037"
down_revision = "0033"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # ADD COLUMN takes a brief ACCESS EXCLUSIVE lock: outbox.migrate runs it under a
    # short lock_timeout and retries, so it never queues every claim behind it.
    op.add_column("endpoints", sa.Column("client_certificate", sa.Text(), nullable=True))
    op.add_column("endpoints", sa.Column("client_certificate_info", sa.Text(), nullable=True))
    op.add_column("endpoints", sa.Column("oauth_client", sa.Text(), nullable=True))
    op.add_column("endpoints", sa.Column("oauth_client_info", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("endpoints", "oauth_client_info")
    op.drop_column("endpoints", "oauth_client")
    op.drop_column("endpoints", "client_certificate_info")
    op.drop_column("endpoints", "client_certificate")
