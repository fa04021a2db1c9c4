"""The event types the service publishes itself are refused to applications in every way
they publish: publish(), outbox_publish() (SQLSTATE OB403) and `outbox publish`; the
database's list (outbox_operational_event_types(), migration 0040) is Python's, so the two
cannot drift apart unnoticed."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import DBAPIError

from delivery.operator.cli import main
from outbox import PublishError, publish
from outbox.catalogue import OPERATIONAL_EVENT_TYPES
from tests.helpers import scalar

SQL_PUBLISH = text("SELECT outbox_publish(NULL, :type, CAST('{}' AS jsonb))")
SQL_PUBLISH_WITH_SUBJECT = text(
    "SELECT outbox_publish(NULL, :type, CAST('{}' AS jsonb), NULL, NULL, NULL, NULL, NULL,"
    " 'order/1')"
)


def test_the_database_reserves_exactly_the_types_python_reserves(engine: Engine) -> None:
    """A new operational type in outbox.catalogue needs a migration that replaces
    outbox_operational_event_types(): this fails until it has one."""
    with engine.connect() as conn:
        reserved = conn.execute(text("SELECT outbox_operational_event_types()")).scalar_one()
    assert sorted(reserved) == sorted(OPERATIONAL_EVENT_TYPES)
    assert len(set(reserved)) == len(reserved)


@pytest.mark.parametrize("event_type", OPERATIONAL_EVENT_TYPES)
def test_sql_publish_refuses_each_operational_type_with_its_own_sqlstate(
    engine: Engine, event_type: str
) -> None:
    for statement in (SQL_PUBLISH, SQL_PUBLISH_WITH_SUBJECT):
        with engine.begin() as conn, pytest.raises(DBAPIError) as refused:
            conn.execute(statement, {"type": event_type})
        assert getattr(refused.value.orig, "sqlstate", None) == "OB403"
        message = str(refused.value)
        assert f"'{event_type}' is an operational event the service publishes itself" in message
        # the HINT says what to do and which names are taken
        assert "choose another event type; reserved: " + ", ".join(OPERATIONAL_EVENT_TYPES) in (
            message
        )
    with engine.begin() as conn, pytest.raises(PublishError, match="operational event"):
        publish(conn, event_type, {})
    assert scalar(engine, "SELECT count(*) FROM outbox_events") == 0


def test_the_cli_refuses_an_operational_type_and_writes_nothing(
    database_url: str, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    refused = CliRunner().invoke(main, ["publish", "delivery.held", '{"id": 1}'])
    assert refused.exit_code == 1
    assert refused.output == (
        "Error: 'delivery.held' is an operational event the service publishes itself; "
        "choose another event type\n"
    )
    assert scalar(engine, "SELECT count(*) FROM outbox_events") == 0


def _sql_refuses(conn: Connection, event_type: str) -> bool:
    savepoint = conn.begin_nested()
    try:
        conn.execute(SQL_PUBLISH, {"type": event_type})
    except DBAPIError as exc:
        savepoint.rollback()
        if getattr(exc.orig, "sqlstate", None) == "OB403":
            return True
        raise
    savepoint.rollback()
    return False


def _python_refuses(conn: Connection, event_type: str) -> bool:
    try:
        publish(conn, event_type, {})
    except PublishError as exc:
        assert "operational event" in str(exc)
        return True
    return False


_WORD = st.sampled_from(["endpoint", "delivery", "tenant", "dead", "held", "disabled", "x"])
_NAMES = st.sampled_from(OPERATIONAL_EVENT_TYPES) | st.lists(_WORD, min_size=1, max_size=3).map(
    ".".join
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(event_type=_NAMES)
def test_sql_and_python_refuse_the_same_names(engine: Engine, event_type: str) -> None:
    """Near names (`delivery.held.x`, `delivery`) are ordinary types in both; only the exact
    reserved names are refused, by both. Each example rolls back."""
    with engine.connect() as conn:
        conn.begin()
        sql = _sql_refuses(conn, event_type)
        python = _python_refuses(conn, event_type)
        conn.rollback()
    assert sql == python == (event_type in OPERATIONAL_EVENT_TYPES)
