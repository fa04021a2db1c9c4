"""No migration after 0.1.0 can deadlock with the service it upgrades under.

A deadlock needs two sessions that each hold a lock the other waits for. The service
takes its tables in different orders (the relay reads endpoints before it writes
deliveries; a claim locks deliveries, then reads endpoints), so a migration that holds a
lock blocking their reads or writes on one existing table while it asks for one on a
second can always close such a circle, and PostgreSQL then cancels whichever waited
first: usually the relay or a worker (the rolling-upgrade test saw both). So each
migration transaction may take a lock stronger than ROW EXCLUSIVE on at most one of the
service's tables that existed before it; the rest goes in statements of its own (an
autocommit block).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from alembic import command
from sqlalchemy import Connection, Engine, text

from outbox.migrate import LockPolicy, alembic_config, session_settings
from tests.helpers import rows

# The schema 0.1.0 shipped (PREVIOUS_RELEASE): the migrations after it run under a live
# service during a rolling upgrade.
RELEASED = "0019"

# What the running 0.1.0 service (publish, relay, workers) reads or writes while it
# delivers. Other tables (console sessions, portal links, the audit log) are touched by
# operators' requests, one table at a time.
SERVICE_TABLES = frozenset(
    {
        "outbox_events",
        "deliveries",
        "delivery_attempts",
        "endpoints",
        "endpoint_subscriptions",
        "endpoint_health",
        "event_types",
        "event_type_versions",
        "event_type_priorities",
        "tenants",
        "tenant_buckets",
        "pruned_totals",
        "operational_event_marks",
    }
)

# Modes that block the service's own statements (SELECT takes ACCESS SHARE, FOR UPDATE
# ROW SHARE, INSERT/UPDATE/DELETE ROW EXCLUSIVE); SHARE UPDATE EXCLUSIVE (VALIDATE
# CONSTRAINT, CREATE INDEX CONCURRENTLY) blocks none of them.
BLOCKING = ("ShareLock", "ShareRowExclusiveLock", "ExclusiveLock", "AccessExclusiveLock")

HELD = text(
    "SELECT c.relname AS name, l.mode FROM pg_locks l JOIN pg_class c ON c.oid = l.relation"
    " WHERE l.pid = pg_backend_pid() AND l.locktype = 'relation' AND l.granted"
    " AND c.relkind IN ('r', 'p')"
)
TABLES = text(
    "SELECT relname FROM pg_class WHERE relkind IN ('r', 'p')"
    " AND relnamespace = 'public'::regnamespace"
)


@pytest.fixture
def released(migrated_to: Callable[[str], Engine]) -> Engine:
    """A database that `upgrade` brought to RELEASED (a clone of one, made once)."""
    return migrated_to(RELEASED)


def blocking_locks_per_migration(engine: Engine) -> dict[str, set[str]]:
    """Each migration after RELEASED: the service's tables that existed before it and
    that it holds in a blocking mode when its transaction commits."""
    found: dict[str, set[str]] = {}
    existing = {r["relname"] for r in rows(engine, TABLES.text)}

    def record(ctx: Any, step: Any, heads: Any, run_args: Any) -> None:
        nonlocal existing
        connection: Connection = ctx.connection
        held = connection.execute(HELD).all()
        found[step.up_revision_id] = {
            name
            for name, mode in held
            if mode in BLOCKING and name in existing and name in SERVICE_TABLES
        }
        existing = set(connection.execute(TABLES).scalars())

    with engine.connect() as connection:
        for statement in session_settings(LockPolicy()):
            connection.execute(text(statement))
        connection.commit()
        config = alembic_config(connection)
        config.attributes["on_version_apply"] = record
        command.upgrade(config, "head")
        connection.commit()
    return found


def test_each_migration_after_the_release_blocks_at_most_one_existing_table(
    released: Engine,
) -> None:
    found = blocking_locks_per_migration(released)
    assert found, "no migration ran after the release"
    several = {revision: tables for revision, tables in found.items() if len(tables) > 1}
    assert several == {}, (
        "these migrations hold locks that block the service on several existing tables in"
        " one transaction, so they can deadlock with the relay or a worker; give each table"
        " its own statement in an autocommit block"
    )


def test_the_lock_check_sees_a_migration_that_blocks_two_tables(released: Engine) -> None:
    """The check above reads real locks: two tables altered in one transaction show."""
    seen: set[str] = set()
    with released.connect() as connection:
        connection.execute(text("ALTER TABLE endpoints ADD COLUMN probe_a text"))
        connection.execute(text("ALTER TABLE deliveries ADD COLUMN probe_b text"))
        seen = {name for name, mode in connection.execute(HELD).all() if mode in BLOCKING}
        connection.rollback()
    assert {"endpoints", "deliveries"} <= seen
