"""Search, show, replay, bulk replay and discard against a real database and receiver."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.receiver import Receiver
from outbox import deliveries as delivery_ops
from outbox import endpoints as endpoint_ops
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.errors import EndpointError, OperationError
from tests.helpers import add_endpoint, rows, scalar
from tests.operator_helpers import deliver, publish_many, snapshot


async def test_search_finds_a_delivery_by_error_text_and_filters(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    gone = add_endpoint(engine, box, receiver.route("/gone", status=404), "order.*")
    fine = add_endpoint(engine, box, receiver.route("/fine"), "*")
    publish_many(engine, "order.created", 2)
    publish_many(engine, "invoice.paid", 1)
    await deliver(async_engine, box, clock)

    with engine.connect() as conn:
        found = delivery_ops.search_deliveries(conn, delivery_ops.DeliveryFilter(error="not FOUND"))
        assert {d.endpoint_uid for d in found} == {gone.endpoint.uid}
        assert len(found) == 2 and all(d.state == "dead" for d in found)
        assert (
            delivery_ops.search_deliveries(conn, delivery_ops.DeliveryFilter(error="no such text"))
            == []
        )
        assert (
            len(
                delivery_ops.search_deliveries(
                    conn, delivery_ops.DeliveryFilter(states=("succeeded",))
                )
            )
            == 3
        )
        by_type = delivery_ops.search_deliveries(
            conn, delivery_ops.DeliveryFilter(endpoint=fine.endpoint.uid, event_type="invoice.paid")
        )
        assert [d.event_type for d in by_type] == ["invoice.paid"]
        later = delivery_ops.search_deliveries(
            conn, delivery_ops.DeliveryFilter(since=clock.now() + dt.timedelta(seconds=1))
        )
        assert later == []
        # Keyset paging walks every row exactly once, newest first.
        first = delivery_ops.search_deliveries(conn, delivery_ops.DeliveryFilter(limit=3))
        second = delivery_ops.search_deliveries(
            conn, delivery_ops.DeliveryFilter(limit=3, before_id=first[-1].id)
        )
        ids = [d.id for d in first + second]
        assert ids == sorted(ids, reverse=True) and len(set(ids)) == 5
        with pytest.raises(OperationError, match="unknown state"):
            delivery_ops.DeliveryFilter(states=("lost",))


async def test_replay_creates_a_new_delivery_and_leaves_the_old_one_unchanged(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    url = receiver.route("/flaky", status=400)
    add_endpoint(engine, box, url, "*")
    [message_id] = publish_many(engine, "order.created")
    await deliver(async_engine, box, clock)
    dead_id = scalar(engine, "SELECT id FROM deliveries")
    before = snapshot(engine, dead_id)
    assert before["delivery"][0]["state"] == "dead"

    receiver.route("/flaky", status=200)
    clock.advance(60)
    with engine.begin() as conn:
        result = delivery_ops.replay(
            conn, [dead_id], actor="alice", reason="partner fixed", now=clock.now()
        )
    [(old, new)] = result.replayed
    assert old == dead_id and new != dead_id
    await deliver(async_engine, box, clock)

    assert snapshot(engine, dead_id) == before
    replayed = rows(engine, "SELECT * FROM deliveries WHERE id = :id", id=new)[0]
    assert (replayed["state"], replayed["replay_of"]) == ("succeeded", dead_id)
    assert [r.headers["webhook-id"] for r in receiver.requests] == [message_id, message_id]
    audit = rows(engine, "SELECT * FROM audit_log WHERE action = 'delivery.replay'")
    assert [(a["actor"], a["target_id"], a["reason"]) for a in audit] == [
        ("alice", str(dead_id), "partner fixed")
    ]
    assert audit[0]["details"]["replay_id"] == new

    with engine.connect() as conn:
        shown = delivery_ops.get_delivery(conn, dead_id).as_json()
    assert shown["event"]["message_id"] == message_id
    assert [a["status_code"] for a in shown["attempt_history"]] == [400]
    assert shown["replays"] == [
        {
            "id": new,
            "state": "succeeded",
            "created_at": clock.now().isoformat(),
            "actor": "alice",
            "reason": "partner fixed",
        }
    ]


async def test_replay_refusals_change_nothing(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    add_endpoint(engine, box, receiver.route("/ok"), "*")
    publish_many(engine, "order.created")
    await deliver(async_engine, box, clock)
    done = scalar(engine, "SELECT id FROM deliveries")
    with engine.begin() as conn:
        with pytest.raises(OperationError, match="--force"):
            delivery_ops.replay(conn, [done], actor="a", reason="again", now=clock.now())
        with pytest.raises(OperationError, match="needs a reason"):
            delivery_ops.replay(conn, [done], actor="a", reason=" ", now=clock.now(), force=True)
        with pytest.raises(OperationError, match="no delivery 999"):
            delivery_ops.replay(
                conn, [done, 999], actor="a", reason="x", now=clock.now(), force=True
            )
    assert scalar(engine, "SELECT count(*) FROM deliveries") == 1
    assert scalar(engine, "SELECT count(*) FROM audit_log") == 0
    with engine.begin() as conn:
        forced = delivery_ops.replay(
            conn, [done], actor="a", reason="x", now=clock.now(), force=True
        )
    assert len(forced.replayed) == 1
    assert scalar(engine, "SELECT count(*) FROM audit_log WHERE action = 'delivery.replay'") == 1


async def test_bulk_dry_run_changes_nothing_and_the_real_run_is_rate_capped(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    failing = add_endpoint(engine, box, receiver.route("/down", status=404), "*")
    add_endpoint(engine, box, receiver.route("/up"), "*")
    publish_many(engine, "order.created", 6)
    await deliver(async_engine, box, clock)
    tables = "SELECT (SELECT count(*) FROM deliveries), (SELECT count(*) FROM audit_log)"
    counts_before = rows(engine, tables)
    flt = delivery_ops.DeliveryFilter(endpoint=failing.endpoint.uid, error="404")

    with engine.begin() as conn:
        dry = delivery_ops.bulk_replay(
            conn, flt, actor="bob", reason="outage over", now=clock.now(), dry_run=True
        )
    assert (dry.dry_run, dry.matched, dry.replayed) == (True, 6, [])
    assert len(dry.sample) == delivery_ops.SAMPLE_SIZE
    assert rows(engine, tables) == counts_before

    with engine.begin() as conn:
        real = delivery_ops.bulk_replay(
            conn, flt, actor="bob", reason="outage over", now=clock.now(),
            max_count=4, rate_per_minute=60,
        )  # fmt: skip
    assert (real.matched, len(real.replayed)) == (6, 4)
    due = [
        r["next_attempt_at"]
        for r in rows(engine, "SELECT next_attempt_at FROM deliveries WHERE replay_of IS NOT NULL")
    ]
    # One per second at 60/minute: the first now, the last three seconds later.
    assert sorted(due) == [clock.now() + dt.timedelta(seconds=s) for s in range(4)]
    # A second run only takes what was not replayed yet.
    with engine.begin() as conn:
        rest = delivery_ops.bulk_replay(conn, flt, actor="bob", reason="the rest", now=clock.now())
    assert (rest.matched, len(rest.replayed)) == (2, 2)
    assert {old for old, _ in real.replayed}.isdisjoint(old for old, _ in rest.replayed)
    assert scalar(engine, "SELECT count(*) FROM audit_log WHERE action = 'delivery.replay'") == 6
    with engine.begin() as conn, pytest.raises(OperationError, match="--force"):
        delivery_ops.bulk_replay(
            conn,
            delivery_ops.DeliveryFilter(states=("succeeded",)),
            actor="b",
            reason="r",
            now=clock.now(),
        )


async def test_discard_is_audited_and_refuses_finished_deliveries(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    add_endpoint(engine, box, receiver.route("/bad", status=500), "*")
    add_endpoint(engine, box, receiver.route("/ok"), "*")
    publish_many(engine, "order.created")
    await deliver(async_engine, box, clock)
    retrying = scalar(engine, "SELECT id FROM deliveries WHERE state = 'scheduled'")
    done = scalar(engine, "SELECT id FROM deliveries WHERE state = 'succeeded'")
    with engine.begin() as conn, pytest.raises(OperationError, match="succeeded"):
        delivery_ops.discard(conn, [retrying, done], actor="c", reason="stale", now=clock.now())
    assert scalar(engine, "SELECT state FROM deliveries WHERE id = :id", id=retrying) == (
        "scheduled"
    )
    with engine.begin() as conn:
        assert delivery_ops.discard(
            conn, [retrying], actor="c", reason="stale", now=clock.now()
        ) == [retrying]
    row = rows(engine, "SELECT * FROM deliveries WHERE id = :id", id=retrying)[0]
    assert (row["state"], row["final_reason"]) == ("discarded", "stale")
    audit = rows(engine, "SELECT * FROM audit_log")
    assert [(a["action"], a["target_id"], a["details"]) for a in audit] == [
        ("delivery.discard", str(retrying), {"previous_state": "scheduled"})
    ]


async def test_endpoint_update_rotate_and_delete_are_audited(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    created = add_endpoint(engine, box, receiver.route("/a"), "order.*")
    uid = created.endpoint.uid
    with engine.begin() as conn:
        updated = endpoint_ops.update_endpoint(
            conn, uid, actor="d", url=receiver.route("/b"), event_types="order.*,invoice.*"
        )
        assert updated.event_types == ["order.*", "invoice.*"]
        with pytest.raises(EndpointError, match="http"):
            endpoint_ops.update_endpoint(conn, uid, actor="d", url="ftp://x")
    with engine.begin() as conn:
        rotated = endpoint_ops.rotate_secret(
            conn, box, uid, actor="d", now=clock.now(), grace=dt.timedelta(hours=1)
        )
    assert rotated.secret != created.secret
    publish_many(engine, "invoice.paid")
    await deliver(async_engine, box, clock)
    [request] = receiver.received("/b")
    # Both secrets sign during the grace period.
    assert len(request.headers["webhook-signature"].split(" ")) == 2
    with engine.begin() as conn:
        result = endpoint_ops.delete_endpoint(conn, uid, actor="d", reason="partner left")
    assert result == {"deliveries": 1, "attempts": 1}
    assert scalar(engine, "SELECT count(*) FROM endpoints") == 0
    actions = [r["action"] for r in rows(engine, "SELECT action FROM audit_log ORDER BY id")]
    assert actions == ["endpoint.update", "endpoint.rotate_secret", "endpoint.delete"]
    # The removed attempt is tallied, so exported totals do not go backwards.
    assert scalar(engine, "SELECT value FROM pruned_totals WHERE name = 'attempts:succeeded'") == 1


@pytest.mark.parametrize("now_state", ["in_flight", "succeeded", "discarded"])
async def test_a_state_change_between_discard_check_and_write_is_refused_by_the_write(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    monkeypatch: pytest.MonkeyPatch,
    now_state: str,
) -> None:
    """Discard checks states, then writes; a worker or another operator may change the
    row in between. The write re-checks, so it refuses and changes nothing."""
    add_endpoint(engine, box, receiver.route("/ok"), "*")
    publish_many(engine, "order.created")
    await deliver(async_engine, box, clock)
    target = scalar(engine, "SELECT id FROM deliveries")
    lease = "now() + interval '1 minute'" if now_state == "in_flight" else "NULL"
    with engine.begin() as conn:
        conn.execute(
            text(
                f"UPDATE deliveries SET state = :s, locked_by = 'w', lease_expires_at = {lease}"
                " WHERE id = :id"
            ),
            {"s": now_state, "id": target},
        )
    before = snapshot(engine, target)
    # What each check read a moment earlier, before the row moved on.
    if now_state != "discarded":  # a discarded delivery may be replayed
        # Replay locks its rows first, so here the stale read is the lock's own answer.
        stale = text(
            "SELECT id, 'dead' AS state FROM deliveries WHERE id = ANY(CAST(:ids AS bigint[]))"
            " AND (CAST(:scope_id AS bigint) IS NULL OR tenant_id = :scope_id)"
        )
        monkeypatch.setattr(delivery_ops.queries, "LOCK_DELIVERIES_FOR_REPLAY", stale)
        with (
            engine.begin() as conn,
            pytest.raises(
                OperationError,
                match=r"^deliveries changed while replaying; nothing was replayed, try again$",
            ),
        ):
            delivery_ops.replay(conn, [target], actor="a", reason="x", now=clock.now())
    if now_state != "scheduled":  # a scheduled delivery may be discarded
        monkeypatch.setattr(delivery_ops, "_states", lambda conn, ids, scope: {target: "scheduled"})
        with (
            engine.begin() as conn,
            pytest.raises(
                OperationError,
                match=r"^deliveries changed while discarding; nothing was discarded, try again$",
            ),
        ):
            delivery_ops.discard(conn, [target], actor="c", reason="stale", now=clock.now())
    assert snapshot(engine, target) == before
    assert scalar(engine, "SELECT count(*) FROM deliveries") == 1
    assert scalar(engine, "SELECT count(*) FROM audit_log") == 0
