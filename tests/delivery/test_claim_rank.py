"""A claim among many tenants finds its batch from the oldest due rows (the quick path,
queries.QUICK_CLAIM_GATES): the same endpoints as health.choose_endpoints over every
candidate (LOCK_CLAIM_GATES), read at the cost of a batch, not of every endpoint with due
work; when it cannot tell, the claim falls back to every candidate. Real PostgreSQL, a
manual clock."""

from __future__ import annotations

import datetime as dt
import random
from collections import Counter
from collections.abc import AsyncIterator, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery import health
from delivery import queries as delivery_queries
from delivery.http import build_http_client
from delivery.worker import Worker, WorkerConfig
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.tenants import create_tenant
from tests.helpers import LOOPBACK, add_endpoint, rows, scalar

CONFIG = health.HealthConfig()


def execute(engine: Engine, sql: str, **params: Any) -> None:
    with engine.begin() as conn:
        conn.execute(text(sql), params)


@dataclass
class World:
    """Tenants, endpoints and their deliveries, built set-based."""

    tenants: list[int] = field(default_factory=list)
    endpoints: dict[int, int] = field(default_factory=dict)  # endpoint id -> tenant id


def build(
    engine: Engine,
    tenant_endpoints: list[int],
    deliveries: list[tuple[int, int, int, dt.datetime, str]],
) -> World:
    """Fresh tenants (`tenant_endpoints[i]` endpoints each) and deliveries given as
    (tenant index, endpoint index within it, priority, due, state)."""
    execute(
        engine,
        "TRUNCATE tenants, endpoints, outbox_events, deliveries, endpoint_health, "
        "tenant_buckets CASCADE",
    )
    world = World()
    with engine.begin() as conn:
        for t, count in enumerate(tenant_endpoints):
            tid = conn.execute(
                text("INSERT INTO tenants (uid) VALUES (:uid) RETURNING id"), {"uid": f"t{t}"}
            ).scalar_one()
            world.tenants.append(tid)
            for e in range(count):
                eid = conn.execute(
                    text(
                        "INSERT INTO endpoints (uid, tenant_id, url, event_types, signing_secret)"
                        " VALUES (:uid, :t, 'http://127.0.0.1:1/x', ARRAY['*'], 'unused')"
                        " RETURNING id"
                    ),
                    {"uid": f"ep{t}_{e}", "t": tid},
                ).scalar_one()
                world.endpoints[eid] = tid
        by_tenant = {
            t: [eid for eid, owner in world.endpoints.items() if owner == tid]
            for t, tid in enumerate(world.tenants)
        }
    add_deliveries(
        engine,
        [
            (by_tenant[t][e], world.tenants[t], priority, due, state)
            for t, e, priority, due, state in deliveries
        ],
    )
    return world


def add_deliveries(engine: Engine, spec: list[tuple[int, int, int, dt.datetime, str]]) -> None:
    """Deliveries (endpoint id, tenant id, priority, due, state), one event each, ids in
    the order given."""
    with engine.begin() as conn:
        conn.execute(
            text(
                """
                WITH spec AS (
                    SELECT * FROM unnest(CAST(:endpoints AS bigint[]), CAST(:tenants AS bigint[]),
                                         CAST(:priorities AS int[]), CAST(:dues AS timestamptz[]),
                                         CAST(:states AS text[]))
                        WITH ORDINALITY AS s(endpoint_id, tenant_id, priority, due, state, n)
                ), ev AS (
                    INSERT INTO outbox_events (message_id, tenant_id, event_type, payload,
                                               relayed_at)
                    SELECT 'msg_' || n, tenant_id, 'x.y', '{}'::jsonb, due FROM spec
                    RETURNING id, message_id
                )
                INSERT INTO deliveries (event_id, endpoint_id, tenant_id, state, max_attempts,
                                        next_attempt_at, priority, locked_by, lease_expires_at)
                SELECT ev.id, s.endpoint_id, s.tenant_id, s.state, 5, s.due, s.priority,
                       CASE WHEN s.state = 'in_flight' THEN 'w' END,
                       CASE WHEN s.state = 'in_flight' THEN s.due + interval '1 hour' END
                FROM spec s JOIN ev ON ev.message_id = 'msg_' || s.n
                ORDER BY s.n
                """
            ),
            {
                "endpoints": [s[0] for s in spec],
                "tenants": [s[1] for s in spec],
                "priorities": [s[2] for s in spec],
                "dues": [s[3] for s in spec],
                "states": [s[4] for s in spec],
            },
        )
        # Storage order is not id order (as after retries): a third of the rows move to
        # the end of the table, with new index entries.
        for step in ("+ 1", "- 1"):
            conn.execute(text(f"UPDATE deliveries SET priority = priority {step} WHERE id % 3 = 1"))
    execute(engine, "ANALYZE")


