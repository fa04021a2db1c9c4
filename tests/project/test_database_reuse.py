"""The per-test database fixture: a database a test gives back is reused only when it is
as the template left it (tests/conftest.py `Clones`)."""

from __future__ import annotations

from sqlalchemy import Engine, create_engine, text
from sqlalchemy.pool import NullPool

from outbox import publish
from outbox.crypto import SecretBox
from tests.conftest import Clones, _with_database
from tests.helpers import add_endpoint, scalar


def _engine(server_url: str, name: str) -> Engine:
    return create_engine(_with_database(server_url, name), poolclass=NullPool)


def _state(engine: Engine) -> dict[str, object]:
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
    return {"rows": rows, "sequences": sequences}


def test_a_given_back_database_comes_back_as_the_template_left_it(
    server_url: str, clones: Clones, box: SecretBox
) -> None:
    first = clones.take()
    engine = _engine(server_url, first)
    pristine = _state(engine)
    add_endpoint(engine, box, "http://127.0.0.1:9/hook")
    with engine.begin() as conn:
        publish(conn, "order.created", {"id": 1})
        conn.execute(text("UPDATE tenants SET name = 'renamed'"))
        conn.execute(text("INSERT INTO tenants (uid, name) VALUES ('extra', 'extra')"))
        for sequence in conn.execute(text("SELECT sequencename FROM pg_sequences")).scalars():
            conn.execute(text("SELECT nextval(:s)"), {"s": sequence})
    left_open = engine.connect()  # a session the test forgot: it must not block the reset
    assert _state(engine) != pristine
    clones.give_back(first)
    # The one made ahead comes first; then the given-back one, reset and renamed.
    ahead = clones.take()
    again = clones.take()
    assert again != first  # renamed: a leftover process cannot reach it
    assert _state(_engine(server_url, again)) == pristine
    left_open.invalidate()
    engine.dispose()
    for name in (ahead, again):
        clones.give_back(name)


def test_a_database_whose_schema_changed_is_replaced_by_a_new_clone(
    server_url: str, clones: Clones
) -> None:
    first = clones.take()
    engine = _engine(server_url, first)
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE deliveries ADD COLUMN scratch int"))
    engine.dispose()
    clones.give_back(first)
    ahead = clones.take()
    again = clones.take()
    replaced = _engine(server_url, again)
    columns = scalar(
        replaced,
        "SELECT count(*) FROM information_schema.columns WHERE table_name = 'deliveries' "
        "AND column_name = 'scratch'",
    )
    replaced.dispose()
    assert columns == 0
    for name in (ahead, again):
        clones.give_back(name)
