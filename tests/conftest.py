"""Shared fixtures: one real PostgreSQL per session, a fresh database per test.

The server is the embedded one (or OUTBOX_TEST_DATABASE_URL when set). The schema
is migrated once into a template database; each test gets a clone of it, which is
much faster than migrating again.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import shutil
import tempfile
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, create_engine, make_url, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.pool import NullPool

from delivery.receiver import Receiver
from outbox.clock import ManualClock
from outbox.crypto import SecretBox, generate_key
from outbox.db import make_async_engine, make_engine, sqlalchemy_url
from outbox.embedded import EmbeddedPostgres
from outbox.migrate import upgrade


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow tests first: spread over the workers from the start, they run beside
    the others instead of after them, at the end of the run."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def _with_database(url: str, name: str) -> str:
    return make_url(sqlalchemy_url(url)).set(database=name).render_as_string(hide_password=False)


def _no_durability(url: str) -> None:
    """A throwaway server need not survive a power cut: without fsync, cloning the
    template for every test costs a fraction (the suite's largest fixed cost)."""
    engine = create_engine(sqlalchemy_url(url), isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        for setting in ("fsync", "synchronous_commit", "full_page_writes"):
            conn.execute(text(f"ALTER SYSTEM SET {setting} = off"))
        conn.execute(text("SELECT pg_reload_conf()"))
    engine.dispose()


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    configured = os.environ.get("OUTBOX_TEST_DATABASE_URL")
    if configured:
        yield configured
        return
    # Not under pytest's basetemp: pytest prunes old basetemp folders, which would pull
    # the data directory from under a server that another pytest run still uses.
    data_dir = Path(tempfile.mkdtemp(prefix="outbox-test-pg-"))
    server = EmbeddedPostgres(data_dir, delete_on_stop=True)
    url = server.start()
    _no_durability(url)
    try:
        yield url
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def admin_engine(server_url: str) -> Iterator[Engine]:
    engine = create_engine(sqlalchemy_url(server_url), isolation_level="AUTOCOMMIT")
    yield engine
    engine.dispose()


@pytest.fixture(scope="session")
def template_database(server_url: str, admin_engine: Engine) -> Iterator[str]:
    name = f"outbox_template_{uuid.uuid4().hex[:8]}"
    with admin_engine.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    engine = make_engine(_with_database(server_url, name))
    upgrade(engine)
    engine.dispose()
    yield name
    with admin_engine.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


# What a test could change besides rows: any object, column, default, function, trigger,
# constraint, index, grant, type, policy or database setting. Clones of the template
# share its catalog rows (and their oids), so one digest compares them.
_SCHEMA_DIGEST = """
SELECT md5(string_agg(x, '|' ORDER BY x)) FROM (
  SELECT concat_ws(':', 'c', c.oid, c.relname, c.relkind, c.relnatts, c.relhastriggers,
                   c.relrowsecurity, c.relacl, c.reloptions)
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
   WHERE n.nspname NOT IN ('pg_catalog', 'information_schema')
     AND n.nspname NOT LIKE 'pg\\_%'
  UNION ALL SELECT concat_ws(':', 'a', attrelid, attnum, attname, atttypid, attnotnull,
                             atthasdef, attisdropped, attgenerated)
    FROM pg_attribute WHERE attrelid >= 16384
  UNION ALL SELECT concat_ws(':', 'd', oid, md5(pg_get_expr(adbin, adrelid))) FROM pg_attrdef
  UNION ALL SELECT concat_ws(':', 'p', oid, proname, md5(prosrc), proconfig)
    FROM pg_proc WHERE oid >= 16384
  UNION ALL SELECT concat_ws(':', 't', oid, tgname, tgenabled) FROM pg_trigger
  UNION ALL SELECT concat_ws(':', 'k', oid, conname, convalidated)
    FROM pg_constraint WHERE oid >= 16384
  UNION ALL SELECT concat_ws(':', 'i', indexrelid, indisvalid, indisready)
    FROM pg_index WHERE indexrelid >= 16384
  UNION ALL SELECT concat_ws(':', 'n', oid, nspname, nspacl)
    FROM pg_namespace WHERE nspname NOT LIKE 'pg\\_%'
  UNION ALL SELECT concat_ws(':', 'e', oid, extname, extversion) FROM pg_extension
  UNION ALL SELECT concat_ws(':', 'y', oid, typname) FROM pg_type WHERE oid >= 16384
  UNION ALL SELECT concat_ws(':', 'r', oid, polname) FROM pg_policy
  UNION ALL SELECT concat_ws(':', 'v', oid, md5(ev_action::text))
    FROM pg_rewrite WHERE oid >= 16384
  UNION ALL SELECT concat_ws(':', 'q', seqrelid, seqincrement, seqmax, seqcycle)
    FROM pg_sequence
  UNION ALL SELECT concat_ws(':', 's', setconfig) FROM pg_db_role_setting
   WHERE setdatabase = (SELECT oid FROM pg_database WHERE datname = current_database())
  UNION ALL SELECT concat_ws(':', 'z', count(*)) FROM pg_stats WHERE schemaname = 'public'
) digest(x)
"""


class _Pristine:
    """What a clone of the template holds before any test: its schema digest, the rows of
    the tables the migrations seed, and every sequence's position."""

    def __init__(self, conn: Connection) -> None:
        self.schema = conn.execute(text(_SCHEMA_DIGEST)).scalar_one()
        self.tables = list(
            conn.execute(
                text("SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1")
            ).scalars()
        )
        self.seeds: dict[str, tuple[str, list[dict[str, Any]]]] = {}
        for table in self.tables:
            found = conn.execute(text(f'SELECT to_jsonb(t) AS row FROM "{table}" t')).scalars()
            seeded = list(found)
            if seeded:
                self.seeds[table] = (_rows_digest(conn, table), seeded)
        self.sequences = _sequences(conn)
        # Only a superuser may turn off the foreign-key triggers for the quick delete.
        self.superuser = bool(
            conn.execute(
                text("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
            ).scalar_one()
        )

    def dirty_tables(self, conn: Connection) -> list[str]:
        """The tables whose rows differ from the template's: one probe each, one statement."""
        probes = [
            f"SELECT '{t}' WHERE EXISTS (SELECT 1 FROM \"{t}\")"
            for t in self.tables
            if t not in self.seeds
        ] + [
            f"SELECT '{t}' WHERE ({_ROWS_DIGEST.format(table=t)}) <> '{digest}'"
            for t, (digest, _) in self.seeds.items()
        ]
        return list(conn.execute(text(" UNION ALL ".join(probes))).scalars())

    def _small(self, conn: Connection, tables: list[str]) -> bool:
        largest = conn.execute(
            text(
                "SELECT max(pg_relation_size(CAST(quote_ident(t) AS regclass))) "
                "FROM unnest(CAST(:tables AS text[])) AS t"
            ),
            {"tables": tables},
        ).scalar_one()
        return self.superuser and largest <= _SMALL_HEAP_BYTES

    def restore(self, conn: Connection) -> None:
        """Rows and sequences back to the template's (the schema is checked first)."""
        dirty = self.dirty_tables(conn)
        if dirty and self._small(conn, dirty):
            # A test's few rows: deleted, the foreign-key triggers off (every table that
            # holds a row is in `dirty`, so no row is left pointing at a deleted one).
            # A tenth of a TRUNCATE's cost, which gives every table the cascade reaches,
            # empty or not, and each of its indexes a new file.
            conn.execute(text("SET LOCAL session_replication_role = replica"))
            for table in dirty:
                conn.execute(text(f'DELETE FROM "{table}"'))
            conn.execute(text("SET LOCAL session_replication_role = origin"))
        elif dirty:
            listed = ", ".join(f'"{t}"' for t in dirty)
            # Not RESTART IDENTITY: it gives every sequence of every table the cascade
            # reaches a new file (it doubled a reset's cost); the sequences that moved are
            # set back below, in place.
            conn.execute(text(f"TRUNCATE {listed} CASCADE"))
        for table, (digest, seeded) in self.seeds.items():
            if _rows_digest(conn, table) != digest:
                columns = ", ".join(
                    f'"{c}"'
                    for c in conn.execute(
                        text(
                            "SELECT column_name FROM information_schema.columns WHERE "
                            "table_schema = 'public' AND table_name = :t "
                            "AND is_generated = 'NEVER' ORDER BY ordinal_position"
                        ),
                        {"t": table},
                    ).scalars()
                )
                conn.execute(text(f'DELETE FROM "{table}"'))
                conn.execute(
                    text(
                        f'INSERT INTO "{table}" ({columns}) OVERRIDING SYSTEM VALUE '
                        f"SELECT {columns} FROM "
                        f'jsonb_populate_recordset(NULL::"{table}", CAST(:rows AS jsonb))'
                    ),
                    {"rows": json.dumps(seeded)},
                )
        now = _sequences(conn)
        for sequence, (position, start) in self.sequences.items():
            if now.get(sequence, (None, None))[0] != position:
                # Never used in the template: back to its start, the next value being it.
                value, used = (start, False) if position is None else (position, True)
                conn.execute(
                    text("SELECT setval(CAST(:s AS regclass), :v, :used)"),
                    {"s": f'"{sequence}"', "v": value, "used": used},
                )


# The most a table's heap may hold for its rows to be deleted rather than truncated: a
# test's few rows (and what earlier deletes left until autovacuum came by), not a bulk
# load, whose dead rows would slow every test after it until then.
_SMALL_HEAP_BYTES = 8 * 8192

_ROWS_DIGEST = (
    "SELECT md5(coalesce(string_agg(t::text, ',' ORDER BY t::text), '')) FROM \"{table}\" t"
)


def _sequences(conn: Connection) -> dict[str, tuple[int | None, int]]:
    """Each sequence's last value (None: never used) and start."""
    found = conn.execute(
        text(
            "SELECT sequencename, last_value, start_value FROM pg_sequences "
            "WHERE schemaname = 'public'"
        )
    )
    return {str(name): (last, start) for name, last, start in found.all()}


def _rows_digest(conn: Connection, table: str) -> str:
    return str(conn.execute(text(_ROWS_DIGEST.format(table=table))).scalar_one())


class Clones:
    """Databases for tests, each as the template left it, made ready on a thread while
    the current test runs.

    A clone of the template costs PostgreSQL about 0.1 CPU-s (it copies the whole
    catalog), 1,700 of them a run on a CPU-bound box. So a database a test gives back is
    made pristine again and reused: its sessions are ended, it is renamed (a process the
    test left behind cannot reach the next test's database), its changed tables are
    emptied (`_Pristine.restore`) and the seeded rows and sequences put back. A database
    whose schema, settings or statistics changed, or that cannot be reset, is dropped and
    a new clone takes its place.
    """

    def __init__(self, server_url: str, admin: Engine, template: str) -> None:
        self._server_url, self._admin, self._template = server_url, admin, template
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clones")
        self._ready: deque[Future[str]] = deque([self._thread.submit(self._create)])
        self._pristine: _Pristine | None = None

    @staticmethod
    def _new_name() -> str:
        return f"outbox_test_{uuid.uuid4().hex[:12]}"

    def _create(self) -> str:
        name = self._new_name()
        with self._admin.connect() as conn:
            # FILE_COPY: copying the template's files (and a checkpoint, cheap without
            # fsync) measured 0.06 s a clone against WAL_LOG's 0.15 s, which writes every
            # block of the template to the WAL.
            conn.execute(
                text(f'CREATE DATABASE "{name}" TEMPLATE "{self._template}" STRATEGY FILE_COPY')
            )
        if self._pristine is None:
            with self._connect(name) as conn:
                self._pristine = _Pristine(conn)
        return name

    @contextlib.contextmanager
    def _connect(self, name: str) -> Iterator[Connection]:
        engine = create_engine(_with_database(self._server_url, name), poolclass=NullPool)
        try:
            with engine.begin() as conn:
                yield conn
        finally:
            engine.dispose()

    def _drop(self, name: str) -> None:
        with self._admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))

    def _reset(self, name: str) -> str:
        """The given-back database made pristine under a new name, or a new clone."""
        renamed = self._new_name()
        try:
            with self._admin.connect() as conn:
                conn.execute(text("SET lock_timeout = '2s'"))
                conn.execute(
                    text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = :name AND pid <> pg_backend_pid()"
                    ),
                    {"name": name},
                )
                for _ in range(200):  # ended sessions leave within milliseconds
                    left = conn.execute(
                        text("SELECT count(*) FROM pg_stat_activity WHERE datname = :name"),
                        {"name": name},
                    ).scalar_one()
                    if not left:
                        break
                    time.sleep(0.01)
                conn.execute(text(f'ALTER DATABASE "{name}" RENAME TO "{renamed}"'))
            name = renamed
            assert self._pristine is not None
            with self._connect(name) as conn:
                conn.execute(text("SET LOCAL lock_timeout = '2s'"))
                if conn.execute(text(_SCHEMA_DIGEST)).scalar_one() != self._pristine.schema:
                    raise LookupError("schema changed")
                self._pristine.restore(conn)
            return name
        except (LookupError, DBAPIError):
            self._drop(name)
            return self._create()

    def take(self) -> str:
        """A pristine database: one made ready ahead while the last test ran, and the next
        one started (a failed clone fails the test that takes it)."""
        taken = self._ready.popleft()
        if not self._ready:
            self._ready.append(self._thread.submit(self._create))
        return taken.result()

    def give_back(self, name: str) -> None:
        self._ready.append(self._thread.submit(self._reset, name))

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        failures: list[BaseException] = []
        for made in self._ready:
            failed = made.exception()
            if failed is None:
                self._drop(made.result())
            else:
                failures.append(failed)
        if failures:
            raise failures[0]  # a reset or clone that failed says so here, once


