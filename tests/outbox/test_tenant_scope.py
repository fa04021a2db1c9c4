"""The tenant scope in outbox/ itself: every lookup and change by id, called with another
tenant's scope, is "not found" and writes nothing (the admin API and any portal build on this)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.health import EndpointLimits, get_endpoint_limits, set_endpoint_limits
from outbox import deliveries as delivery_ops
from outbox import endpoints as endpoint_ops
from outbox.crypto import SecretBox
from outbox.endpoint_rules import DeliveryRules, get_delivery_rules, set_delivery_rules
from outbox.endpoints import get_endpoint, reveal_secret, set_enabled
from outbox.errors import NotFoundError
from outbox.headers import get_headers, set_headers
from outbox.schema import LATENCY_BUCKETS
from outbox.tenants import create_tenant, get_tenant, show_tenant
from tests.helpers import add_endpoint, rows

NOW = dt.datetime(2026, 11, 30, tzinfo=dt.UTC)

Call = Callable[[Connection, SecretBox, str], Any]

CALLS: dict[str, Call] = {
    "get_endpoint": lambda c, box, uid: get_endpoint(c, uid, scope="a"),
    "set_enabled": lambda c, box, uid: set_enabled(
        c, uid, enabled=False, reason="x", actor="t", scope="a"
    ),
    "update_endpoint": lambda c, box, uid: endpoint_ops.update_endpoint(
        c, uid, actor="t", description="x", scope="a"
    ),
    "rotate_secret": lambda c, box, uid: endpoint_ops.rotate_secret(
        c, box, uid, actor="t", now=NOW, grace=dt.timedelta(0), scope="a"
    ),
    "delete_endpoint": lambda c, box, uid: endpoint_ops.delete_endpoint(
        c, uid, actor="t", reason="x", force=True, scope="a"
    ),
    "reveal_secret": lambda c, box, uid: reveal_secret(
        c, box, uid, actor="t", reason="x", scope="a"
    ),
    "get_delivery_rules": lambda c, box, uid: get_delivery_rules(c, uid, scope="a"),
    "set_delivery_rules": lambda c, box, uid: set_delivery_rules(
        c, uid, DeliveryRules(max_attempts=2), actor="t", scope="a"
    ),
    "get_headers": lambda c, box, uid: get_headers(c, box, uid, scope="a"),
    "set_headers": lambda c, box, uid: set_headers(
        c, box, uid, {"x-key": "v"}, actor="t", scope="a"
    ),
    "get_endpoint_limits": lambda c, box, uid: get_endpoint_limits(c, uid, scope="a"),
    "set_endpoint_limits": lambda c, box, uid: set_endpoint_limits(
        c, uid, EndpointLimits(max_in_flight=1), actor="t", scope="a"
    ),
    "get_tenant": lambda c, box, uid: get_tenant(c, "b", scope="a"),
    "show_tenant": lambda c, box, uid: show_tenant(c, "b", scope="a"),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_another_tenants_endpoint_is_not_found_and_nothing_changes(
    engine: Engine, box: SecretBox, name: str
) -> None:
    with engine.begin() as conn:
        create_tenant(conn, "a")
        create_tenant(conn, "b")
    mine = add_endpoint(engine, box, "http://127.0.0.1:1/a", tenant="a").endpoint.uid
    theirs = add_endpoint(engine, box, "http://127.0.0.1:1/b", tenant="b").endpoint.uid
    before = rows(engine, "SELECT * FROM endpoints ORDER BY id")
    with engine.begin() as conn, pytest.raises(NotFoundError) as caught:
        CALLS[name](conn, box, theirs)
    assert "\n" not in str(caught.value)
    assert rows(engine, "SELECT * FROM endpoints ORDER BY id") == before
    assert rows(engine, "SELECT * FROM endpoint_health") == []
    assert rows(engine, "SELECT * FROM audit_log") == []
    # The same call on its own tenant's endpoint works (the scope is not simply refusing).
    with engine.begin() as conn:
        if name in ("get_tenant", "show_tenant"):
            assert get_tenant(conn, "a", scope="a").uid == "a"
        else:
            CALLS[name](conn, box, mine)


def test_a_scope_naming_no_tenant_matches_nothing_never_everything(
    engine: Engine, box: SecretBox
) -> None:
    add_endpoint(engine, box, "http://127.0.0.1:1/d")
    with engine.begin() as conn:
        from outbox import publish
        from outbox.endpoints import list_endpoints
        from outbox.stats import collect_stats, read_totals

        publish(conn, "order.created", {})
        assert list_endpoints(conn, scope="nobody") == []
        assert len(list_endpoints(conn)) == 1
        assert (
            delivery_ops.search_deliveries(conn, delivery_ops.DeliveryFilter(tenant="nobody")) == []
        )
        stats = collect_stats(conn, now=NOW + dt.timedelta(days=1), scope="nobody")
        assert stats.unrelayed_events == 0 and stats.endpoints == []
        assert collect_stats(conn, now=NOW + dt.timedelta(days=1)).unrelayed_events == 1
        assert read_totals(conn, LATENCY_BUCKETS, scope="nobody").events_published == 0


# Each write re-checks the scope itself: a lookup before it that went wrong (here made
# unscoped on purpose) must still not let a scoped caller change another tenant's rows.


async def _theirs_with_a_dead_delivery(
    engine: Engine, async_engine: AsyncEngine, box: SecretBox
) -> tuple[str, int]:
    from outbox import publish
    from outbox.clock import ManualClock
    from outbox.relay import Relay

    with engine.begin() as conn:
        create_tenant(conn, "a")
        create_tenant(conn, "b")
    add_endpoint(engine, box, "http://127.0.0.1:1/a", tenant="a")
    theirs = add_endpoint(engine, box, "http://127.0.0.1:1/b", "order.*", tenant="b")
    with engine.begin() as conn:
        publish(conn, "order.created", {}, tenant="b")
    await Relay(async_engine, ManualClock(NOW)).run_until_idle()
    with engine.begin() as conn:
        dead = conn.execute(
            text(
                "UPDATE deliveries SET state = 'dead', completed_at = :now, final_reason = 'x'"
                " RETURNING id"
            ),
            {"now": NOW},
        ).scalar_one()
    return theirs.endpoint.uid, int(dead)


WRITES: dict[str, Call] = {
    "update_endpoint": CALLS["update_endpoint"],
    "rotate_secret": CALLS["rotate_secret"],
    "delete_endpoint": CALLS["delete_endpoint"],
}


@pytest.mark.parametrize("name", sorted(WRITES))
async def test_an_endpoint_write_is_scoped_itself_not_only_by_the_lookup_before_it(
    engine: Engine,
    async_engine: AsyncEngine,
    box: SecretBox,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
) -> None:
    theirs, _ = await _theirs_with_a_dead_delivery(engine, async_engine, box)
    real = endpoint_ops.get_endpoint
    monkeypatch.setattr(endpoint_ops, "get_endpoint", lambda conn, uid, scope=None: real(conn, uid))
    before = rows(engine, "SELECT * FROM endpoints ORDER BY id")
    deliveries = rows(engine, "SELECT * FROM deliveries ORDER BY id")
    with engine.begin() as conn:
        if name == "rotate_secret":  # the write finds nothing and says so
            with pytest.raises(NotFoundError):
                WRITES[name](conn, box, theirs)
        else:
            result = WRITES[name](conn, box, theirs)
    assert rows(engine, "SELECT * FROM endpoints ORDER BY id") == before
    assert rows(engine, "SELECT * FROM deliveries ORDER BY id") == deliveries
    if name == "delete_endpoint":  # nothing of theirs counted or deleted
        assert result == {"deliveries": 0, "attempts": 0}


async def test_replay_and_discard_writes_are_scoped_themselves(
    engine: Engine,
    async_engine: AsyncEngine,
    box: SecretBox,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from outbox.errors import OperationError

    _, dead = await _theirs_with_a_dead_delivery(engine, async_engine, box)
    before = rows(engine, "SELECT * FROM deliveries ORDER BY id")
    unscoped_lock = text(
        "SELECT id, state FROM deliveries WHERE id = ANY(CAST(:ids AS bigint[]))"
        " AND CAST(:scope_id AS bigint) IS NOT DISTINCT FROM :scope_id ORDER BY id FOR UPDATE"
    )
    monkeypatch.setattr(delivery_ops.queries, "LOCK_DELIVERIES_FOR_REPLAY", unscoped_lock)
    with engine.begin() as conn, pytest.raises(OperationError, match="changed while replaying"):
        delivery_ops.replay(conn, [dead], actor="t", reason="x", now=NOW, scope="a")
    monkeypatch.setattr(
        delivery_ops, "_states", lambda conn, ids, scope: dict.fromkeys(ids, "dead")
    )
    with engine.begin() as conn, pytest.raises(OperationError, match="changed while discarding"):
        delivery_ops.discard(conn, [dead], actor="t", reason="x", now=NOW, scope="a")
    assert rows(engine, "SELECT * FROM deliveries ORDER BY id") == before


async def test_every_figure_of_scoped_stats_and_metrics_is_the_tenants_own(
    engine: Engine, async_engine: AsyncEngine, box: SecretBox
) -> None:
    """Seller b has one of everything a stats figure counts; seller a has nothing, so each
    of a's figures must be zero (and b's data is there: the unscoped figures see it)."""
    from outbox import publish
    from outbox.clock import ManualClock
    from outbox.relay import Relay
    from outbox.stats import collect_stats, read_totals

    with engine.begin() as conn:
        create_tenant(conn, "a")
        create_tenant(conn, "b")
    mine = add_endpoint(engine, box, "http://127.0.0.1:1/a", "order.*", tenant="a").endpoint.uid
    add_endpoint(engine, box, "http://127.0.0.1:1/b", "order.*", tenant="b")
    with engine.begin() as conn:
        for n in range(4):
            publish(conn, "order.created", {"n": n}, tenant="b")
    await Relay(async_engine, ManualClock(NOW)).run_until_idle()
    now = NOW + dt.timedelta(days=400)  # later than any row's own timestamp
    with engine.begin() as conn:
        publish(conn, "order.created", {"late": True}, tenant="b")  # not relayed
        conn.execute(text("UPDATE outbox_events SET created_at = :t"), {"t": now - minutes(10)})
        ids = [r.id for r in conn.execute(text("SELECT id FROM deliveries ORDER BY id"))]
        for delivery_id, state, at in [
            (ids[0], "scheduled", now - minutes(5)),  # due now
            (ids[1], "succeeded", now - minutes(10)),  # in the window
            (ids[2], "dead", now - minutes(10)),  # in the window
            (ids[3], "dead", now - minutes(90)),  # in the window before
        ]:
            conn.execute(
                text(
                    "UPDATE deliveries SET state = :state, next_attempt_at = :at,"
                    " completed_at = CASE WHEN :state = 'scheduled' THEN NULL"
                    " ELSE CAST(:at AS timestamptz) END WHERE id = :id"
                ),
                {"state": state, "at": at, "id": delivery_id},
            )
        for delivery_id, outcome, error in [
            (ids[1], "succeeded", None),
            (ids[2], "permanent", "b"),
        ]:
            conn.execute(
                text(
                    "INSERT INTO delivery_attempts (delivery_id, attempt_number, started_at,"
                    " duration_ms, status_code, outcome, error, worker_id)"
                    " VALUES (:id, 1, :at, 5, 200, :outcome, :error, 'w')"
                ),
                {"id": delivery_id, "at": now - minutes(10), "outcome": outcome, "error": error},
            )
        # what retention pruned of b's history stays in b's totals (and nobody else's)
        conn.execute(
            text(
                "INSERT INTO pruned_totals (tenant_id, name, value)"
                " SELECT id, 'events', 7 FROM tenants WHERE uid = 'b'"
            )
        )
    with engine.begin() as conn:
        ours = collect_stats(conn, now=now, scope="a")
        everyone = collect_stats(conn, now=now)
        our_totals = read_totals(conn, LATENCY_BUCKETS, scope="a")
        all_totals = read_totals(conn, LATENCY_BUCKETS)
    assert set(ours.counts_by_state.values()) == {0}
    assert (ours.due_now, ours.oldest_due_age_seconds) == (0, None)
    assert (ours.unrelayed_events, ours.relay_lag_seconds) == (0, None)
    assert ours.window == dict.fromkeys(everyone.window, 0)
    assert ours.top_errors == []
    assert [(e.uid, e.attempts, e.pending, e.dead) for e in ours.endpoints] == [(mine, 0, 0, 0)]
    assert (our_totals.events_published, our_totals.latency_count) == (0, 0)
    # b's rows are there and counted when unscoped
    assert everyone.due_now == 1 and everyone.unrelayed_events >= 1
    assert min(everyone.window.values()) >= 1, everyone.window
    assert [e.error for e in everyone.top_errors] == ["b"]
    assert all_totals.events_published >= 5 + 7 and all_totals.latency_count == 2


def minutes(n: int) -> dt.timedelta:
    return dt.timedelta(minutes=n)
