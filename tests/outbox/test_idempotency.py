"""An idempotency key stands for one operation: the same key with other input (event type,
payload, ordering key) is refused in Python, in SQL and in the CLI, with nothing written;
the same input again, whatever its key order, answers the first event's id."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError

from delivery.operator.cli import main
from outbox import IdempotencyConflict, PublishError, publish
from outbox.tenants import create_tenant
from tests.helpers import rows, scalar

SQL_PUBLISH = text(
    "SELECT outbox_publish(:tenant, :type, CAST(:payload AS jsonb), :key, :ordering, NULL,"
    " NULL, NULL, :subject)"
)
SQL_PUBLISH_OLD_FORM = text(
    "SELECT outbox_publish(:tenant, :type, CAST(:payload AS jsonb), :key, :ordering)"
)


def _count(engine: Engine) -> int:
    return int(scalar(engine, "SELECT count(*) FROM outbox_events"))


@pytest.mark.parametrize(
    ("changed", "differs"),
    [
        ({"event_type": "invoice.voided"}, "event type"),
        ({"payload": {"id": "inv_7", "total": 11}}, "payload"),
        ({"payload": {"id": "inv_7", "total": 10.0}}, "payload"),  # 1.0 is not 1: see contract
        ({"payload": {"id": "inv_7"}}, "payload"),
        ({"ordering_key": "customer-2"}, "ordering key"),
        ({"ordering_key": None}, "ordering key"),
    ],
)
def test_the_same_key_with_other_input_is_refused_and_nothing_is_written(
    engine: Engine, changed: dict[str, Any], differs: str
) -> None:
    first_input: dict[str, Any] = {
        "event_type": "invoice.paid",
        "payload": {"id": "inv_7", "total": 10},
        "ordering_key": "customer-1",
    }
    with engine.begin() as conn:
        first = publish(conn, idempotency_key="op-1", **first_input)
    with engine.begin() as conn:
        with pytest.raises(IdempotencyConflict) as refused:
            publish(conn, idempotency_key="op-1", **{**first_input, **changed})
        # The caller's transaction is intact: it can go on and commit other work.
        publish(conn, "invoice.sent", {"id": "inv_7"})
    assert str(refused.value) == (
        f"idempotency key 'op-1' was already used by {first} with another {differs}: a key "
        "stands for one operation, so publish other input under a new key (nothing was written)"
    )
    assert (refused.value.message_id, refused.value.idempotency_key) == (first, "op-1")
    assert isinstance(refused.value, PublishError)
    assert _count(engine) == 2


def test_the_same_input_in_another_key_order_or_spacing_is_the_same_event(engine: Engine) -> None:
    with engine.begin() as conn:
        first = publish(conn, "a.b", {"x": 1, "y": {"p": [1, 2], "q": None}}, idempotency_key="k")
        again = publish(conn, "a.b", {"y": {"q": None, "p": [1, 2]}, "x": 1}, idempotency_key="k")
    assert first == again
    # Unkeyed events are never compared, so they skip the hashing.
    with engine.begin() as conn:
        publish(conn, "a.b", {"x": 1})
    hashes = rows(
        engine, "SELECT payload_hash IS NOT NULL AS hashed FROM outbox_events ORDER BY id"
    )
    assert [r["hashed"] for r in hashes] == [True, False]


def test_rows_from_before_the_hash_column_compare_by_their_payload(engine: Engine) -> None:
    """A row with payload_hash NULL (published before migration 0028, or by the previous
    release during a rolling upgrade) is hashed on the fly, the same way."""
    with engine.begin() as conn:
        first = publish(conn, "a.b", {"b": 2, "a": 1}, idempotency_key="old")
        conn.execute(text("UPDATE outbox_events SET payload_hash = NULL"))
    with engine.begin() as conn:
        assert publish(conn, "a.b", {"a": 1, "b": 2}, idempotency_key="old") == first
        with pytest.raises(IdempotencyConflict, match="another payload"):
            publish(conn, "a.b", {"a": 1, "b": 3}, idempotency_key="old")
    assert _count(engine) == 1


def test_keys_stay_per_tenant(engine: Engine) -> None:
    with engine.begin() as conn:
        create_tenant(conn, "acme")
        mine = publish(conn, "a.b", {"n": 1}, idempotency_key="k")
        theirs = publish(conn, "a.b", {"n": 2}, idempotency_key="k", tenant="acme")
    assert mine != theirs


def _blocked_on_a_lock(engine: Engine, deadline: float = 10.0) -> None:
    """Wait until some session waits on a lock (the racing insert), or fail."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        waiting = scalar(
            engine,
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND query LIKE '%outbox%' AND pid <> pg_backend_pid()",
        )
        if waiting:
            return
        time.sleep(0.01)
    pytest.fail("the second publish never waited for the first")