@dataclass(frozen=True)
class Choice:
    endpoints: frozenset[int]
    budgets: dict[int, int]
    tenant_budgets: dict[int, int]
    per_endpoint: int
    more: bool
    path: str
    spread: int


async def choose(
    async_engine: AsyncEngine,
    now: dt.datetime,
    limit: int,
    set_aside: Collection[int] = frozenset(),
    local: Mapping[int, int] | None = None,
    *,
    reference: bool = False,
) -> Choice:
    """What one claim round would visit: as the worker asks while a batch of tenants have
    work (the quick path first), or the `reference`: every candidate from
    LOCK_CLAIM_GATES, chosen by health.choose_endpoints."""
    async with async_engine.connect() as conn:
        if reference:
            gates = await health.open_gates(conn, now=now, config=CONFIG)
        else:
            gates = await health.open_gates(
                conn, now=now, config=CONFIG, limit=limit, set_aside=set_aside, local_caps=local
            )
        await conn.rollback()
    params = gates.params(limit, local, set_aside)
    chosen = frozenset(params["endpoint_ids"])
    budgets = dict(zip(params["gate_ids"], params["gate_budgets"], strict=True))
    tenant_budgets = dict(
        zip(params["tenant_gate_ids"], params["tenant_gate_budgets"], strict=True)
    )
    owners = gates.tenant_of
    return Choice(
        endpoints=chosen,
        # what the claim statement applies to the chosen endpoints and their tenants
        budgets={eid: b for eid, b in budgets.items() if eid in chosen},
        tenant_budgets={
            tid: b for tid, b in tenant_budgets.items() if tid in {owners[e] for e in chosen}
        },
        per_endpoint=params["per_endpoint"],
        more=params["more"],
        path=gates.path,
        spread=gates.spread,
    )


async def assert_same_batch(
    async_engine: AsyncEngine,
    now: dt.datetime,
    limit: int,
    set_aside: Collection[int] = frozenset(),
    local: Mapping[int, int] | None = None,
) -> str:
    """The worker's way chooses what the reference chooses; returns the path it took."""
    reference = await choose(async_engine, now, limit, set_aside, local, reference=True)
    got = await choose(async_engine, now, limit, set_aside, local)
    context = (got.path, limit, sorted(set_aside), local)
    assert got.endpoints == reference.endpoints, context
    assert got.budgets == reference.budgets, context
    assert got.tenant_budgets == reference.tenant_budgets, context
    assert got.per_endpoint == reference.per_endpoint, context
    # The quick path's `more` may say "maybe" where the reference knows there is nothing
    # more (at worst one more claim round), never the other way round.
    assert got.more or not reference.more, context
    if got.path == "all":
        assert got.more == reference.more
    return got.path


