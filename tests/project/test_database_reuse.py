"""The per-test database fixture: a database a test gives back is reused only when it is
as the template left it (tests/conftest.py `Clones`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.pool import NullPool

from outbox import publish
from outbox.crypto import SecretBox
from tests.conftest import Clones, _with_database
from tests.helpers import add_endpoint, scalar


@pytest.fixture
def own_clones(server_url: str, admin_engine: Engine, template_database: str) -> Iterator[Clones]:
    """A pool of its own, so the order of what it hands out is known."""
    made = Clones(server_url, admin_engine, template_database)
    yield made
    made.close()


def _engine(server_url: str, name: str) -> Engine:
    return create_engine(_with_database(server_url, name), poolclass=NullPool)


def _oid(server_url: str, name: str) -> int:
    """A database keeps its oid when renamed: the same oid is the same database, reused."""
    engine = _engine(server_url, name)
    found = scalar(engine, "SELECT oid FROM pg_database WHERE datname = current_database()")
    engine.dispose()
    return int(found)


def _state(server_url: str, name: str) -> dict[str, object]:
    engine = _engine(server_url, name)
    with engine.connect() as conn:
        tables = conn.execute(
            text("SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1")
        ).scalars()
        rows = {
            t: conn.execute(text(f'SELECT to_jsonb(x)::text FROM "{t}" x ORDER BY 1')).all()
            for t in tables
        }
        sequences = conn.execute(
            text("SELECT sequencename, last_value FROM pg_sequences ORDER BY 1")
        ).all()
    engine.dispose()
    return {"rows": rows, "sequences": sequences}


def _given_back_and_taken_again(clones: Clones, name: str) -> str:
    clones.give_back(name)
    clones.give_back(clones.take())  # the one made ahead while the first was in use
    return clones.take()


def test_rows_and_sequences_are_reset_in_the_same_database_under_a_new_name(
    server_url: str, own_clones: Clones, box: SecretBox
) -> None:
    first = own_clones.take()
    pristine, oid = _state(server_url, first), _oid(server_url, first)
    engine = _engine(server_url, first)
    add_endpoint(engine, box, "http://127.0.0.1:9/hook")
    with engine.begin() as conn:
        publish(conn, "order.created", {"id": 1})
        for sequence in conn.execute(text("SELECT sequencename FROM pg_sequences")).scalars():
            conn.execute(text("SELECT nextval(:s)"), {"s": sequence})
    left_open = engine.connect()  # a session the test forgot: it must not block the reset
    assert _state(server_url, first) != pristine
    again = _given_back_and_taken_again(own_clones, first)
    assert again != first  # renamed: a process left behind cannot reach it
    assert _oid(server_url, again) == oid  # the same database, reset, not a new clone
    assert _state(server_url, again) == pristine
    left_open.invalidate()
    engine.dispose()
    own_clones.give_back(again)


def test_the_rows_the_migrations_seed_are_put_back(server_url: str, own_clones: Clones) -> None:
    first = own_clones.take()
    pristine, oid = _state(server_url, first), _oid(server_url, first)
    engine = _engine(server_url, first)
    with engine.begin() as conn:
        conn.execute(text("UPDATE tenants SET name = 'renamed'"))
        conn.execute(text("INSERT INTO tenants (uid, name) VALUES ('extra', 'extra')"))
    engine.dispose()
    again = _given_back_and_taken_again(own_clones, first)
    assert _oid(server_url, again) == oid
    assert _state(server_url, again) == pristine
    own_clones.give_back(again)


def test_a_database_whose_schema_changed_is_replaced_by_a_new_clone(
    server_url: str, own_clones: Clones
) -> None:
    first = own_clones.take()
    oid = _oid(server_url, first)
    engine = _engine(server_url, first)
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE deliveries ADD COLUMN scratch int"))
    engine.dispose()
    again = _given_back_and_taken_again(own_clones, first)
    replaced = _engine(server_url, again)
    columns = scalar(
        replaced,
        "SELECT count(*) FROM information_schema.columns WHERE table_name = 'deliveries' "
        "AND column_name = 'scratch'",
    )
    replaced.dispose()
    assert columns == 0
    assert _oid(server_url, again) != oid  # dropped, and a new clone in its place
    own_clones.give_back(again)


def test_a_bulk_load_is_truncated_not_deleted_and_still_comes_back_pristine(
    server_url: str, own_clones: Clones
) -> None:
    """Past a few pages a table is truncated (its dead rows would slow later tests)."""
    first = own_clones.take()
    pristine, oid = _state(server_url, first), _oid(server_url, first)
    engine = _engine(server_url, first)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO tenants (uid, name) SELECT 'bulk-' || g, repeat('x', 100) "
                "FROM generate_series(1, 2000) AS g"
            )
        )
    heap = scalar(engine, "SELECT pg_relation_size('tenants')")
    engine.dispose()
    assert heap > 8 * 8192  # past the quick delete's limit
    again = _given_back_and_taken_again(own_clones, first)
    assert _oid(server_url, again) == oid
    assert _state(server_url, again) == pristine
    engine = _engine(server_url, again)
    assert scalar(engine, "SELECT pg_relation_size('tenants')") < heap  # a new, small file
    engine.dispose()
    own_clones.give_back(again)
