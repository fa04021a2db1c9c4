"""Replays happen exactly once per request, even when operators race each other.

Concurrency here is real: each replay runs on its own connection in its own thread.
To make the race certain rather than likely, one replay is held open (its transaction
not yet committed) while the others start; the test waits until each of them has
either finished or is blocked on a row lock, then lets the first commit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import IntegrityError

from delivery.operator.cli import main
from outbox import deliveries as delivery_ops
from outbox.clock import ManualClock
from outbox.crypto import SecretBox, generate_key
from outbox.errors import OperationError
from outbox.migrate import upgrade
from outbox.relay import Relay
from tests.helpers import add_endpoint, scalar
from tests.operator_helpers import publish_many


async def _dead_deliveries(
    engine: Engine, async_engine: Any, box: SecretBox, clock: ManualClock, count: int
) -> list[int]:
    """`count` dead deliveries, made by the relay and then marked dead (no HTTP needed)."""
    add_endpoint(engine, box, "https://partner.example/hooks", "*")
    publish_many(engine, "order.created", count)
    await Relay(async_engine, clock).run_until_idle()
    with engine.begin() as conn:
        ids = conn.execute(
            text(
                "UPDATE deliveries SET state = 'dead', attempts = 1, completed_at = now(),"
                " final_reason = '500 Internal Server Error' RETURNING id"
            )
        ).scalars()
        return sorted(int(i) for i in ids)


def _replays_per_original(engine: Engine) -> dict[int, int]:
    with engine.connect() as conn:
        found = conn.execute(
            text(
                "SELECT replay_of, count(*) FROM deliveries WHERE replay_of IS NOT NULL"
                " GROUP BY replay_of"
            )
        )
        return {int(row[0]): int(row[1]) for row in found}


def _blocked_or_done(engine: Engine, threads: list[threading.Thread], waiting: int) -> None:
    """Wait (bounded) until every thread has finished or is waiting on a lock."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        alive = sum(t.is_alive() for t in threads)
        locked = scalar(
            engine,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock'",
        )
        if alive == 0 or locked >= min(alive, waiting):
            return
        time.sleep(0.02)  # polling for another session's state, not simulating time
    raise AssertionError("the concurrent replays neither finished nor blocked")


def _race(
    engine: Engine,
    first: Callable[[Connection], Any],
    others: list[Callable[[Connection], Any]],
) -> tuple[Any, list[Any]]:
    """Run `first` in an open transaction, start `others`, then commit `first`."""
    results: list[Any] = [None] * len(others)

    def run(index: int) -> None:
        try:
            with engine.begin() as conn:
                results[index] = others[index](conn)
        except OperationError as exc:
            results[index] = exc

    with engine.connect() as conn:
        transaction = conn.begin()
        first_result = first(conn)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(others))]
        for thread in threads:
            thread.start()
        _blocked_or_done(engine, threads, len(others))
        transaction.commit()
    for thread in threads:
        thread.join(timeout=30)
    return first_result, results


async def test_two_concurrent_replays_of_one_delivery_make_one_replay(
    engine: Engine, async_engine: Any, box: SecretBox, clock: ManualClock
) -> None:
    [dead] = await _dead_deliveries(engine, async_engine, box, clock, 1)

    def replay(conn: Connection) -> Any:
        return delivery_ops.replay(conn, [dead], actor="shell", reason="fixed", now=clock.now())

    first, [second] = _race(engine, replay, [replay])
    assert len(first.replayed) == 1
    assert isinstance(second, OperationError)
    assert "already being replayed" in str(second) and "nothing was replayed" in str(second)
    assert _replays_per_original(engine) == {dead: 1}
    assert scalar(engine, "SELECT count(*) FROM audit_log WHERE action = 'delivery.replay'") == 1