@pytest.mark.slow  # many generated worlds
async def test_the_quick_path_chooses_what_choose_endpoints_chooses_over_varied_worlds(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock
) -> None:
    now = clock.now()
    seconds = dt.timedelta(seconds=1)
    paths: Counter[str] = Counter()
    for seed in range(60):
        rng = random.Random(seed)
        plain = seed % 2 == 0  # half the worlds have no gates, caps or disabled rows
        tenant_endpoints = [rng.randint(1, 4) for _ in range(rng.randint(1, 14))]
        deliveries = []
        for t, count in enumerate(tenant_endpoints):
            for e in range(count):
                for _ in range(rng.choice([0, 1, 1, 2, 3, 5])):
                    # few distinct moments and ids in no particular order: ties are common
                    due = now + rng.choice([-3, -2, -1, -1, 0, 0, 60]) * seconds
                    priority = rng.choice([0, 0, 0, 0, 0, 5] if rng.random() < 0.3 else [0])
                    state = rng.choice(["scheduled"] * 8 + ["in_flight", "succeeded"])
                    deliveries.append((t, e, priority, due, state))
        rng.shuffle(deliveries)
        world = build(engine, tenant_endpoints, deliveries)
        endpoints = list(world.endpoints)
        if not plain:
            twists = rng.sample(endpoints, k=min(len(endpoints), 4))
            for kind, eid in zip(["disabled", "gated", "paused", "open"], twists, strict=False):
                if kind == "disabled":
                    execute(
                        engine,
                        "UPDATE endpoints SET enabled = false, disabled_reason = 'x' WHERE id = :i",
                        i=eid,
                    )
                else:
                    execute(
                        engine,
                        "INSERT INTO endpoint_health (endpoint_id, max_in_flight, paused_until,"
                        " breaker_state, open_until) VALUES (:i, :m, :p, :b, :o)",
                        i=eid,
                        m=rng.choice([1, 2]) if kind == "gated" else None,
                        p=now + 60 * seconds if kind == "paused" else None,
                        b="open" if kind == "open" else "closed",
                        o=now + 60 * seconds if kind == "open" else None,
                    )
            for tid in rng.sample(world.tenants, k=min(len(world.tenants), 2)):
                column, value = rng.choice(
                    [("max_in_flight", 1), ("max_in_flight", 3), ("max_per_second", 2.0)]
                )
                execute(engine, f"UPDATE tenants SET {column} = :v WHERE id = :i", v=value, i=tid)
            if rng.random() < 0.5:
                execute(
                    engine,
                    "UPDATE tenants SET enabled = false, disabled_reason = 'x' WHERE id = :i",
                    i=rng.choice(world.tenants),
                )
        for limit in (1, 2, 3, 5, 8, 40):
            set_aside = {e for e in endpoints if rng.random() < 0.15}
            local = {e: rng.choice([0, 0, 1, 2]) for e in endpoints if rng.random() < 0.2}
            paths[await assert_same_batch(async_engine, now, limit)] += 1
            paths[await assert_same_batch(async_engine, now, limit, set_aside, local)] += 1
    # Both paths were taken, each many times.
    assert paths["quick"] >= 40 and paths["all"] >= 40, paths


def spread_world(
    engine: Engine, tenants: int, per_tenant: int, rows: int, now: dt.datetime
) -> World:
    """`tenants` tenants of `per_tenant` endpoints, `rows` due deliveries per endpoint, due
    round robin: each endpoint's first row before any second one, tenant 0 first."""
    deliveries = [
        (t, e, 0, now - dt.timedelta(seconds=1000 - 100 * r - 10 * e - 0.01 * t), "scheduled")
        for r in range(rows)
        for e in range(per_tenant)
        for t in range(tenants)
    ]
    return build(engine, [per_tenant] * tenants, deliveries)