def _race(engine: Engine, second: Callable[[Any], str]) -> tuple[str, str | BaseException]:
    """Publish key "race" in a transaction left open while `second` publishes the same key
    in another one (it waits on the unique index), then commit the first."""
    outcome: list[str | BaseException] = []

    def run_second() -> None:
        try:
            with engine.begin() as conn:
                outcome.append(second(conn))
        except BaseException as exc:
            outcome.append(exc)

    with engine.begin() as conn:
        first = publish(conn, "a.b", {"v": 1}, idempotency_key="race")
        racer = threading.Thread(target=run_second)
        racer.start()
        _blocked_on_a_lock(engine)
    racer.join(timeout=10)
    assert not racer.is_alive()
    return first, outcome[0]


def test_a_racing_publish_of_the_same_key_is_compared_once_the_first_commits(
    engine: Engine,
) -> None:
    """The in-flight case: the insert waits for the other transaction, then finds its row
    with a fresh snapshot (FIND_EVENT_BY_IDEMPOTENCY_KEY) and compares it there."""
    first, other = _race(engine, lambda c: publish(c, "a.b", {"v": 2}, idempotency_key="race"))
    assert isinstance(other, IdempotencyConflict) and other.message_id == first
    assert _count(engine) == 1


def test_a_racing_publish_of_the_same_input_gets_the_first_id(engine: Engine) -> None:
    first, same = _race(engine, lambda c: publish(c, "a.b", {"v": 1}, idempotency_key="race"))
    assert same == first
    assert _count(engine) == 1


def test_a_racing_sql_publish_with_other_input_is_refused_too(engine: Engine) -> None:
    def sql(conn: Any) -> str:
        params = {"tenant": None, "type": "a.b", "payload": '{"v": 3}', "key": "race"}
        return str(conn.execute(SQL_PUBLISH_OLD_FORM, {**params, "ordering": None}).scalar())

    first, other = _race(engine, sql)
    assert isinstance(other, DBAPIError)
    assert getattr(other.orig, "sqlstate", None) == "OB409"
    assert first in str(other)
    assert _count(engine) == 1


def _sql(conn: Any, payload: str, **given: Any) -> str:
    params = {"tenant": None, "type": "a.b", "key": "k", "ordering": None, "subject": None}
    return str(conn.execute(SQL_PUBLISH, {**params, **given, "payload": payload}).scalar_one())


def test_sql_publish_refuses_other_input_with_its_own_sqlstate(engine: Engine) -> None:
    with engine.begin() as conn:
        first = _sql(conn, '{"a": 1, "b": [1, 2]}', subject="invoice/inv_7")
    with engine.begin() as conn:
        # whitespace and key order are not input; the eight-argument form is the same function
        assert _sql(conn, '{ "b":[1,2],"a":1 }') == first
        old_form = {"tenant": None, "type": "a.b", "key": "k", "ordering": None}
        payload = '{"b": [1, 2], "a": 1}'
        assert conn.execute(SQL_PUBLISH_OLD_FORM, {**old_form, "payload": payload}).scalar() == (
            first
        )
    for changed, differs in (
        ({"payload": '{"a": 1, "b": [2, 1]}'}, "payload"),
        ({"payload": '{"a": 1, "b": [1, 2]}', "type": "a.c"}, "event type"),
        ({"payload": '{"a": 1, "b": [1, 2]}', "ordering": "o"}, "ordering key"),
    ):
        with engine.begin() as conn, pytest.raises(DBAPIError) as refused:
            _sql(conn, **changed)
        assert getattr(refused.value.orig, "sqlstate", None) == "OB409"
        assert f"idempotency key 'k' was already used by {first} with another {differs}" in str(
            refused.value
        )
        assert "publish other input under a new key" in str(refused.value)  # the HINT
    assert rows(engine, "SELECT message_id, subject FROM outbox_events") == [
        {"message_id": first, "subject": "invoice/inv_7"}
    ]