async def test_four_concurrent_bulk_replays_replay_each_dead_delivery_once(
    engine: Engine, async_engine: Any, box: SecretBox, clock: ManualClock
) -> None:
    dead = await _dead_deliveries(engine, async_engine, box, clock, 200)
    flt = delivery_ops.DeliveryFilter(error="500")

    def bulk(conn: Connection) -> Any:
        return delivery_ops.bulk_replay(
            conn, flt, actor="oncall", reason="outage over", now=clock.now()
        )

    first, others = _race(engine, bulk, [bulk, bulk, bulk])
    assert len(first.replayed) == 200
    for result in others:
        assert isinstance(result, delivery_ops.ReplayResult), result
        assert result.replayed == [] and result.skipped == 200
    assert _replays_per_original(engine) == dict.fromkeys(dead, 1)
    # And once more, afterwards: nothing left to replay.
    with engine.begin() as conn:
        again = bulk(conn)
    assert (again.matched, again.replayed) == (0, [])


async def test_a_replayed_delivery_needs_again_and_never_two_pending(
    engine: Engine, async_engine: Any, box: SecretBox, clock: ManualClock
) -> None:
    [dead] = await _dead_deliveries(engine, async_engine, box, clock, 1)
    with engine.begin() as conn:
        [(_, first)] = delivery_ops.replay(
            conn, [dead], actor="a", reason="r", now=clock.now()
        ).replayed
    # While the replay is pending, not even --again makes a second one.
    with engine.begin() as conn, pytest.raises(OperationError, match="already being replayed"):
        delivery_ops.replay(conn, [dead], actor="a", reason="r", now=clock.now(), again=True)
    with engine.begin() as conn:
        conn.execute(text("UPDATE deliveries SET state = 'dead' WHERE id = :id"), {"id": first})
    with engine.begin() as conn, pytest.raises(OperationError, match="add --again"):
        delivery_ops.replay(conn, [dead], actor="a", reason="r", now=clock.now())
    with engine.begin() as conn:
        [(_, second)] = delivery_ops.replay(
            conn, [dead], actor="a", reason="r", now=clock.now(), again=True
        ).replayed
    assert second not in (dead, first)
    assert _replays_per_original(engine) == {dead: 2}
    details = scalar(
        engine,
        "SELECT details FROM audit_log WHERE action = 'delivery.replay' ORDER BY id DESC LIMIT 1",
    )
    assert details["again"] is True and details["replay_id"] == second


async def test_the_database_refuses_a_second_pending_replay(
    engine: Engine, async_engine: Any, box: SecretBox, clock: ManualClock
) -> None:
    """Even code that skips the checks cannot insert two pending replays of one row."""
    [dead] = await _dead_deliveries(engine, async_engine, box, clock, 1)
    copy = (
        "INSERT INTO deliveries (event_id, endpoint_id, tenant_id, max_attempts,"
        " next_attempt_at, replay_of) SELECT event_id, endpoint_id, tenant_id, 3, now(), id"
        " FROM deliveries WHERE id = :id"
    )
    with engine.begin() as conn:
        conn.execute(text(copy), {"id": dead})
    with engine.begin() as conn, pytest.raises(IntegrityError, match="one_pending_replay"):
        conn.execute(text(copy), {"id": dead})


