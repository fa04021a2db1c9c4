"""Fixtures of the outbox tests: databases migrated to an older revision, for the
migration tests (tests/conftest.py has the server, the head template and its clones)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest
from sqlalchemy import Engine, text

from outbox.db import make_engine
from outbox.migrate import upgrade


class SchemaTemplates:
    """One database per revision, migrated once (from the nearest lower one) and then
    cloned for each test that starts there.

    Migrating an empty database to 0019 runs nineteen migrations' DDL, seconds on a busy
    box; a clone is a file copy (as tests/conftest.py's Clones does for the head).
    """

    def __init__(self, admin: Engine) -> None:
        self._admin = admin
        self._made: dict[str, str] = {}  # revision -> template database

    def _url(self, database: str) -> str:
        return self._admin.url.set(database=database).render_as_string(hide_password=False)

    def _create(self, name: str, template: str | None) -> None:
        copy = f' TEMPLATE "{template}" STRATEGY FILE_COPY' if template else ""
        with self._admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"{copy}'))

    def drop(self, name: str) -> None:
        with self._admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))

    def _template(self, revision: str) -> str:
        if revision not in self._made:
            below = max((r for r in self._made if r < revision), default=None)
            name = f"outbox_at_{revision}_{uuid.uuid4().hex[:8]}"
            self._create(name, self._made[below] if below else None)
            engine = make_engine(self._url(name))
            try:
                upgrade(engine, revision)
            finally:
                engine.dispose()  # a template with a connection open cannot be copied
            self._made[revision] = name
        return self._made[revision]

    def clone(self, revision: str) -> tuple[str, str]:
        """A fresh database at `revision` (migrated there by `upgrade`): (name, URL)."""
        name = f"outbox_test_{revision}_{uuid.uuid4().hex[:12]}"
        self._create(name, self._template(revision))
        return name, self._url(name)

    def close(self) -> None:
        for name in self._made.values():
            self.drop(name)


@pytest.fixture(scope="session")
def schema_templates(admin_engine: Engine) -> Iterator[SchemaTemplates]:
    made = SchemaTemplates(admin_engine)
    yield made
    made.close()


@pytest.fixture
def migrated_to(schema_templates: SchemaTemplates) -> Iterator[Callable[[str], Engine]]:
    """`migrated_to("0019")`: an engine on a fresh database that `upgrade` brought to
    0019, as `upgrade(engine, "0019")` on an empty one would, without the wait."""
    made: list[tuple[str, Engine]] = []

    def at(revision: str) -> Engine:
        name, url = schema_templates.clone(revision)
        made.append((name, make_engine(url)))
        return made[-1][1]

    yield at
    for name, engine in made:
        engine.dispose()
        schema_templates.drop(name)