async def test_the_quick_path_falls_back_when_a_gate_a_cap_or_a_disabled_row_is_in_the_batch(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock
) -> None:
    now = clock.now()
    world = spread_world(engine, 12, 2, 2, now)
    first = [min(e for e, t in world.endpoints.items() if t == tid) for tid in world.tenants]
    # Plain: the five oldest tenants' first endpoints, from the oldest due rows alone.
    plain = await choose(async_engine, now, 5)
    assert plain.path == "quick"
    assert plain.endpoints == set(first[:5])
    # spread: the tenants among the walked rows (four times a batch), at least
    assert plain.more and plain.spread == 12
    assert await assert_same_batch(async_engine, now, 5) == "quick"

    async def fallback(expected: set[int]) -> None:
        assert await assert_same_batch(async_engine, now, 5) == "all"
        assert (await choose(async_engine, now, 5)).endpoints == expected

    # A gated endpoint in the batch with budget left (a concurrency limit, fixed or
    # adaptive): still quick, its row locked and its budget applied.
    execute(
        engine,
        "INSERT INTO endpoint_health (endpoint_id, max_in_flight) VALUES (:i, 4)",
        i=first[2],
    )
    assert await assert_same_batch(async_engine, now, 5) == "quick"
    gated = await choose(async_engine, now, 5)
    assert gated.endpoints == set(first[:5]) and gated.budgets == {first[2]: 4}
    execute(
        engine,
        "UPDATE endpoint_health SET max_in_flight = NULL, adaptive = true WHERE endpoint_id = :i",
        i=first[2],
    )
    assert await assert_same_batch(async_engine, now, 5) == "quick"
    # adaptive without a maximum of its own: the limiter's first limit under the default
    assert (await choose(async_engine, now, 5)).budgets == {first[2]: 4}
    # ... and at its limit (budget 0): left out of the walk, the next tenant moves up,
    # still from the quick path (it looks again without that endpoint).
    execute(
        engine, "UPDATE endpoint_health SET adaptive_limit = 1 WHERE endpoint_id = :i", i=first[2]
    )
    execute(
        engine,
        "UPDATE deliveries SET state = 'in_flight', locked_by = 'w', lease_expires_at = :at"
        " WHERE id = (SELECT max(id) FROM deliveries WHERE endpoint_id = :e)",
        at=now + dt.timedelta(hours=1),
        e=first[2],
    )
    assert await assert_same_batch(async_engine, now, 5) == "quick"
    assert (await choose(async_engine, now, 5)).endpoints == {*first[:2], *first[3:6]}
    execute(
        engine,
        "UPDATE deliveries SET state = 'scheduled', locked_by = NULL, lease_expires_at = NULL"
        " WHERE state = 'in_flight'",
    )
    execute(engine, "DELETE FROM endpoint_health")
    # A capped tenant in the batch, out of budget: its turn goes to the next tenant.
    execute(engine, "UPDATE tenants SET max_in_flight = 1 WHERE id = :i", i=world.tenants[1])
    execute(
        engine,
        "UPDATE deliveries SET state = 'in_flight', locked_by = 'w', lease_expires_at = :at"
        " WHERE id = (SELECT max(id) FROM deliveries WHERE tenant_id = :t)",
        at=now + dt.timedelta(hours=1),
        t=world.tenants[1],
    )
    await fallback({first[0], *first[2:6]})
    execute(engine, "UPDATE tenants SET max_in_flight = NULL")
    # A disabled endpoint in the batch: left out, the next tenant moves up.
    execute(
        engine,
        "UPDATE endpoints SET enabled = false, disabled_reason = 'x' WHERE id = :i",
        i=first[0],
    )
    await fallback(set(first[1:6]))
    # A disabled tenant in the batch: its deliveries wait, the next tenant moves up.
    execute(engine, "UPDATE endpoints SET enabled = true, disabled_reason = NULL")
    execute(
        engine,
        "UPDATE tenants SET enabled = false, disabled_reason = 'x' WHERE id = :i",
        i=world.tenants[3],
    )
    await fallback({*first[:3], *first[4:6]})
    # Disabled, gated and capped rows behind the batch change nothing: quick again.
    execute(
        engine,
        "UPDATE tenants SET enabled = (id <> :i), disabled_reason = CASE WHEN id = :i THEN 'x' END",
        i=world.tenants[11],
    )
    execute(engine, "UPDATE tenants SET max_per_second = 1 WHERE id = :i", i=world.tenants[10])
    execute(
        engine,
        "INSERT INTO endpoint_health (endpoint_id, paused_until) VALUES (:i, :p)",
        i=first[9],
        p=now + dt.timedelta(minutes=1),
    )
    assert await assert_same_batch(async_engine, now, 5) == "quick"
    assert (await choose(async_engine, now, 5)).endpoints == set(first[:5])
    # Tenant 0's second endpoint is due just after its first, before tenant 1's: its
    # second turn. Its first endpoint set aside (last, its turn kept): the next five
    # tenants' first turns, from the quick path.
    second_of_0 = max(e for e, t in world.endpoints.items() if t == world.tenants[0])
    execute(
        engine,
        "UPDATE deliveries SET next_attempt_at = :t WHERE endpoint_id = :e",
        t=now - dt.timedelta(seconds=999.999),
        e=second_of_0,
    )
    assert (await choose(async_engine, now, 5, {first[0]})).endpoints == set(first[1:6])
    assert await assert_same_batch(async_engine, now, 5, {first[0]}) == "quick"
    # The set-aside endpoint disabled: tenant 0's second endpoint takes the first turn and
    # the oldest place. Set-aside endpoints are checked too, so the answer falls back.
    execute(
        engine,
        "UPDATE endpoints SET enabled = false, disabled_reason = 'x' WHERE id = :i",
        i=first[0],
    )
    assert await assert_same_batch(async_engine, now, 5, {first[0]}) == "all"
    assert (await choose(async_engine, now, 5, {first[0]})).endpoints == {
        second_of_0,
        *first[1:5],
    }