@pytest.fixture(scope="session")
def clones(server_url: str, admin_engine: Engine, template_database: str) -> Iterator[Clones]:
    made = Clones(server_url, admin_engine, template_database)
    yield made
    made.close()


@pytest.fixture
def database_url(server_url: str, clones: Clones) -> Iterator[str]:
    name = clones.take()
    yield _with_database(server_url, name)
    clones.give_back(name)


@pytest.fixture
def empty_database_url(server_url: str, admin_engine: Engine) -> Iterator[str]:
    name = f"outbox_empty_{uuid.uuid4().hex[:12]}"
    with admin_engine.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    yield _with_database(server_url, name)
    with admin_engine.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    engine = make_engine(database_url)
    yield engine
    engine.dispose()


@pytest.fixture
async def async_engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = make_async_engine(database_url)
    yield engine
    await engine.dispose()


@pytest.fixture
def clock() -> ManualClock:
    # Start at the real time so signatures carry a timestamp receivers accept.
    return ManualClock(dt.datetime.now(dt.UTC).replace(microsecond=0))


@pytest.fixture
def box() -> SecretBox:
    return SecretBox.from_setting(generate_key("test"))


@pytest.fixture(params=["httpx", "wire"])
def transport(request: pytest.FixtureRequest) -> str:
    """The HTTP wire under worker tests: httpx's own pool and our own wire, which
    production runs with (OUTBOX_HTTP_TRANSPORT), so a rule holds on both."""
    return str(request.param)


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    async with Receiver() as running:
        yield running
