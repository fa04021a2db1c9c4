"""publish() writes in the caller's transaction, deduplicates by key and refuses bad input."""

from __future__ import annotations

import datetime as dt
import decimal

import psycopg
import pytest
from psycopg.rows import dict_row
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from outbox import IdempotencyConflict, PublishError, publish, publish_async
from outbox.db import libpq_url


def _event_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM outbox_events")).scalar_one())


def test_rolled_back_transaction_leaves_no_event(engine: Engine) -> None:
    with engine.connect() as conn:
        transaction = conn.begin()
        message_id = publish(conn, "order.created", {"id": 1})
        assert message_id.startswith("msg_")
        transaction.rollback()
    assert _event_count(engine) == 0


def test_publish_never_commits_on_its_own(engine: Engine) -> None:
    with engine.connect() as conn:
        publish(conn, "order.created", {"id": 1})
        # Closing without commit discards the event: publish did not commit for us.
    assert _event_count(engine) == 0


def test_committed_event_is_stored_as_given(engine: Engine) -> None:
    with engine.begin() as conn:
        message_id = publish(
            conn, "order.created", {"id": 7, "name": "ünïcode"}, ordering_key="cust-1"
        )
    with engine.connect() as conn:
        row = conn.execute(text("SELECT * FROM outbox_events")).mappings().one()
    assert row["message_id"] == message_id
    assert row["event_type"] == "order.created"
    assert row["payload"] == {"id": 7, "name": "ünïcode"}
    assert row["ordering_key"] == "cust-1"
    assert row["relayed_at"] is None


def test_session_is_accepted(engine: Engine) -> None:
    with Session(engine) as session, session.begin():
        publish(session, "invoice.paid", {"invoice": "inv_1"})
    assert _event_count(engine) == 1


def test_same_idempotency_key_gives_one_event(engine: Engine) -> None:
    with engine.begin() as conn:
        first = publish(conn, "invoice.paid", {"n": 1}, idempotency_key="inv-1")
        again = publish(conn, "invoice.paid", {"n": 1}, idempotency_key="inv-1")
    with engine.begin() as conn:
        later = publish(conn, "invoice.paid", {"n": 1}, idempotency_key="inv-1")
        other = publish(conn, "invoice.paid", {"n": 4}, idempotency_key="inv-2")
    assert first == again == later
    assert other != first
    assert _event_count(engine) == 2


async def test_async_connection_and_session(async_engine: AsyncEngine, engine: Engine) -> None:
    async with async_engine.begin() as conn:
        first = await publish_async(conn, "order.created", {"id": 1}, idempotency_key="k")
        again = await publish_async(conn, "order.created", {"id": 1}, idempotency_key="k")
    async with AsyncSession(async_engine) as session, session.begin():
        await publish_async(session, "order.updated", {"id": 1})
    async with async_engine.connect() as conn:
        await publish_async(conn, "order.deleted", {"id": 1})
        await conn.rollback()
    assert first == again
    assert _event_count(engine) == 2


def test_a_psycopg_connection_publishes_in_its_own_transaction(
    engine: Engine, database_url: str
) -> None:
    """Applications without SQLAlchemy pass their psycopg connection; whatever row factory
    they set on it, publish reads its own rows."""
    with psycopg.connect(libpq_url(database_url), row_factory=dict_row) as conn:
        publish(conn, "order.created", {"id": 1})
        conn.rollback()
        first = publish(conn, "order.created", {"id": 2}, idempotency_key="k", priority=5)
        assert publish(conn, "order.created", {"id": 2}, idempotency_key="k") == first
        with pytest.raises(IdempotencyConflict, match=first):
            publish(conn, "order.created", {"id": 3}, idempotency_key="k")
        with pytest.raises(PublishError, match="unknown tenant 'nobody'"):
            publish(conn, "order.created", {"id": 4}, tenant="nobody")
        with pytest.raises(PublishError, match="JSON object"):
            publish(conn, "order.created", ["no"])
        conn.commit()
        publish(conn, "order.created", {"id": 5})
        # closing without commit (the block ends in rollback here): publish did not commit
        conn.rollback()
    with engine.connect() as conn:
        stored = conn.execute(text("SELECT message_id, payload, priority FROM outbox_events"))
        assert [tuple(row) for row in stored] == [(first, {"id": 2}, 5)]