async def test_the_quick_path_answers_more_and_spread(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock
) -> None:
    now = clock.now()
    # Six tenants of one endpoint with one due row each: a batch of six takes them all.
    spread_world(engine, 6, 1, 1, now)
    whole = await choose(async_engine, now, 6)
    assert (whole.path, whole.more, whole.spread, len(whole.endpoints)) == ("quick", False, 6, 6)
    fewer = await choose(async_engine, now, 4)
    assert (fewer.path, fewer.more, fewer.spread) == ("quick", True, 6)
    # Fewer tenants than the batch: the quick path cannot answer; every candidate is read,
    # and `spread` counts their tenants (the worker's cue not to try the quick path).
    spread_world(engine, 3, 4, 1, now)
    few = await choose(async_engine, now, 8)
    assert (few.path, few.more, few.spread, len(few.endpoints)) == ("all", True, 3, 8)
    assert (await choose(async_engine, now, 12)).more is False
    # A higher priority due anywhere: only its rows are walked; not due yet: ignored.
    world = spread_world(engine, 8, 1, 2, now)
    urgent = list(world.endpoints)[-3:]
    execute(
        engine,
        "UPDATE deliveries SET priority = 9 WHERE id IN"
        " (SELECT max(id) FROM deliveries WHERE endpoint_id = ANY(:e) GROUP BY endpoint_id)",
        e=urgent,
    )
    assert (await choose(async_engine, now, 3)).endpoints == set(urgent)
    assert (await choose(async_engine, now, 3)).path == "quick"
    assert await assert_same_batch(async_engine, now, 3) == "quick"
    execute(
        engine,
        "UPDATE deliveries SET next_attempt_at = :t WHERE priority = 9",
        t=now + dt.timedelta(minutes=1),
    )
    assert (await choose(async_engine, now, 3)).endpoints == set(list(world.endpoints)[:3])
    assert await assert_same_batch(async_engine, now, 3) == "quick"


async def test_an_endpoints_head_is_its_first_due_row_in_claim_order_whatever_the_storage(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock
) -> None:
    now = clock.now()
    due = now - dt.timedelta(seconds=5)
    # Tenant 0's endpoint has rows 1 and 3, tenant 1's endpoint row 2, all due at once.
    world = build(
        engine,
        [1, 1],
        [(0, 0, 0, due, "scheduled"), (1, 0, 0, due, "scheduled"), (0, 0, 0, due, "scheduled")],
    )
    a, b = world.endpoints
    first = int(scalar(engine, "SELECT min(id) FROM deliveries WHERE endpoint_id = :e", e=a))
    # Row 1 is rewritten (a retry would do the same): stored after row 3 now.
    for step in ("+ 1", "- 1"):
        execute(engine, f"UPDATE deliveries SET priority = priority {step} WHERE id = :i", i=first)
    assert (
        scalar(
            engine,
            "SELECT id FROM deliveries WHERE endpoint_id = :e ORDER BY ctid LIMIT 1",
            e=a,
        )
        != first
    )
    # Row 1 is the oldest in claim order (due time, then id): a batch of one visits its
    # endpoint, whichever way the claim asks.
    assert (await choose(async_engine, now, 1, reference=True)).endpoints == {a}
    assert await assert_same_batch(async_engine, now, 1) == "quick"
    assert b not in (await choose(async_engine, now, 1)).endpoints


def relations_read(plan: dict[str, Any]) -> dict[str, float]:
    """Rows each table's scans produced or filtered out, over all loops (EXPLAIN ANALYZE)."""
    read: Counter[str] = Counter()

    def walk(node: dict[str, Any]) -> None:
        relation = node.get("Relation Name")
        if relation:
            seen = node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)
            read[relation] += seen * node.get("Actual Loops", 1)
        for child in node.get("Plans", []):
            walk(child)

    walk(plan["Plan"])
    return dict(read)


