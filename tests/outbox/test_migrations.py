"""The migrations create exactly the schema the code declares, and re-running is a no-op."""

from __future__ import annotations

from collections.abc import Callable

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, inspect, text

from outbox.db import make_engine
from outbox.migrate import VERSION_TABLE, current_revision, head_revision, migrations_dir, upgrade
from outbox.publish import publish
from outbox.schema import metadata

MIGRATIONS = migrations_dir() / "versions"


def test_migrated_schema_equals_declared_schema(empty_database_url: str) -> None:
    engine = make_engine(empty_database_url)
    try:
        upgrade(engine)
        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn, opts={"version_table": VERSION_TABLE, "compare_server_default": True}
            )
            differences = compare_metadata(context, metadata)
        assert differences == []
        assert set(inspect(engine).get_table_names()) == {
            *metadata.tables,
            VERSION_TABLE,
        }
    finally:
        engine.dispose()


def test_upgrade_is_idempotent_and_uses_its_own_version_table(empty_database_url: str) -> None:
    engine = make_engine(empty_database_url)
    try:
        # An application's own Alembic history lives beside ours without clashing.
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE alembic_version (version_num varchar(32) PRIMARY KEY)"))
            conn.execute(text("INSERT INTO alembic_version VALUES ('app_rev_1')"))
        upgrade(engine)
        upgrade(engine)
        assert current_revision(engine) == head_revision()
        with engine.connect() as conn:
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == (
                "app_rev_1"
            )
    finally:
        engine.dispose()


def test_every_migration_downgrades_and_upgrades_again(database_url: str) -> None:
    """From the head (a clone of the session's template, which `upgrade` made) down to
    nothing, and up again."""
    from outbox.migrate import alembic_config, downgrade

    engine = make_engine(database_url)
    try:
        assert current_revision(engine) == head_revision()
        downgrade(engine, "base")
        assert set(inspect(engine).get_table_names()) == {VERSION_TABLE}
        upgrade(engine)
        # One linear history: every migration file is on the path to the head.
        assert current_revision(engine) == head_revision()
        script = ScriptDirectory.from_config(alembic_config())
        walked = [rev.revision for rev in script.walk_revisions()]
        assert len(script.get_heads()) == 1
        assert len(walked) == len(list(MIGRATIONS.glob("0*.py")))
    finally:
        engine.dispose()


def test_upgrade_to_tenants_keeps_existing_rows_working_under_the_default_tenant(
    migrated_to: Callable[[str], Engine],
) -> None:
    """Rows written before tenants existed (migration 0005) belong to 'default' after 0006,
    keep their idempotency keys, and the relay still fans new events out to them."""
    engine = migrated_to("0005")
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO endpoints (uid, url, event_types, signing_secret)"
                " VALUES ('ep_old', 'http://127.0.0.1:9/x', ARRAY['order.*'], 'enc')"
            )
        )
        conn.execute(
            text(
                "INSERT INTO outbox_events (message_id, event_type, payload, idempotency_key,"
                " relayed_at) VALUES ('msg_old', 'order.created', '{}', 'k-1', now())"
            )
        )
        conn.execute(
            text(
                "INSERT INTO deliveries (event_id, endpoint_id, max_attempts, next_attempt_at)"
                " SELECT o.id, e.id, 5, now() FROM outbox_events o, endpoints e"
            )
        )
    upgrade(engine)
    with engine.begin() as conn:
        owners = conn.execute(
            text(
                "SELECT t.uid FROM endpoints e JOIN tenants t ON t.id = e.tenant_id"
                " UNION ALL SELECT t.uid FROM outbox_events o JOIN tenants t"
                " ON t.id = o.tenant_id"
                " UNION ALL SELECT t.uid FROM deliveries d JOIN tenants t"
                " ON t.id = d.tenant_id"
            )
        ).scalars()
        assert list(owners) == ["default", "default", "default"]
        # The old idempotency key still deduplicates for the default tenant.
        assert publish(conn, "order.created", {}, idempotency_key="k-1") == "msg_old"
        fresh = publish(conn, "order.paid", {"n": 1})
    from outbox.sql import relay as queries

    with engine.begin() as conn:
        fanned = conn.execute(
            queries.RELAY_BATCH,
            {
                "limit": 10,
                "now": conn.execute(text("SELECT now()")).scalar(),
                "max_attempts": 5,
                "rule_patterns": [],
                "rule_max_attempts": [],
            },
        ).one()
        assert (fanned.events, fanned.deliveries) == (1, 1)
        target = conn.execute(
            text(
                "SELECT e.uid FROM deliveries d JOIN outbox_events o ON o.id = d.event_id"
                " JOIN endpoints e ON e.id = d.endpoint_id WHERE o.message_id = :m"
            ),
            {"m": fresh},
        ).scalar_one()
        assert target == "ep_old"
