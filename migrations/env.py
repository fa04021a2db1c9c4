"""Alembic environment for webhook-outbox.

Runs on a connection handed over by `outbox.migrate` and keeps its own version
table, so it can share a database with an application's own Alembic history.

Each migration runs in its own transaction (`transaction_per_migration`): a migration
that builds an index CONCURRENTLY leaves it with `op.get_context().autocommit_block()`,
and one that fails keeps the ones before it. The session's lock_timeout and
statement_timeout (`outbox.migrate.session_settings`) are set by `outbox.migrate`
(online) or printed first (offline, `outbox migrate --sql`).
"""

from __future__ import annotations

from alembic import context

from outbox.migrate import LockPolicy, session_settings
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
        transaction_per_migration=True,
        # Called inside each migration's transaction, before it commits: the lock test
        # (tests/outbox/test_migration_locks.py) reads what the migration holds there.
        on_version_apply=context.config.attributes.get("on_version_apply", ()),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    """The SQL a DBA can read (or run with psql) instead of `outbox migrate`."""
    context.configure(
        url="postgresql+psycopg://",
        dialect_name="postgresql",
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        literal_binds=True,
        # Named binds: with pyformat, a % in a statement (a PL/pgSQL RAISE) prints doubled.
        dialect_opts={"paramstyle": "named"},
        transactional_ddl=True,
        transaction_per_migration=True,
    )
    # Session level: they hold for every transaction below and outside them.
    settings = context.config.attributes.get("session_settings")
    for statement in settings or session_settings(LockPolicy()):
        context.execute(statement)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