async def test_a_claim_among_many_busy_endpoints_reads_a_batch_not_every_endpoint(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock
) -> None:
    now = clock.now()
    spread_world(engine, 100, 6, 2, now)  # 600 busy endpoints in 100 tenants
    # and idle tenants beside them (with a hundred, a scan of the table is the cheaper probe)
    execute(engine, "INSERT INTO tenants (uid) SELECT 'idle' || g FROM generate_series(1, 5000) g")
    execute(engine, "ANALYZE tenants")
    params = {"limit": 20, "walk": 80, "set_aside": [], "excluded": [], "now": now}

    async def read(statement: Any) -> dict[str, float]:
        async with async_engine.connect() as conn:
            plan = (
                await conn.execute(
                    text("EXPLAIN (ANALYZE, FORMAT JSON) " + str(statement.text)), params
                )
            ).scalar_one()[0]
            await conn.rollback()
        return relations_read(plan)

    everything = await read(delivery_queries.LOCK_CLAIM_GATES)
    assert everything["endpoints"] >= 600 and everything["deliveries"] >= 600
    quick = await read(delivery_queries.QUICK_CLAIM_GATES)
    # the walk (4 rows per endpoint of the batch) and a few probes; the batch's catalogue
    assert quick["deliveries"] <= 80 + 10, quick
    assert quick.get("endpoints", 0) <= 20 and quick.get("tenants", 0) <= 20, quick
    assert quick.get("endpoint_health", 0) <= 20, quick
    assert (await choose(async_engine, now, 20)).path == "quick"
    # Every endpoint adaptive (the default for new endpoints), so every one is gated: the
    # claim still reads and locks the batch's health rows only, never every endpoint's.
    execute(
        engine, "INSERT INTO endpoint_health (endpoint_id, adaptive) SELECT id, true FROM endpoints"
    )
    execute(engine, "ANALYZE endpoint_health")
    quick = await read(delivery_queries.QUICK_CLAIM_GATES)
    assert quick["deliveries"] <= 80 + 10, quick
    assert quick.get("endpoints", 0) <= 20 and quick.get("tenants", 0) <= 20, quick
    assert quick.get("endpoint_health", 0) <= 40, quick  # plain, then gated: one probe each
    params["ids"] = [r["id"] for r in rows(engine, "SELECT id FROM endpoints ORDER BY id LIMIT 20")]
    assert (await read(delivery_queries.LOCK_GATED_HEALTH)).get("endpoint_health", 0) <= 20
    assert await assert_same_batch(async_engine, now, 20) == "quick"


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with build_http_client(max_connections=10, timeout=5, allowed_networks=LOOPBACK) as c:
        yield c


async def test_the_worker_tries_the_quick_path_while_a_batch_of_tenants_have_work(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    http: httpx.AsyncClient,
) -> None:
    now = clock.now()
    spec = []
    for t in range(30):
        with engine.begin() as conn:
            tid = create_tenant(conn, f"t{t}")
        for e in range(2):
            eid = add_endpoint(engine, box, f"http://127.0.0.1:1/{t}/{e}", "*", tenant=f"t{t}")
            due = now - dt.timedelta(seconds=1000 - t - 0.001 * e)
            spec.append((eid.endpoint.id, tid, 0, due, "scheduled"))
    add_deliveries(engine, spec)
    w = Worker(async_engine, http, box, clock, WorkerConfig(retry_schedule=(1.0,)))

    async def claim(limit: int) -> None:
        reference = await choose(async_engine, now, limit, reference=True)
        claimed = await w.claim(limit)
        # one due delivery per endpoint: the endpoints served are the endpoints visited
        assert {c.endpoint_id for c in claimed} == reference.endpoints
        assert len(claimed) == limit

    # The ten oldest tenants' first turns, then their second endpoints' (round robin across
    # tenants first), found from the oldest due rows alone.
    await claim(10)
    await claim(10)
    assert w.gate_paths == {"quick": 2}
    # Twenty tenants left, fewer than a claim of 30 wants: the last claim's walk met 25,
    # so the worker does not try the quick path and reads every candidate.
    await claim(30)
    assert w.gate_paths == {"quick": 2, "all": 1}