async def test_a_psycopg_async_connection_publishes_in_its_own_transaction(
    engine: Engine, database_url: str
) -> None:
    async with await psycopg.AsyncConnection.connect(
        libpq_url(database_url), row_factory=dict_row
    ) as conn:
        await publish_async(conn, "order.created", {"id": 1})
        await conn.rollback()
        first = await publish_async(conn, "order.created", {"id": 2}, idempotency_key="k")
        assert await publish_async(conn, "order.created", {"id": 2}, idempotency_key="k") == first
        with pytest.raises(IdempotencyConflict, match=first):
            await publish_async(conn, "order.created", {"id": 3}, idempotency_key="k")
        with pytest.raises(PublishError, match="unknown tenant 'nobody'"):
            await publish_async(conn, "order.created", {"id": 4}, tenant="nobody")
        await conn.commit()
        await publish_async(conn, "order.created", {"id": 5})
        await conn.rollback()
    with engine.connect() as conn:
        stored = conn.execute(text("SELECT message_id, payload FROM outbox_events"))
        assert [tuple(row) for row in stored] == [(first, {"id": 2})]


@pytest.mark.parametrize(
    ("event_type", "payload", "message"),
    [
        ("", {}, "event type"),
        ("order created", {}, "event type"),
        ("order..created", {}, "event type"),
        (".order", {}, "event type"),
        ("order.created", ["not", "an", "object"], "JSON object"),
        ("order.created", {"when": dt.datetime(2024, 1, 1)}, "not JSON-serialisable"),
        ("order.created", {"price": decimal.Decimal("1.5")}, "not JSON-serialisable"),
        ("order.created", {"x": float("nan")}, "not JSON-serialisable"),
        ("order.created", {"x": "nul\x00byte"}, "NUL"),
        ("order.created", {"blob": "x" * (64 * 1024)}, "over the 65536-byte limit"),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(
    engine: Engine, event_type: str, payload: object, message: str
) -> None:
    with engine.connect() as conn, conn.begin():
        with pytest.raises(PublishError, match=message):
            publish(conn, event_type, payload)
        # The caller's transaction is still usable: nothing failed inside the database.
        publish(conn, "order.created", {"ok": True})
    assert _event_count(engine) == 1


def test_payload_limit_is_configurable(engine: Engine) -> None:
    with engine.begin() as conn:
        with pytest.raises(PublishError, match="over the 10-byte limit"):
            publish(conn, "a.b", {"long": "enough"}, max_payload_bytes=10)
        publish(conn, "a.b", {"blob": "x" * 70_000}, max_payload_bytes=100_000)
    assert _event_count(engine) == 1


def test_bad_keys_and_priority_are_refused(engine: Engine) -> None:
    with engine.begin() as conn:
        with pytest.raises(PublishError, match="idempotency_key"):
            publish(conn, "a.b", {}, idempotency_key="")
        with pytest.raises(PublishError, match="ordering_key"):
            publish(conn, "a.b", {}, ordering_key="k" * 300)
        with pytest.raises(PublishError, match="priority"):
            publish(conn, "a.b", {}, priority=1000)
    assert _event_count(engine) == 0


def test_only_an_event_that_finds_no_backlog_wakes_the_relay(
    engine: Engine, database_url: str
) -> None:
    """Debounced NOTIFY: notifying commits are serialised by PostgreSQL, so send few."""
    with psycopg.connect(libpq_url(database_url), autocommit=True) as listener:
        listener.execute('LISTEN "outbox_events"')

        def notifications() -> int:
            return sum(1 for _ in listener.notifies(timeout=0.2))

        with engine.begin() as conn:
            first = publish(conn, "order.created", {"id": 1})
        assert notifications() == 1
        with engine.begin() as conn:
            publish(conn, "order.created", {"id": 2})
            publish(conn, "order.created", {"id": 3})
        assert notifications() == 0  # the relay has a backlog to wake it already
        with engine.begin() as conn:
            conn.execute(text("UPDATE outbox_events SET relayed_at = now()"))
        with engine.begin() as conn:
            again = publish(conn, "order.created", {"id": 4}, idempotency_key="k")
            assert publish(conn, "order.created", {"id": 4}, idempotency_key="k") == again
        assert notifications() == 1
    assert first != again


def _nested(depth: int) -> dict[str, object]:
    """A payload `depth` levels deep: {"a": {"a": ... {"a": 1}}}."""
    payload: dict[str, object] = {"a": 1}
    for _ in range(depth - 1):
        payload = {"a": payload}
    return payload


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"payload": {"nul\x00key": 1}}, "NUL"),
        ({"payload": {"list": ["ok", "nul\x00"]}}, "NUL"),
        ({"payload": {"x": "lone \ud800 surrogate"}}, "lone surrogate"),
        ({"payload": {"lone \udfff": 1}}, "lone surrogate"),
        ({"payload": _nested(65)}, "deeper than 64 levels"),
        ({"payload": _nested(990)}, "deeper than 64 levels"),
        ({"payload": {"deep": [[[[1]]]]}, "max_payload_depth": 3}, "deeper than 3 levels"),
        ({"idempotency_key": "nul\x00key"}, "idempotency_key contains a NUL"),
        ({"ordering_key": "nul\x00key"}, "ordering_key contains a NUL"),
        ({"idempotency_key": "lone \ud800"}, "idempotency_key contains"),
        ({"ordering_key": "bell\x07"}, "ordering_key contains"),
    ],
)
def test_every_bad_input_is_a_publish_error_and_writes_nothing(
    engine: Engine, kwargs: dict[str, object], message: str
) -> None:
    """NUL in keys used to leak DataError, surrogates UnicodeEncodeError, depth RecursionError."""
    args: dict[str, object] = {"payload": {"ok": True}, **kwargs}
    payload = args.pop("payload")
    with engine.connect() as conn, conn.begin():
        with pytest.raises(PublishError, match=message):
            publish(conn, "order.created", payload, **args)  # type: ignore[arg-type]
        publish(conn, "order.created", {"ok": True})  # the transaction is still usable
    assert _event_count(engine) == 1


