"""Replay, bulk replay and discard: the exact refusals, audit rows, limits and paging.

What an operator (or automation reading the API) sees is pinned exactly: each refusal's
text, each audit row's fields, each filter, the limits and the start times of a paced
replay. Deliveries are made by the relay and put in their state by SQL: no HTTP here.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import deliveries as delivery_ops
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.errors import NotFoundError, OperationError
from outbox.tenants import create_tenant
from tests.helpers import add_endpoint, rows, scalar
from tests.outbox.deliveries_helpers import audit_rows, deliveries_in, refused, set_state

URL = "https://partner.example/hooks"


def _replays(engine: Engine) -> dict[int, tuple[int, dt.datetime]]:
    """Original id -> (replay id, its first due time)."""
    found = rows(
        engine,
        "SELECT id, replay_of, next_attempt_at FROM deliveries WHERE replay_of IS NOT NULL",
    )
    return {int(r["replay_of"]): (int(r["id"]), r["next_attempt_at"]) for r in found}


async def test_replay_refusals_name_each_delivery_and_the_way_out(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    uid = add_endpoint(engine, box, URL).endpoint.uid
    dead, waiting, flying, done = await deliveries_in(
        engine, async_engine, clock, uid, ["dead", "scheduled", "in_flight", "succeeded"]
    )
    now = clock.now()
    with engine.begin() as conn:
        with refused(
            OperationError, "a replay needs a reason (--reason TEXT): it goes in the audit log"
        ):
            delivery_ops.replay(conn, [dead], actor="a", reason=None, now=now)
        with refused(OperationError, "give at least one delivery id to replay"):
            delivery_ops.replay(conn, [], actor="a", reason="r", now=now)
        with refused(NotFoundError, "no delivery 998, 999; nothing was replayed"):
            delivery_ops.replay(conn, [dead, 998, 999], actor="a", reason="r", now=now)
        # Still being delivered: no hint about --force, which would not help.
        with refused(
            OperationError,
            f"cannot replay: {waiting} is scheduled, {flying} is in_flight; nothing was replayed",
        ):
            delivery_ops.replay(
                conn, [dead, waiting, flying], actor="a", reason="r", now=now, force=True
            )
        with refused(
            OperationError,
            f"cannot replay: {done} is succeeded (replaying a succeeded delivery sends it"
            " again: add --force if that is meant); nothing was replayed",
        ):
            delivery_ops.replay(conn, [dead, done], actor="a", reason="r", now=now)
    assert scalar(engine, "SELECT count(*) FROM deliveries") == 4
    assert scalar(engine, "SELECT count(*) FROM audit_log") == 0

    with engine.begin() as conn:
        [(_, first)] = delivery_ops.replay(conn, [dead], actor="a", reason="r", now=now).replayed
    with engine.begin() as conn:
        with refused(
            OperationError,
            f"already being replayed: {dead} has replay {first} (scheduled); wait for it to"
            " finish (`outbox deliveries show ID`) or discard that replay first; nothing was"
            " replayed",
        ):
            delivery_ops.replay(conn, [dead], actor="a", reason="r", now=now, again=True)
        set_state(conn, first, "in_flight")
    with engine.begin() as conn:
        with refused(
            OperationError,
            f"already being replayed: {dead} has replay {first} (in_flight); wait for it to"
            " finish (`outbox deliveries show ID`) or discard that replay first; nothing was"
            " replayed",
        ):
            delivery_ops.replay(conn, [dead], actor="a", reason="r", now=now, again=True)
        set_state(conn, first, "dead")
    with engine.begin() as conn:
        with refused(
            OperationError,
            f"already replayed: {dead} as {first} (dead); replaying again sends the message"
            ' again: add --again (API: "again": true) if that is meant; nothing was replayed',
        ):
            delivery_ops.replay(conn, [dead], actor="a", reason="r", now=now)
        [(_, second)] = delivery_ops.replay(
            conn, [dead], actor="a", reason="r", now=now, again=True
        ).replayed
    details = [a["details"] for a in audit_rows(engine, "delivery.replay")]
    assert details == [
        {"replay_id": first, "forced": False},
        {"replay_id": second, "forced": False, "again": True},
    ]


async def test_replay_writes_one_full_audit_row_each_and_paces_the_new_deliveries(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    uid = add_endpoint(engine, box, URL).endpoint.uid
    a, b, c, done = await deliveries_in(
        engine, async_engine, clock, uid, ["dead", "discarded", "dead", "succeeded"]
    )
    now = clock.now()
    with engine.begin() as conn:
        result = delivery_ops.replay(
            conn,
            [c, a, c, b],  # a repeated id counts once; the order given is kept
            actor="alice",
            reason="  partner fixed  ",
            now=now,
            rate_per_minute=30,
            request_id="req-1",
        )
    made = _replays(engine)
    assert result.replayed == [(c, made[c][0]), (a, made[a][0]), (b, made[b][0])]
    second = dt.timedelta(seconds=1)
    assert [made[i][1] for i in (c, a, b)] == [now, now + 2 * second, now + 4 * second]
    assert result.as_json() == {
        "dry_run": False,
        "matched": 3,
        "skipped": 0,
        "superseded": 0,
        "superseded_sample": [],
        "replayed": [{"delivery": old, "replay": new} for old, new in result.replayed],
        "sample": [],
        "first_due": now.isoformat(),
        "last_due": (now + 4 * second).isoformat(),
    }
    assert audit_rows(engine, "delivery.replay") == [
        {
            "actor": "alice",
            "action": "delivery.replay",
            "target_type": "delivery",
            "target_id": str(old),
            "reason": "partner fixed",
            "details": {"replay_id": new, "forced": False},
            "request_id": "req-1",
            "tenant_uid": "default",
        }
        for old, new in result.replayed
    ]

    with engine.begin() as conn:
        forced = delivery_ops.replay(
            conn, [done], actor="bob", reason="resend", now=now, force=True
        )
    assert (forced.first_due, forced.last_due) == (now, now)
    assert audit_rows(engine, "delivery.replay")[-1]["details"] == {
        "replay_id": forced.replayed[0][1],
        "forced": True,
    }


async def test_bulk_replay_refusals_and_limits_are_exact(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    uid = add_endpoint(engine, box, URL).endpoint.uid
    await deliveries_in(engine, async_engine, clock, uid, ["dead", "dead"])
    now = clock.now()

    def bulk(flt: delivery_ops.DeliveryFilter, **kwargs: Any) -> delivery_ops.ReplayResult:
        with engine.begin() as conn:
            return delivery_ops.bulk_replay(
                conn, flt, actor="a", now=now, **{"reason": "r", **kwargs}
            )

    dead = delivery_ops.DeliveryFilter()
    with refused(
        OperationError, "a replay needs a reason (--reason TEXT): it goes in the audit log"
    ):
        bulk(dead, reason="")
    with refused(OperationError, "cannot bulk-replay in_flight, scheduled deliveries"):
        bulk(delivery_ops.DeliveryFilter(states=("scheduled", "dead", "in_flight")), force=True)
    with refused(
        OperationError,
        "cannot bulk-replay succeeded deliveries: add --force to replay succeeded ones",
    ):
        bulk(delivery_ops.DeliveryFilter(states=("succeeded", "dead")))
    with refused(OperationError, "cannot bulk-replay scheduled, succeeded deliveries"):
        bulk(delivery_ops.DeliveryFilter(states=("succeeded", "scheduled")))
    for wrong in (0, 100_001):
        with refused(OperationError, "the bulk replay limit must be between 1 and 100000"):
            bulk(dead, max_count=wrong, dry_run=True)
    for edge in (1, 100_000):
        assert bulk(dead, max_count=edge, dry_run=True).matched == 2
    assert scalar(engine, "SELECT count(*) FROM deliveries") == 2
    assert scalar(engine, "SELECT count(*) FROM audit_log") == 0

    # A dry run tells when the paced replays would start: only as many as the limit.
    minute = bulk(dead, dry_run=True, max_count=1, rate_per_minute=60)
    assert (minute.first_due, minute.last_due) == (now, now)
    paced = bulk(dead, dry_run=True, rate_per_minute=60)
    assert (paced.first_due, paced.last_due) == (now, now + dt.timedelta(seconds=1))
    assert paced.as_json()["first_due"] == now.isoformat()
    nothing = bulk(delivery_ops.DeliveryFilter(event_type="nothing.matches"), dry_run=True)
    assert (nothing.matched, nothing.first_due, nothing.last_due) == (0, None, None)


async def test_bulk_replay_of_succeeded_deliveries_with_force_is_audited_as_bulk(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    uid = add_endpoint(engine, box, URL).endpoint.uid
    done = await deliveries_in(engine, async_engine, clock, uid, ["succeeded", "succeeded"])
    flt = delivery_ops.DeliveryFilter(states=("succeeded",), endpoint=uid)
    with engine.begin() as conn:
        result = delivery_ops.bulk_replay(
            conn, flt, actor="ops", reason="resend", now=clock.now(), force=True,
            request_id="req-9",
        )  # fmt: skip
    assert sorted(old for old, _ in result.replayed) == done
    assert [s.id for s in result.sample] == sorted(done, reverse=True)
    assert [a["details"] for a in audit_rows(engine, "delivery.replay")] == [
        {
            "replay_id": new,
            "forced": True,
            "bulk": True,
            "filter": {"states": ["succeeded"], "endpoint": uid, "unreplayed": False},
        }
        for _, new in result.replayed
    ]
    assert {a["request_id"] for a in audit_rows(engine, "delivery.replay")} == {"req-9"}


async def test_bulk_replay_applies_every_filter(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    """Each filter narrows both the count and what is replayed, one filter at a time."""
    with engine.begin() as conn:
        create_tenant(conn, "acme")
    one = add_endpoint(engine, box, URL).endpoint.uid
    two = add_endpoint(engine, box, "https://other.example/hooks").endpoint.uid
    acme = add_endpoint(engine, box, "https://acme.example/hooks", tenant="acme").endpoint.uid
    [old, plain] = await deliveries_in(engine, async_engine, clock, one, ["dead", "dead"])
    [typed] = await deliveries_in(
        engine, async_engine, clock, two, ["dead"], event_type="invoice.paid"
    )
    [theirs] = await deliveries_in(engine, async_engine, clock, acme, ["dead"], tenant="acme")
    now = clock.now()
    with engine.begin() as conn:
        conn.execute(text("UPDATE deliveries SET created_at = :at"), {"at": now})
        conn.execute(
            text("UPDATE deliveries SET created_at = :at WHERE id = :id"),
            {"at": now - dt.timedelta(days=2), "id": old},
        )
        conn.execute(
            text("UPDATE deliveries SET final_reason = '410 Gone' WHERE id = :id"), {"id": typed}
        )
    message = scalar(
        engine,
        "SELECT ev.message_id FROM deliveries d JOIN outbox_events ev ON ev.id = d.event_id"
        " WHERE d.id = :id",
        id=plain,
    )
    yesterday = now - dt.timedelta(days=1)
    cases: list[tuple[delivery_ops.DeliveryFilter, list[int]]] = [
        (delivery_ops.DeliveryFilter(), [old, plain, typed, theirs]),
        (delivery_ops.DeliveryFilter(endpoint=one), [old, plain]),
        (delivery_ops.DeliveryFilter(event_type="invoice.paid"), [typed]),
        (delivery_ops.DeliveryFilter(error="gone"), [typed]),
        (delivery_ops.DeliveryFilter(message_id=message), [plain]),
        (delivery_ops.DeliveryFilter(since=yesterday), [plain, typed, theirs]),
        (delivery_ops.DeliveryFilter(until=yesterday), [old]),
        (delivery_ops.DeliveryFilter(tenant="acme"), [theirs]),
    ]
    for flt, expected in cases:
        with engine.begin() as conn:
            dry = delivery_ops.bulk_replay(conn, flt, actor="a", reason="r", now=now, dry_run=True)
        assert (dry.matched, [s.id for s in dry.sample]) == (
            len(expected),
            sorted(expected, reverse=True),
        ), flt
    with engine.begin() as conn:
        real = delivery_ops.bulk_replay(
            conn, delivery_ops.DeliveryFilter(since=yesterday), actor="a", reason="r", now=now
        )
    assert sorted(old for old, _ in real.replayed) == [plain, typed, theirs]
    assert real.sample != [] and real.matched == 3
    # Newest first, as paged; each audit row takes its delivery's tenant.
    assert [(a["target_id"], a["tenant_uid"]) for a in audit_rows(engine, "delivery.replay")] == [
        (str(theirs), "acme"),
        (str(typed), "default"),
        (str(plain), "default"),
    ]


async def test_bulk_replay_pages_through_more_than_one_page(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pages of MAX_PAGE ids, each starting below the last: every id once, up to the limit.

    The page size is lowered so a few rows make three pages (the paging is the same)."""
    everything = delivery_ops.DeliveryFilter()
    monkeypatch.setattr(delivery_ops, "MAX_PAGE", 5)
    uid = add_endpoint(engine, box, URL).endpoint.uid
    dead = await deliveries_in(engine, async_engine, clock, uid, ["dead"] * 12)
    with engine.begin() as conn:
        result = delivery_ops.bulk_replay(
            conn, everything, actor="a", reason="r", now=clock.now(), max_count=11
        )
    newest_first = sorted(dead, reverse=True)
    assert [old for old, _ in result.replayed] == newest_first[:11]
    assert (result.matched, len(result.sample)) == (12, delivery_ops.SAMPLE_SIZE)
    assert [s.id for s in result.sample] == newest_first[: delivery_ops.SAMPLE_SIZE]


