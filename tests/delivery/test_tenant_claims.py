"""Tenants on the send path: the routing index, claims that start from due work, fairness
and caps across tenants, disabled tenants holding their deliveries, and isolation through
retries and ordering keys. Real PostgreSQL, real receivers on 127.0.0.1, a manual clock."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.health import EndpointLimits, set_endpoint_limits
from delivery.http import build_http_client
from delivery.receiver import Behaviour, ReceivedRequest, Receiver
from delivery.worker import ClaimedDelivery, Worker, WorkerConfig
from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.endpoints import delete_endpoint, update_endpoint
from outbox.relay import Relay
from outbox.tenants import create_tenant
from tests.helpers import LOOPBACK, add_endpoint, rows, scalar


def tenants(engine: Engine, *uids: str) -> None:
    with engine.begin() as conn:
        for uid in uids:
            create_tenant(conn, uid)


def tenant_id(engine: Engine, uid: str) -> int:
    return int(scalar(engine, "SELECT id FROM tenants WHERE uid = :uid", uid=uid))


def execute(engine: Engine, sql: str, **params: Any) -> None:
    with engine.begin() as conn:
        conn.execute(text(sql), params)


def flood(
    engine: Engine, tenant: str, endpoint_ids: list[int], count: int, due: dt.datetime
) -> None:
    """`count` relayed events of `tenant` with one due delivery each, spread over the
    endpoints: built set-based, so a 100,000-row flood takes a second or two."""
    execute(
        engine,
        """
        WITH ev AS (
            INSERT INTO outbox_events (message_id, tenant_id, event_type, payload, relayed_at)
            SELECT 'msg_flood_' || :tenant || '_' || g, t.id, 'bulk.row', '{}'::jsonb, :due
            FROM generate_series(1, :count) AS g, tenants t WHERE t.uid = :tenant
            RETURNING id, tenant_id
        )
        INSERT INTO deliveries (event_id, endpoint_id, tenant_id, state, max_attempts,
                                next_attempt_at)
        SELECT ev.id, (CAST(:endpoints AS bigint[]))[1 + ev.id % :k], ev.tenant_id,
               'scheduled', 5, :due
        FROM ev
        """,
        tenant=tenant,
        endpoints=endpoint_ids,
        k=len(endpoint_ids),
        count=count,
        due=due,
    )
    execute(engine, "ANALYZE deliveries")


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with build_http_client(max_connections=50, timeout=5, allowed_networks=LOOPBACK) as c:
        yield c


def worker(
    engine: AsyncEngine, http: httpx.AsyncClient, box: SecretBox, clock: ManualClock, **kw: Any
) -> Worker:
    return Worker(engine, http, box, clock, WorkerConfig(retry_schedule=(1.0,), **kw))


def by_endpoint(claimed: list[ClaimedDelivery]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for item in claimed:
        counts[item.endpoint_uid] = counts.get(item.endpoint_uid, 0) + 1
    return counts


# -- routing through the index --------------------------------------------------------------


async def test_patterns_route_through_the_index_and_follow_edits_and_deletes(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    tenants(engine, "t1", "t2")
    star = add_endpoint(engine, box, "http://127.0.0.1:1/star", "*", tenant="t1").endpoint
    exact = add_endpoint(engine, box, "http://127.0.0.1:1/ex", "a.b.c", tenant="t1").endpoint
    a = add_endpoint(engine, box, "http://127.0.0.1:1/a", "a.*", tenant="t1").endpoint
    ab = add_endpoint(engine, box, "http://127.0.0.1:1/ab", "a.b.*, x.y", tenant="t1").endpoint
    other = add_endpoint(engine, box, "http://127.0.0.1:1/t2", "*", tenant="t2").endpoint
    # Never matches an 'a.b' or 'ab.c' lookalike: prefixes end at a dot.
    lookalike = add_endpoint(engine, box, "http://127.0.0.1:1/ab2", "a.b.c.*", tenant="t1").endpoint
    index = rows(engine, "SELECT endpoint_id, pattern, tenant_id FROM endpoint_subscriptions")
    assert {(r["endpoint_id"], r["pattern"]) for r in index} >= {(ab.id, "a.b.*"), (ab.id, "x.y")}
    assert {r["tenant_id"] for r in index} == {tenant_id(engine, "t1"), tenant_id(engine, "t2")}

    async def routed(event_type: str) -> set[str]:
        with engine.begin() as conn:
            message = publish(conn, event_type, {}, tenant="t1")
        await Relay(async_engine, clock).run_until_idle()
        got = rows(
            engine,
            """SELECT e.uid FROM deliveries d JOIN endpoints e ON e.id = d.endpoint_id
               JOIN outbox_events ev ON ev.id = d.event_id WHERE ev.message_id = :m""",
            m=message,
        )
        return {r["uid"] for r in got}

    assert await routed("a.b.c") == {star.uid, exact.uid, a.uid, ab.uid}
    assert await routed("a.b") == {star.uid, a.uid}
    assert await routed("ab.c") == {star.uid}
    assert await routed("a.b.c.d") == {star.uid, a.uid, ab.uid, lookalike.uid}
    assert await routed("x.y") == {star.uid, ab.uid}
    assert other.uid not in await routed("zzz")

    # Edits keep the index in step: new patterns route, old ones no longer do.
    with engine.begin() as conn:
        update_endpoint(conn, ab.uid, event_types="q.*", actor="test", reason="test")
    assert await routed("a.b.x") == {star.uid, a.uid}
    assert await routed("q.r") == {star.uid, ab.uid}
    # A deleted endpoint leaves the index with its rows.
    with engine.begin() as conn:
        delete_endpoint(conn, a.uid, force=True, actor="test", reason="test")
    assert (
        scalar(engine, "SELECT count(*) FROM endpoint_subscriptions WHERE endpoint_id = :i", i=a.id)
        == 0
    )
    assert await routed("a.z") == {star.uid}
    # Becoming an all-tenants endpoint moves its index rows to tenant NULL.
    execute(engine, "UPDATE endpoints SET all_tenants = true WHERE id = :i", i=other.id)
    assert await routed("zzz") == {star.uid, other.uid}
    # A disabled endpoint is still indexed but gets nothing.
    execute(
        engine,
        "UPDATE endpoints SET enabled = false, disabled_reason = 'x' WHERE id = :i",
        i=star.id,
    )
    assert await routed("zzz") == {other.uid}


# -- fairness, caps and disabled tenants in the claim ------------------------------------------


async def test_a_tenants_flood_does_not_delay_another_tenants_first_delivery_past_one_batch(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    http: httpx.AsyncClient,
) -> None:
    tenants(engine, "flood", "small")
    flooders = [
        add_endpoint(engine, box, f"http://127.0.0.1:1/f{i}", "bulk.*", tenant="flood").endpoint.id
        for i in range(20)
    ]
    small = add_endpoint(engine, box, "http://127.0.0.1:1/small", "*", tenant="small").endpoint
    # 100,000 due deliveries over 20 endpoints, all due before the small tenant's one.
    flood(engine, "flood", flooders, 100_000, clock.now() - dt.timedelta(hours=1))
    with engine.begin() as conn:
        publish(conn, "order.created", {}, tenant="small")
    await Relay(async_engine, clock).run_until_idle()

    claimed = await worker(async_engine, http, box, clock).claim(10)
    # Round robin across tenants first: the small tenant's delivery is in the first batch
    # (with endpoints alone it would wait behind the flood's 20 endpoints' first turns).
    assert len(claimed) == 10
    assert by_endpoint(claimed).get(small.uid) == 1


async def test_tenant_caps_bound_in_flight_and_rate_across_the_tenants_endpoints(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    http: httpx.AsyncClient,
) -> None:
    tenants(engine, "capped", "rated", "free")
    capped = [
        add_endpoint(engine, box, f"http://127.0.0.1:1/c{i}", "*", tenant="capped").endpoint.id
        for i in range(2)
    ]
    rated = [
        add_endpoint(engine, box, f"http://127.0.0.1:1/r{i}", "*", tenant="rated").endpoint.id
        for i in range(2)
    ]
    free = add_endpoint(engine, box, "http://127.0.0.1:1/free", "*", tenant="free").endpoint.id
    due = clock.now() - dt.timedelta(seconds=1)
    flood(engine, "capped", capped, 20, due)
    flood(engine, "rated", rated, 40, due)
    flood(engine, "free", [free], 20, due)
    execute(engine, "UPDATE tenants SET max_in_flight = 3 WHERE uid = 'capped'")
    execute(engine, "UPDATE tenants SET max_per_second = 5 WHERE uid = 'rated'")
    w = worker(async_engine, http, box, clock)

    def per_tenant(claimed: list[ClaimedDelivery]) -> dict[int, int]:
        owners = {
            r["id"]: r["tenant_id"] for r in rows(engine, "SELECT id, tenant_id FROM endpoints")
        }
        counts: dict[int, int] = {}
        for item in claimed:
            owner = owners[item.endpoint_id]
            counts[owner] = counts.get(owner, 0) + 1
        return counts

    ids = {uid: tenant_id(engine, uid) for uid in ("capped", "rated", "free")}
    first = per_tenant(await w.claim(100))
    assert first == {ids["capped"]: 3, ids["rated"]: 5, ids["free"]: 20}
    # Same instant: nothing more for either capped tenant.
    assert per_tenant(await w.claim(100)) == {}
    # One of the capped tenant's deliveries finishes: one more may go; the bucket refills.
    execute(
        engine,
        """UPDATE deliveries SET state = 'succeeded', locked_by = NULL, lease_expires_at = NULL,
                  completed_at = now()
           WHERE id = (SELECT min(id) FROM deliveries WHERE state = 'in_flight'
                       AND tenant_id = :t)""",
        t=ids["capped"],
    )
    clock.advance(0.4)
    assert per_tenant(await w.claim(100)) == {ids["capped"]: 1, ids["rated"]: 2}
    clock.advance(1.0)
    assert per_tenant(await w.claim(100)) == {ids["rated"]: 5}
    clock.advance(30.0)  # the bucket holds one second's worth, not thirty
    assert per_tenant(await w.claim(100)) == {ids["rated"]: 5}
    # Limits removed: the rest flows.
    execute(engine, "UPDATE tenants SET max_in_flight = NULL, max_per_second = NULL")
    assert per_tenant(await w.claim(100)) == {ids["capped"]: 16, ids["rated"]: 23}


async def test_a_disabled_tenants_deliveries_wait_and_flow_again_when_enabled(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    tenants(engine, "paused", "active")
    add_endpoint(engine, box, receiver.route("/paused"), "*", tenant="paused")
    add_endpoint(engine, box, receiver.route("/active"), "*", tenant="active")
    execute(
        engine,
        "UPDATE tenants SET enabled = false, disabled_reason = 'unpaid' WHERE uid = 'paused'",
    )
    with engine.begin() as conn:
        for i in range(5):
            publish(conn, "order.created", {"i": i}, tenant="paused")
            publish(conn, "order.created", {"i": i}, tenant="active")
    await Relay(async_engine, clock).run_until_idle()  # fanned out: held, not dropped
    w = worker(async_engine, http, box, clock)
    await w.run_once()
    clock.advance(3600)
    await w.run_once()
    assert len(receiver.received("/active")) == 5
    assert receiver.received("/paused") == []
    held = "SELECT count(*) FROM deliveries d JOIN tenants t ON t.id = d.tenant_id"
    assert scalar(engine, held + " WHERE t.uid = 'paused' AND d.state = 'scheduled'") == 5
    assert scalar(engine, held + " WHERE t.uid = 'paused' AND d.attempts > 0") == 0

    execute(engine, "UPDATE tenants SET enabled = true, disabled_reason = NULL")
    await w.run_once()
    assert len(receiver.received("/paused")) == 5
    assert scalar(engine, held + " WHERE t.uid = 'paused' AND d.state = 'succeeded'") == 5


# -- isolation through retries and ordering keys ----------------------------------------------


def tag(request: ReceivedRequest) -> tuple[str, int]:
    data = json.loads(request.body)["data"]
    return str(data["tenant"]), int(data["i"])


async def test_retries_and_ordering_keys_never_cross_tenants(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    tenants(engine, "a", "b")
    failures = iter([500, 500])

    async def flaky(_: ReceivedRequest) -> Behaviour:
        return Behaviour(status=next(failures, 200))

    for uid, route in (("a", receiver.route("/a", flaky)), ("b", receiver.route("/b"))):
        endpoint = add_endpoint(engine, box, route, "order.*", tenant=uid).endpoint
        with engine.begin() as conn:
            set_endpoint_limits(conn, endpoint.uid, EndpointLimits(ordered=True), actor="test")
    with engine.begin() as conn:
        for i in range(3):
            for uid in ("a", "b"):  # the same ordering key in both tenants
                publish(conn, "order.paid", {"tenant": uid, "i": i}, tenant=uid, ordering_key="k")
    await Relay(async_engine, clock).run_until_idle()
    w = worker(async_engine, http, box, clock)
    for _ in range(3):
        await w.run_once()
    # A's failing head holds A's key only: B's events of the same key all went, in order.
    assert [tag(r) for r in receiver.received("/b")] == [("b", 0), ("b", 1), ("b", 2)]
    assert [tag(r) for r in receiver.received("/a")] == [("a", 0)]
    for _ in range(6):
        clock.advance(2)
        await w.run_once()
    # Retries went to A's endpoint only, in key order, and nothing of B's ever reached A.
    assert [tag(r) for r in receiver.received("/a")] == [
        ("a", 0),
        ("a", 0),
        ("a", 0),
        ("a", 1),
        ("a", 2),
    ]
    assert len(receiver.received("/b")) == 3
    assert scalar(engine, "SELECT count(*) FROM deliveries WHERE state <> 'succeeded'") == 0


async def test_an_unrelayed_event_holds_its_own_tenants_key_not_another_tenants(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    http: httpx.AsyncClient,
) -> None:
    tenants(engine, "a", "b")
    b_endpoint = add_endpoint(engine, box, "http://127.0.0.1:1/b", "*", tenant="b").endpoint
    with engine.begin() as conn:
        set_endpoint_limits(conn, b_endpoint.uid, EndpointLimits(ordered=True), actor="test")
    with engine.begin() as conn:
        publish(conn, "order.paid", {}, tenant="a", ordering_key="k")
        publish(conn, "order.paid", {}, tenant="b", ordering_key="k")
    other = engine.connect()
    other_tx = other.begin()
    try:
        # Another relay is fanning out tenant a's earlier event of key k right now.
        other.execute(
            text("SELECT id FROM outbox_events WHERE tenant_id = :t FOR UPDATE"),
            {"t": tenant_id(engine, "a")},
        ).all()
        await Relay(async_engine, clock).run_until_idle()
        assert scalar(engine, "SELECT count(*) FROM outbox_events WHERE relayed_at IS NULL") == 1
        claimed = await worker(async_engine, http, box, clock).claim(10)
    finally:
        other_tx.rollback()
        other.close()
    assert by_endpoint(claimed) == {b_endpoint.uid: 1}


# -- cost follows the work ----------------------------------------------------------------------

CATALOGUE = ("endpoints", "endpoint_subscriptions", "endpoint_health", "tenants", "tenant_buckets")


def rows_visited(plan: dict[str, Any]) -> dict[str, float]:
    """Rows each catalogue table's scans produced or filtered out, over all loops."""
    visited: dict[str, float] = {}

    def walk(node: dict[str, Any]) -> None:
        relation = node.get("Relation Name")
        if relation in CATALOGUE:
            seen = node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)
            seen += node.get("Rows Removed by Index Recheck", 0)
            visited[relation] = visited.get(relation, 0) + seen * node.get("Actual Loops", 1)
        for child in node.get("Plans", []):
            walk(child)

    walk(plan["Plan"])
    return visited


