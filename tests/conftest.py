"""Shared fixtures: one real PostgreSQL per session, a fresh database per test.

The server is the embedded one (or OUTBOX_TEST_DATABASE_URL when set). The schema
is migrated once into a template database; each test gets a clone of it, which is
much faster than migrating again.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, make_url, text
from sqlalchemy.ext.asyncio import AsyncEngine

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


class Clones:
    """Clones of the template made one ahead, on a thread, while the current test runs.

    Cloning the template is a test's largest fixed cost (a few hundred ms on a busy box);
    made ahead, it overlaps the test before instead of adding to it. Drops go the same
    way: a test's database is dropped while the next test runs.
    """

    def __init__(self, admin: Engine, template: str) -> None:
        self._admin, self._template = admin, template
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clones")
        self._next = self._thread.submit(self._create)
        self._drops: list[Future[None]] = []

    def _create(self) -> str:
        name = f"outbox_test_{uuid.uuid4().hex[:12]}"
        with self._admin.connect() as conn:
            # FILE_COPY: copying the template's files (and a checkpoint, cheap without
            # fsync) measured 0.06 s a clone against WAL_LOG's 0.15 s, which writes every
            # block of the template to the WAL; 1,600 clones a run.
            conn.execute(
                text(f'CREATE DATABASE "{name}" TEMPLATE "{self._template}" STRATEGY FILE_COPY')
            )
        return name

    def _drop(self, name: str) -> None:
        with self._admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))

    def take(self) -> str:
        """A fresh clone (a failed clone fails the test that takes it)."""
        taken, self._next = self._next, self._thread.submit(self._create)
        return taken.result()

    def give_back(self, name: str) -> None:
        self._drops.append(self._thread.submit(self._drop, name))

    def close(self) -> None:
        spare = self._next
        self._thread.shutdown(wait=True)
        for dropped in self._drops:
            dropped.result()  # a drop that failed says so here, once
        if spare.exception() is None:
            self._drop(spare.result())


@pytest.fixture(scope="session")
def clones(admin_engine: Engine, template_database: str) -> Iterator[Clones]:
    made = Clones(admin_engine, template_database)
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
