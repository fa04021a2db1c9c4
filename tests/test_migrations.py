"""The migrations create exactly the schema the code declares, and re-running is a no-op."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from outbox.db import make_engine
from outbox.migrate import VERSION_TABLE, current_revision, head_revision, upgrade
from outbox.schema import metadata


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


def test_every_migration_downgrades_and_upgrades_again(empty_database_url: str) -> None:
    from alembic import command

    from outbox.migrate import alembic_config

    engine = make_engine(empty_database_url)
    try:
        upgrade(engine)
        with engine.begin() as conn:
            command.downgrade(alembic_config(conn), "base")
        assert set(inspect(engine).get_table_names()) == {VERSION_TABLE}
        upgrade(engine)
        assert current_revision(engine) == head_revision() == "0005"
    finally:
        engine.dispose()