def idle_catalogue(engine: Engine, busy_tenant: str, count: int) -> None:
    """`count` idle endpoints over 500 tenants (some subscribed to '*'), a few idle ones of the
    busy tenant subscribed to other types, and a gated health row for each of them."""
    execute(
        engine,
        """INSERT INTO tenants (uid) SELECT 'idle-' || g FROM generate_series(1, 500) AS g""",
    )
    execute(
        engine,
        """
        INSERT INTO endpoints (uid, tenant_id, url, event_types, signing_secret)
        SELECT 'ep_idle_' || g, t.id, 'http://127.0.0.1:1/idle',
               CASE WHEN g % 3 = 0 THEN ARRAY['*'] ELSE ARRAY['order.*', 'invoice.paid'] END,
               'unused'
        FROM generate_series(1, :count) AS g
        JOIN tenants t ON t.uid = 'idle-' || (1 + g % 500)
        UNION ALL
        SELECT 'ep_idle_own_' || g, t.id, 'http://127.0.0.1:1/idle', ARRAY['invoice.*'], 'unused'
        FROM generate_series(1, 20) AS g, tenants t WHERE t.uid = :busy
        """,
        count=count,
        busy=busy_tenant,
    )
    execute(
        engine,
        "INSERT INTO endpoint_health (endpoint_id, max_in_flight) "
        "SELECT id, 5 FROM endpoints WHERE uid LIKE 'ep_idle%'",
    )
    execute(engine, "UPDATE tenants SET max_in_flight = 10 WHERE uid LIKE 'idle-%'")
    execute(engine, "ANALYZE")