async def test_discard_refusals_and_audit_rows_are_exact(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    uid = add_endpoint(engine, box, URL).endpoint.uid
    dead, waiting, flying, done = await deliveries_in(
        engine, async_engine, clock, uid, ["dead", "scheduled", "in_flight", "succeeded"]
    )
    now = clock.now()
    with engine.begin() as conn:
        with refused(
            OperationError, "a discard needs a reason (--reason TEXT): it goes in the audit log"
        ):
            delivery_ops.discard(conn, [dead], actor="c", reason="  ", now=now)
        with refused(OperationError, "give at least one delivery id to discard"):
            delivery_ops.discard(conn, [], actor="c", reason="r", now=now)
        with refused(NotFoundError, "no delivery 998, 999; nothing was discarded"):
            delivery_ops.discard(conn, [dead, 998, 999], actor="c", reason="r", now=now)
        with refused(
            OperationError,
            f"cannot discard: {flying} is in_flight, {done} is succeeded (only scheduled,"
            " dead or held deliveries can be); nothing was discarded",
        ):
            delivery_ops.discard(conn, [dead, flying, done], actor="c", reason="r", now=now)
    assert scalar(engine, "SELECT count(*) FROM audit_log") == 0
    assert scalar(engine, "SELECT count(*) FROM deliveries WHERE state = 'discarded'") == 0

    with engine.begin() as conn:
        gone = delivery_ops.discard(
            conn, [waiting, dead, waiting], actor="carol", reason=" stale ", now=now,
            request_id="req-7",
        )  # fmt: skip
    assert gone == [dead, waiting]
    assert audit_rows(engine, "delivery.discard") == [
        {
            "actor": "carol",
            "action": "delivery.discard",
            "target_type": "delivery",
            "target_id": str(i),
            "reason": "stale",
            "details": {"previous_state": state},
            "request_id": "req-7",
            "tenant_uid": "default",
        }
        for i, state in ((dead, "dead"), (waiting, "scheduled"))
    ]
    reasons = rows(engine, "SELECT final_reason FROM deliveries WHERE state = 'discarded'")
    assert [r["final_reason"] for r in reasons] == ["stale", "stale"]


async def test_a_tenant_scope_hides_other_tenants_deliveries_from_every_action(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    with engine.begin() as conn:
        create_tenant(conn, "acme")
        create_tenant(conn, "globex")
    acme = add_endpoint(engine, box, URL, tenant="acme").endpoint.uid
    mine, other = await deliveries_in(
        engine, async_engine, clock, acme, ["dead", "dead"], tenant="acme"
    )
    now = clock.now()
    with engine.begin() as conn:
        with refused(NotFoundError, f"no delivery {mine}; nothing was replayed"):
            delivery_ops.replay(conn, [mine], actor="g", reason="r", now=now, scope="globex")
        with refused(NotFoundError, f"no delivery {mine}; nothing was discarded"):
            delivery_ops.discard(conn, [mine], actor="g", reason="r", now=now, scope="globex")
        with refused(NotFoundError, f"no delivery {mine}; `outbox deliveries list` shows the ids"):
            delivery_ops.get_delivery(conn, mine, scope="globex")
        assert (
            delivery_ops.search_deliveries(conn, delivery_ops.DeliveryFilter(tenant="globex")) == []
        )
        assert (
            delivery_ops.count_deliveries(conn, delivery_ops.DeliveryFilter(tenant="globex")) == 0
        )
    assert scalar(engine, "SELECT count(*) FROM audit_log") == 0
    with engine.begin() as conn:
        assert len(
            delivery_ops.replay(conn, [mine], actor="a", reason="r", now=now, scope="acme").replayed
        )
        assert delivery_ops.discard(
            conn, [other], actor="a", reason="r", now=now, scope="acme"
        ) == [other]
        assert delivery_ops.get_delivery(conn, mine, scope="acme").delivery.tenant == "acme"
        assert delivery_ops.count_deliveries(conn, delivery_ops.DeliveryFilter(tenant="acme")) == 3


async def test_bulk_replay_leaves_out_what_another_operator_replayed_meanwhile(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bulk replay reads (count, sample, pages) and then locks and replays; another
    operator may replay some of the same deliveries in between. Those are skipped and
    counted, never refused and never replayed twice. The other operator's replay is real
    (its own connection, committed); only its timing is arranged, by a wrapper around
    the reads."""
    uid = add_endpoint(engine, box, URL).endpoint.uid
    older, newer = await deliveries_in(engine, async_engine, clock, uid, ["dead", "dead"])
    now = clock.now()
    real_search = delivery_ops.search_deliveries

    def other_operator_replays(ids: list[int]) -> None:
        with engine.begin() as other:
            delivery_ops.replay(other, ids, actor="other", reason="mine", now=now)

    def racing(after_read: int, ids: list[int]) -> Any:
        reads: list[int] = []

        def search(
            conn: Any, flt: delivery_ops.DeliveryFilter
        ) -> list[delivery_ops.DeliverySummary]:
            found = real_search(conn, flt)
            reads.append(1)
            if len(reads) == after_read:
                other_operator_replays(ids)
            return found

        return search

    # Between the page read and the lock: the stale page still lists `older`.
    monkeypatch.setattr(delivery_ops, "search_deliveries", racing(2, [older]))
    with engine.begin() as conn:
        result = delivery_ops.bulk_replay(
            conn, delivery_ops.DeliveryFilter(), actor="a", reason="r", now=now
        )
    assert [old for old, _ in result.replayed] == [newer]
    assert (result.matched, result.skipped, len(result.sample)) == (2, 1, 2)
    assert result.as_json()["skipped"] == 1
    assert [(a["actor"], a["target_id"]) for a in audit_rows(engine, "delivery.replay")] == [
        ("other", str(older)),
        ("a", str(newer)),
    ]

    # Between the count and the page read: nothing is left to replay.
    third, fourth = await deliveries_in(engine, async_engine, clock, uid, ["dead", "dead"])
    monkeypatch.setattr(delivery_ops, "search_deliveries", racing(1, [third, fourth]))
    with engine.begin() as conn:
        late = delivery_ops.bulk_replay(
            conn, delivery_ops.DeliveryFilter(), actor="a", reason="r", now=now
        )
    assert late.as_json() == {
        "dry_run": False,
        "matched": 2,
        "skipped": 2,
        "superseded": 0,
        "superseded_sample": [],
        "replayed": [],
        "sample": [s.as_json() for s in late.sample],
        "first_due": None,
        "last_due": None,
    }
    assert [s.id for s in late.sample] == [fourth, third]
    assert scalar(engine, "SELECT count(*) FROM audit_log WHERE actor = 'a'") == 1


async def test_replay_refusals_list_every_delivery_already_replayed(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    """Several refused at once are all named, comma-separated, in the order given."""
    uid = add_endpoint(engine, box, URL).endpoint.uid
    a, b = await deliveries_in(engine, async_engine, clock, uid, ["dead", "dead"])
    now = clock.now()
    with engine.begin() as conn:
        made = dict(delivery_ops.replay(conn, [a, b], actor="x", reason="r", now=now).replayed)
    with engine.begin() as conn:
        with refused(
            OperationError,
            f"already being replayed: {a} has replay {made[a]} (scheduled), {b} has replay"
            f" {made[b]} (scheduled); wait for it to finish (`outbox deliveries show ID`) or"
            " discard that replay first; nothing was replayed",
        ):
            delivery_ops.replay(conn, [a, b], actor="x", reason="r", now=now, again=True)
        set_state(conn, made[a], "succeeded")
        set_state(conn, made[b], "dead")
    both = (
        f"already replayed: {a} as {made[a]} (succeeded), {b} as {made[b]} (dead); replaying"
        ' again sends the message again: add --again (API: "again": true) if that is meant;'
        " nothing was replayed"
    )
    with engine.begin() as conn, refused(OperationError, both):
        delivery_ops.replay(conn, [a, b], actor="x", reason="r", now=now)


async def test_a_scoped_bulk_replay_replays_only_its_tenants_deliveries_itself(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The replay a bulk replay runs takes the filter's tenant as its scope: even if the
    page read before it went wrong (here made unscoped on purpose), another tenant's
    delivery is not found and nothing is replayed."""
    with engine.begin() as conn:
        create_tenant(conn, "acme")
        create_tenant(conn, "globex")
    acme = add_endpoint(engine, box, URL, tenant="acme").endpoint.uid
    globex = add_endpoint(engine, box, "https://globex.example/h", tenant="globex").endpoint.uid
    [mine] = await deliveries_in(engine, async_engine, clock, acme, ["dead"], tenant="acme")
    [theirs] = await deliveries_in(engine, async_engine, clock, globex, ["dead"], tenant="globex")
    real_search = delivery_ops.search_deliveries

    def unscoped_pages(
        conn: Any, flt: delivery_ops.DeliveryFilter
    ) -> list[delivery_ops.DeliverySummary]:
        return real_search(conn, replace(flt, tenant=None))

    monkeypatch.setattr(delivery_ops, "search_deliveries", unscoped_pages)
    scoped = delivery_ops.DeliveryFilter(tenant="acme")
    with (
        engine.begin() as conn,
        refused(NotFoundError, f"no delivery {theirs}; nothing was replayed"),
    ):
        delivery_ops.bulk_replay(conn, scoped, actor="a", reason="r", now=clock.now())
    assert _replays(engine) == {}
    assert scalar(engine, "SELECT count(*) FROM audit_log") == 0
    monkeypatch.setattr(delivery_ops, "search_deliveries", real_search)
    with engine.begin() as conn:
        done = delivery_ops.bulk_replay(
            conn, delivery_ops.DeliveryFilter(tenant="acme"), actor="a", reason="r", now=clock.now()
        )
    assert [old for old, _ in done.replayed] == [mine]


async def test_a_replay_that_skips_every_delivery_replays_nothing_and_says_so(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`skip_replayed` with every id already replayed: an empty, not-dry result that counts
    them as skipped (bulk replay: another operator replayed the whole page after it was
    read, before it was locked)."""
    uid = add_endpoint(engine, box, URL).endpoint.uid
    older, newer = await deliveries_in(engine, async_engine, clock, uid, ["dead", "dead"])
    now = clock.now()
    with engine.begin() as conn:
        delivery_ops.replay(conn, [older], actor="other", reason="mine", now=now)
    with engine.begin() as conn:
        alone = delivery_ops.replay(
            conn, [older], actor="a", reason="r", now=now, skip_replayed=True
        )
    assert alone.as_json() == {
        "dry_run": False,
        "matched": 0,
        "skipped": 1,
        "superseded": 0,
        "superseded_sample": [],
        "replayed": [],
        "sample": [],
        "first_due": None,
        "last_due": None,
    }

    real_search = delivery_ops.search_deliveries
    reads: list[int] = []

    def search(conn: Any, flt: delivery_ops.DeliveryFilter) -> list[delivery_ops.DeliverySummary]:
        found = real_search(conn, flt)
        reads.append(1)
        if len(reads) == 2:  # the page is read: the other operator replays all of it
            with engine.begin() as other:
                delivery_ops.replay(other, [newer], actor="other", reason="mine", now=now)
        return found

    monkeypatch.setattr(delivery_ops, "search_deliveries", search)
    with engine.begin() as conn:
        late = delivery_ops.bulk_replay(
            conn, delivery_ops.DeliveryFilter(), actor="a", reason="r", now=now
        )
    assert late.as_json() == {
        "dry_run": False,
        "matched": 1,
        "skipped": 1,
        "superseded": 0,
        "superseded_sample": [],
        "replayed": [],
        "sample": [s.as_json() for s in late.sample],
        "first_due": None,
        "last_due": None,
    }
    assert [s.id for s in late.sample] == [newer]
    assert scalar(engine, "SELECT count(*) FROM audit_log WHERE actor = 'a'") == 0