def test_migration_0008_discards_duplicate_pending_replays(empty_database_url: str) -> None:
    from outbox.db import make_engine

    engine = make_engine(empty_database_url)
    try:
        upgrade(engine, "0013")
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO endpoints (uid, url, event_types, signing_secret, tenant_id)"
                    " SELECT 'ep_x', 'https://p.example/h', ARRAY['*'], 'enc', id FROM tenants"
                )
            )
            conn.execute(
                text(
                    "INSERT INTO outbox_events (message_id, event_type, payload, tenant_id)"
                    " SELECT 'msg_x', 'order.created', '{}', id FROM tenants"
                )
            )
            insert = (
                "INSERT INTO deliveries (event_id, endpoint_id, tenant_id, state, max_attempts,"
                " next_attempt_at, replay_of) SELECT o.id, e.id, e.tenant_id, :state, 3, now(),"
                " CAST(:replay_of AS bigint) FROM outbox_events o, endpoints e RETURNING id"
            )
            original = conn.execute(text(insert), {"state": "dead", "replay_of": None}).scalar()
            kept, dup1, dup2 = (
                conn.execute(text(insert), {"state": "scheduled", "replay_of": original}).scalar()
                for _ in range(3)
            )
            done = conn.execute(text(insert), {"state": "dead", "replay_of": original}).scalar()
        upgrade(engine)
        with engine.connect() as conn:
            found = conn.execute(
                text("SELECT id, state FROM deliveries WHERE replay_of IS NOT NULL")
            )
            states = {int(row.id): str(row.state) for row in found}
            reason = conn.execute(
                text("SELECT final_reason FROM deliveries WHERE id = :id"), {"id": dup1}
            ).scalar()
        assert states == {kept: "scheduled", dup1: "discarded", dup2: "discarded", done: "dead"}
        assert f"duplicate replay of delivery {original}" in reason
        assert f"replay {kept} stays" in reason
    finally:
        engine.dispose()


KEY = generate_key("cli")


async def test_cli_replay_twice_says_so_and_again_replays(
    engine: Engine, async_engine: Any, clock: ManualClock, database_url: str
) -> None:
    box = SecretBox.from_setting(KEY)
    [dead] = await _dead_deliveries(engine, async_engine, box, clock, 1)
    runner = CliRunner()
    env = {"OUTBOX_DATABASE_URL": database_url, "OUTBOX_SECRET_KEYS": KEY}

    def outbox(*args: str) -> Any:
        return runner.invoke(main, list(args), env=env, catch_exceptions=False)

    nothing = outbox("replay", "--reason", "r")
    assert nothing.exit_code == 2
    assert "give the delivery ids to replay, or a filter" in nothing.output
    assert "not both" not in nothing.output
    assert outbox("replay", str(dead), "--reason", "fixed").exit_code == 0
    with engine.begin() as conn:  # the replay finished (dead again)
        conn.execute(
            text("UPDATE deliveries SET state = 'dead' WHERE replay_of = :id"), {"id": dead}
        )
    twice = outbox("replay", str(dead), "--reason", "fixed")
    assert twice.exit_code == 1 and "already replayed" in twice.output
    assert "--again" in twice.output
    assert _replays_per_original(engine) == {dead: 1}
    again = outbox("replay", str(dead), "--reason", "fixed", "--again")
    assert again.exit_code == 0, again.output
    assert _replays_per_original(engine) == {dead: 2}


async def test_api_replay_twice_says_so_and_again_true_replays(
    engine: Engine, async_engine: Any, box: SecretBox, clock: ManualClock
) -> None:
    import httpx

    from delivery.operator.api import create_app
    from outbox.tokens import create_token

    [dead] = await _dead_deliveries(engine, async_engine, box, clock, 1)
    with engine.begin() as conn:
        _, secret = create_token(conn, name="oncall", role="operator", actor="test")
    transport = httpx.ASGITransport(app=create_app(async_engine, box, clock=clock))
    async with httpx.AsyncClient(
        transport=transport, base_url="http://admin", headers={"authorization": f"Bearer {secret}"}
    ) as http:
        path = f"/v1/deliveries/{dead}/replay"
        assert (await http.post(path, json={"reason": "r"})).status_code == 200
        pending = await http.post(path, json={"reason": "r", "again": True})
        assert pending.status_code == 400 and "already being replayed" in pending.text
        with engine.begin() as conn:
            conn.execute(
                text("UPDATE deliveries SET state = 'dead' WHERE replay_of = :id"), {"id": dead}
            )
        twice = await http.post(path, json={"reason": "r"})
        assert twice.status_code == 400 and '"again": true' in twice.json()["error"]
        many = await http.post("/v1/replays", json={"reason": "r", "ids": [dead]})
        assert many.status_code == 400
        again = await http.post("/v1/replays", json={"reason": "r", "ids": [dead], "again": True})
        assert again.status_code == 200, again.text
    assert _replays_per_original(engine) == {dead: 2}