async def test_relay_and_claim_do_not_visit_idle_endpoints(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    from delivery import health
    from delivery import queries as delivery_queries
    from outbox.sql import relay as relay_queries

    tenants(engine, "busy")
    busy = add_endpoint(engine, box, "http://127.0.0.1:1/busy", "order.*", tenant="busy").endpoint
    idle_catalogue(engine, "busy", 3000)
    assert scalar(engine, "SELECT count(*) FROM endpoint_subscriptions") > 4000
    with engine.begin() as conn:
        for i in range(5):
            publish(conn, "order.created", {"i": i}, tenant="busy")

    def explain(statement: Any) -> str:
        return "EXPLAIN (ANALYZE, FORMAT JSON) " + str(statement.text)

    with engine.begin() as conn:
        plan = conn.execute(
            text(explain(relay_queries.RELAY_BATCH)),
            {
                "limit": 100,
                "now": clock.now(),
                "max_attempts": 5,
                "rule_patterns": [],
                "rule_max_attempts": [],
            },
        ).scalar_one()[0]
    # The five events matched one endpoint's one pattern: nothing else was read.
    assert scalar(engine, "SELECT count(*) FROM deliveries") == 5
    relay_visits = rows_visited(plan)
    assert relay_visits.get("endpoint_subscriptions", 0) <= 5
    assert relay_visits.get("endpoints", 0) <= 5

    async with async_engine.begin() as conn:
        gates = await health.open_gates(conn, now=clock.now(), config=health.HealthConfig())
        assert [head.endpoint_id for head in gates.heads] == [busy.id]
        gate_plan = (
            await conn.execute(
                text(explain(delivery_queries.LOCK_CLAIM_GATES)), {"now": clock.now()}
            )
        ).scalar_one()[0]
        claim_plan = (
            await conn.execute(
                text(explain(delivery_queries.CLAIM_DUE_DELIVERIES)),
                {
                    "now": clock.now(),
                    "limit": 100,
                    "worker_id": "w",
                    "lease_expires_at": clock.now() + dt.timedelta(minutes=1),
                    **gates.params(100),
                },
            )
        ).scalar_one()[0]
        await conn.rollback()
    for name, visits in (("gates", rows_visited(gate_plan)), ("claim", rows_visited(claim_plan))):
        assert all(count <= 10 for count in visits.values()), (name, visits)


def test_a_claim_visits_at_most_a_batch_of_endpoints_in_its_own_order() -> None:
    from delivery.health import Head, choose_endpoints

    t0 = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    # Tenant 1 has 5 endpoints with old heads; tenant 2 one with a newer head; endpoint 9
    # has an urgent head; endpoint 8 has no budget left; tenant 3 is capped out.
    heads = [Head(i, 1, 0, t0, i) for i in range(1, 6)]
    heads += [
        Head(6, 2, 0, t0 + dt.timedelta(hours=1), 100),
        Head(9, 1, 50, t0 + dt.timedelta(hours=2), 200),
        Head(8, 2, 0, t0, 0),
        Head(7, 3, 0, t0, 0),
    ]
    chosen = choose_endpoints(heads, {8: 0}, {3: 0}, 3)
    # Priority first; then each tenant's first turn (tenant 2's newer head beats tenant 1's
    # second endpoint); never more than the batch.
    assert chosen == ([9, 1, 6], True)
    assert choose_endpoints(heads, {8: 0}, {3: 0}, 100) == ([9, 1, 6, 2, 3, 4, 5], False)
    # Endpoints set aside (nothing claimable on the last visit) come last.
    assert choose_endpoints(heads, {8: 0}, {3: 0}, 3, {9, 1}) == ([6, 2, 3], True)
    assert choose_endpoints([], {}, {}, 10) == ([], False)


async def test_an_all_tenants_endpoint_orders_each_tenants_keys_apart(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    http: httpx.AsyncClient,
) -> None:
    tenants(engine, "a", "b")
    warehouse = add_endpoint(engine, box, "http://127.0.0.1:1/w", "*", all_tenants=True).endpoint
    with engine.begin() as conn:
        set_endpoint_limits(conn, warehouse.uid, EndpointLimits(ordered=True), actor="test")
        for i in range(2):
            publish(conn, "order.paid", {"i": i}, tenant="a", ordering_key="k")
        publish(conn, "order.paid", {"i": 0}, tenant="b", ordering_key="k")
    await Relay(async_engine, clock).run_until_idle()
    w = worker(async_engine, http, box, clock)
    # The head of a's key and the head of b's key go together; a's second event waits.
    first = await w.claim(10)
    assert sorted(json.loads(c.request.body)["data"]["i"] for c in first) == [0, 0]
    # a's head still in flight holds a's key only.
    assert await w.claim(10) == []


async def test_endpoints_held_by_per_key_ordering_do_not_crowd_out_the_others(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    http: httpx.AsyncClient,
) -> None:
    stuck = [
        add_endpoint(engine, box, f"http://127.0.0.1:1/s{i}", "blk.*").endpoint for i in range(12)
    ]
    live = add_endpoint(engine, box, "http://127.0.0.1:1/live", "live.*").endpoint
    with engine.begin() as conn:
        for endpoint in stuck:
            set_endpoint_limits(conn, endpoint.uid, EndpointLimits(ordered=True), actor="test")
        first = publish(conn, "blk.x", {}, ordering_key="k")
        publish(conn, "blk.x", {}, ordering_key="k")
    await Relay(async_engine, clock).run_until_idle()
    # Every stuck endpoint's first delivery of key k is dead: the second is held (block).
    execute(
        engine,
        """UPDATE deliveries SET state = 'dead', completed_at = now()
           WHERE event_id = (SELECT id FROM outbox_events WHERE message_id = :m)""",
        m=first,
    )
    with engine.begin() as conn:
        publish(conn, "live.x", {})
    await Relay(async_engine, clock).run_until_idle()
    # The twelve held heads are older than the live one, and a claim of 10 visits 10
    # endpoints: the first visit finds nothing, the same claim goes on to the others.
    claimed = await worker(async_engine, http, box, clock).claim(10)
    assert by_endpoint(claimed) == {live.uid: 1}