def test_a_self_referencing_payload_is_refused_not_looped_over(engine: Engine) -> None:
    loop: dict[str, object] = {}
    loop["me"] = loop
    with engine.begin() as conn, pytest.raises(PublishError, match="refers to itself"):
        publish(conn, "order.created", loop)


def test_harmless_text_that_looks_like_an_escape_is_accepted(engine: Engine) -> None:
    """The six characters backslash-u-0-0-0-0 are ordinary text, not a NUL."""
    text_value = "\\u0000"
    assert len(text_value) == 6
    with engine.begin() as conn:
        publish(conn, "order.created", {"path": text_value, text_value: "key", "tab": "a\tb"})
    with engine.connect() as conn:
        stored = conn.execute(text("SELECT payload FROM outbox_events")).scalar_one()
    assert stored == {"path": text_value, text_value: "key", "tab": "a\tb"}


def test_depth_cap_accepts_exactly_the_limit_and_is_itself_bounded(engine: Engine) -> None:
    with engine.begin() as conn:
        publish(conn, "order.created", _nested(64))
        publish(conn, "order.created", _nested(100), max_payload_depth=100)
        with pytest.raises(PublishError, match="max_payload_depth must be an integer"):
            publish(conn, "order.created", {}, max_payload_depth=100_000)
    assert _event_count(engine) == 2
