"""Alembic environment for webhook-outbox.

Runs on a connection handed over by `outbox.migrate` and keeps its own version
table, so it can share a database with an application's own Alembic history.
"""

from __future__ import annotations

from alembic import context

from outbox.schema import metadata

VERSION_TABLE = "outbox_alembic_version"


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is None:
        raise RuntimeError("run migrations through `outbox migrate` (outbox.migrate.upgrade)")
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        transactional_ddl=True,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    raise RuntimeError("offline SQL generation is not supported; run `outbox migrate`")
run_migrations_online()