def test_python_and_sql_publish_agree_on_what_the_same_payload_is(engine: Engine) -> None:
    """One canonical form (the database's jsonb text) for both paths."""
    payload = {"z": "ünï", "a": [1.5, {"y": True, "x": None}], "n": 10}
    with engine.begin() as conn:
        first = publish(conn, "a.b", payload, idempotency_key="k")
        reordered = json.dumps(dict(reversed(list(payload.items()))))
        assert _sql(conn, reordered) == first
        with pytest.raises(DBAPIError, match="another payload"):
            _sql(conn, json.dumps({**payload, "n": 10.0}))


@pytest.mark.parametrize("subject", ["x" * 256, "invoice/\ninv_7", "", "tab\there"])
def test_sql_publish_refuses_hostile_subjects(engine: Engine, subject: str) -> None:
    with engine.begin() as conn, pytest.raises(DBAPIError, match="subject must be 1 to 255"):
        _sql(conn, "{}", subject=subject, key=None)
    assert _count(engine) == 0


def test_the_cli_refuses_other_input_under_a_used_key(
    database_url: str, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    cli = CliRunner()
    args = ["publish", "order.created", "--idempotency-key", "k1", "--subject", "order/1"]
    first = cli.invoke(main, [*args[:2], '{"id": 1, "x": 2}', *args[2:]], catch_exceptions=False)
    assert first.exit_code == 0, first.output
    message_id = first.output.strip()
    again = cli.invoke(main, [*args[:2], '{"x": 2, "id": 1}', *args[2:]])
    assert (again.exit_code, again.output.strip()) == (0, message_id)
    other = cli.invoke(main, [*args[:2], '{"id": 2}', *args[2:]])
    assert other.exit_code == 1
    assert other.output == (
        f"Error: idempotency key 'k1' was already used by {message_id} with another payload: "
        "a key stands for one operation, so publish other input under a new key (nothing was "
        "written)\n"
    )
    bad = cli.invoke(main, [*args[:2], "{}", "--subject", "a\x07b"])
    assert bad.exit_code == 1 and "control character" in bad.output
    assert rows(engine, "SELECT message_id, subject FROM outbox_events") == [
        {"message_id": message_id, "subject": "order/1"}
    ]


# Text PostgreSQL can store (publish() refuses NUL and lone surrogates before comparing).
_TEXT = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=6
)
_SCALARS = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | _TEXT


def _containers(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4)


_JSON = st.recursive(_SCALARS, _containers, max_leaves=12)
_OBJECTS = st.dictionaries(_TEXT, _JSON, max_size=6)


def _reordered(value: Any, rng: random.Random) -> Any:
    """The same JSON value with every object's keys in another order."""
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {key: _reordered(item, rng) for key, item in items}
    if isinstance(value, list):
        return [_reordered(item, rng) for item in value]
    return value


# Each example rolls its transaction back, so sharing the engine between them is safe.
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(payload=_OBJECTS, other=_OBJECTS, seed=st.integers(0, 2**32))
def test_the_comparison_agrees_with_json_equality(
    engine: Engine, payload: dict[str, Any], other: dict[str, Any], seed: int
) -> None:
    """Against a reference (Python's equality of the decoded values; no floats, whose
    written form is part of the input): a reordered copy is the same event, and another
    value is a conflict, from publish() and from outbox_publish() alike."""
    with engine.connect() as conn:
        conn.begin()
        first = publish(conn, "a.b", payload, idempotency_key="p")
        same = _reordered(payload, random.Random(seed))
        assert publish(conn, "a.b", same, idempotency_key="p") == first
        assert _sql(conn, json.dumps(same), key="p") == first
        if other != payload:
            with pytest.raises(IdempotencyConflict):
                publish(conn, "a.b", other, idempotency_key="p")
        conn.rollback()
