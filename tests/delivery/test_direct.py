"""The worker's hot statements on psycopg directly (outbox/direct.py): the same rows as
through SQLAlchemy, nothing of the happy path through SQLAlchemy, and the pool's
connections left as SQLAlchemy expects them after errors and lost connections.
Real PostgreSQL, a manual clock."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from sqlalchemy import DateTime, Engine, bindparam, event, text
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.util import greenlet_spawn

from delivery import health, queries
from delivery.http import AttemptResult
from delivery.policy import Outcome
from delivery.worker import ClaimedDelivery, Worker, WorkerConfig
from outbox import direct, publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.direct import Statements
from outbox.endpoint_rules import DeliveryRules, set_delivery_rules
from outbox.endpoints import set_failure_policy, set_proxy
from outbox.headers import set_headers
from outbox.relay import Relay
from tests.helpers import add_endpoint, scalar

WORKER = "direct-test"


class RolledBack(Exception):
    """Raised inside a transaction to undo it: both paths see the same rows."""


async def _both(
    async_engine: AsyncEngine, run: Callable[[Statements], Awaitable[list[Any]]]
) -> tuple[list[Any], list[Any]]:
    """`run`'s answer through SQLAlchemy and directly, each in a transaction rolled back."""
    answers: list[list[Any]] = []
    for begin in (async_engine.begin, lambda: direct.transaction(async_engine)):
        try:
            async with begin() as conn:
                answers.append(_typed(await run(conn)))
                raise RolledBack
        except RolledBack:
            pass
    return answers[0], answers[1]


def _typed(found: list[Any]) -> list[Any]:
    """Rows as (column, type, value) lists: equal values of different types differ."""
    return [[(k, type(v).__name__, v) for k, v in row._mapping.items()] for row in found]


async def _world(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    """An endpoint with every setting of its own, a plain one and an ordered one; events
    with a trace context and unicode, all relayed and due."""
    rich = add_endpoint(engine, box, "https://127.0.0.1:1/rich", "order.*").endpoint.uid
    add_endpoint(engine, box, "http://127.0.0.1:1/plain", "order.*")
    ordered = add_endpoint(engine, box, "http://127.0.0.1:1/ordered", "order.*").endpoint.uid
    with engine.begin() as conn:
        set_proxy(conn, box, rich, "http://user:pw@127.0.0.1:3128", actor="t")
        set_headers(conn, box, rich, {"X-Partner": "rich"}, actor="t")
        rules = DeliveryRules(
            timeout_seconds=3.5, retry_schedule=(1.5, 30.0), status_overrides={404: "retryable"}
        )
        set_delivery_rules(conn, rich, rules, actor="t")
        set_failure_policy(conn, rich, actor="t", on_ambiguous="hold")
        health.set_endpoint_limits(conn, ordered, health.EndpointLimits(ordered=True), actor="t")
        for index in range(3):
            message = publish(
                conn, "order.created", {"i": index, "name": "Zoë ☃"}, ordering_key="k"
            )
        conn.execute(
            text("UPDATE outbox_events SET traceparent = :t WHERE message_id = :m"),
            {"t": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "m": message},
        )
    await Relay(async_engine, clock).run_until_idle()


async def _claim(conn: Statements, now: dt.datetime, quick: bool) -> list[Any]:
    """What Claiming._claim_round runs: the gates, then the claim itself."""
    gates = await health.open_gates(
        conn, now=now, config=health.HealthConfig(), limit=10, quick=quick
    )
    params = gates.params(10, {}, ())
    params.pop("more")
    found = await conn.execute(
        queries.CLAIM_DUE_DELIVERIES,
        {
            "now": now,
            "limit": 10,
            "worker_id": WORKER,
            "lease_expires_at": now + dt.timedelta(seconds=60),
            **params,
        },
    )
    return list(found)


async def test_the_hot_statements_return_what_sqlalchemy_returns(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    await _world(engine, async_engine, clock, box)
    now = clock.now()

    async def quick_gates(conn: Statements) -> list[Any]:
        found = await conn.execute(
            queries.QUICK_CLAIM_GATES,
            {"now": now, "limit": 2, "walk": 8, "set_aside": [], "excluded": []},
        )
        return [found.one()]

    async def lock_gates(conn: Statements) -> list[Any]:
        return list(await conn.execute(queries.LOCK_CLAIM_GATES, {"now": now}))

    for statement in (quick_gates, lock_gates):
        through_sqlalchemy, directly = await _both(async_engine, statement)
        assert directly == through_sqlalchemy and directly
    for quick in (True, False):
        through_sqlalchemy, directly = await _both(
            async_engine, lambda conn, quick=quick: _claim(conn, now, quick)
        )
        # every column of every claimed row: secrets, rules, trace context, payload text
        assert directly == through_sqlalchemy
        assert len(directly) == 7  # 3 + 3 + the ordered endpoint's head of its key

    async with async_engine.begin() as conn:
        claimed = await _claim(conn, now, quick=False)
    outcomes = json.dumps(
        [
            {"id": row.id, "claim": row.claim, "state": "succeeded", "attempts": 1,
             "next_attempt_at": None, "status_code": 200, "error": None,
             "final_reason": None, "started_at": now.isoformat(), "duration_ms": 3,
             "outcome": "succeeded", "response_excerpt": "ok",
             "request_headers": {"webhook-id": row.message_id}}
            for row in claimed
        ]
    )  # fmt: skip

    async def record(conn: Statements) -> list[Any]:
        params = {"now": now, "worker_id": WORKER, "outcomes": outcomes}
        return list(await conn.execute(queries.RECORD_OUTCOMES, params))

    through_sqlalchemy, directly = await _both(async_engine, record)
    assert directly == through_sqlalchemy and len(directly) == 7


def _succeeded(claimed: ClaimedDelivery, now: dt.datetime) -> AttemptResult:
    return AttemptResult(
        delivery_id=claimed.id,
        started_at=now,
        duration_ms=1,
        outcome=Outcome.SUCCEEDED,
        status_code=200,
        response_excerpt="",
        request_headers={"webhook-id": claimed.request.message_id},
    )


async def test_the_happy_path_sends_no_statement_through_sqlalchemy(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    http: httpx.AsyncClient,
) -> None:
    """Claim and record of successes on a spotless endpoint: every statement goes to
    psycopg directly (SQLAlchemy's own statement hook never fires); a failure, which its
    breaker learns from, still goes through SQLAlchemy."""
    add_endpoint(engine, box, "http://127.0.0.1:1/hook", "order.*")
    with engine.begin() as conn:
        for index in range(4):
            publish(conn, "order.created", {"i": index})
    await Relay(async_engine, clock).run_until_idle()
    through_sqlalchemy: list[str] = []

    def seen(*args: Any) -> None:
        through_sqlalchemy.append(args[2])

    event.listen(async_engine.sync_engine, "before_cursor_execute", seen)
    worker = Worker(async_engine, http, box, clock, WorkerConfig(worker_id=WORKER))
    claimed = await worker.claim(10)
    stats = await worker.record([(c, _succeeded(c, clock.now())) for c in claimed[:3]])
    assert (len(claimed), stats.succeeded, through_sqlalchemy) == (4, 3, [])

    failed = AttemptResult(
        delivery_id=claimed[3].id,
        started_at=clock.now(),
        duration_ms=1,
        outcome=Outcome.RETRYABLE,
        status_code=500,
        error="HTTP 500",
    )
    assert (await worker.record([(claimed[3], failed)])).scheduled == 1
    assert any("endpoint_health" in sql for sql in through_sqlalchemy)


async def _pooled_autocommit(async_engine: AsyncEngine) -> bool:
    pooled = await async_engine.raw_connection()
    try:
        return bool(pooled.driver_connection.autocommit)  # type: ignore[union-attr]
    finally:
        await greenlet_spawn(pooled.close)


async def test_errors_and_lost_connections_leave_the_pool_as_sqlalchemy_expects(
    engine: Engine, async_engine: AsyncEngine
) -> None:
    """A failed statement rolls back and the connection goes back to the pool out of
    autocommit; a connection whose server process died is replaced by the pool."""
    bad = {"now": dt.datetime.now(dt.UTC), "worker_id": WORKER, "outcomes": "not json"}
    for single in (True, False):
        with pytest.raises(Exception, match="invalid input syntax for type json"):
            async with direct.transaction(async_engine, single=single) as conn:
                await conn.execute(queries.RECORD_OUTCOMES, bad)
        assert await _pooled_autocommit(async_engine) is False
    # single: each statement commits by itself, so a second one is refused, not run apart
    with pytest.raises(RuntimeError, match="a second statement"):
        async with direct.transaction(async_engine, single=True) as conn:
            await conn.execute(text("SELECT 1"))
            await conn.execute(text("SELECT 2"))
    assert await _pooled_autocommit(async_engine) is False
    assert async_engine.pool.checkedout() == 0  # type: ignore[attr-defined]

    async with direct.transaction(async_engine) as conn:
        pid = (await conn.execute(text("SELECT pg_backend_pid() AS pid"))).one().pid
    assert scalar(engine, "SELECT pg_terminate_backend(:pid)", pid=pid) is True
    # the pool's pre-ping finds the dead connection and hands out a new one
    async with direct.transaction(async_engine) as conn:
        again = (await conn.execute(text("SELECT pg_backend_pid() AS pid"))).one().pid
    assert again != pid


def test_a_statement_whose_parameters_sqlalchemy_would_convert_is_refused(
    async_engine: AsyncEngine,
) -> None:
    """A typed parameter gets SQLAlchemy's bind processing, which the direct path would
    skip: refused when compiled, naming the parameter, instead of sent differently."""
    typed = text("SELECT :at AS at, :n AS n").bindparams(bindparam("at", type_=DateTime()))
    with pytest.raises(TypeError, match=r"typed parameters \['at'\]"):
        direct.compiled_sql(typed, async_engine.dialect)
    # a literal % survives (escaped for psycopg), and a plain statement compiles once
    plain = text("SELECT '100%' AS share, :n AS n")
    assert direct.compiled_sql(plain, async_engine.dialect) == "SELECT '100%%' AS share, %(n)s AS n"
    assert direct.compiled_sql(plain, async_engine.dialect) is direct.compiled_sql(
        plain, async_engine.dialect
    )


async def test_generic_plans_hold_for_their_transaction_alone(
    engine: Engine, async_engine: AsyncEngine
) -> None:
    """The folded claim's transaction runs its statements on their generic plans (SET
    LOCAL, pipelined with BEGIN); the setting ends with the transaction, committed or
    rolled back, so no other statement on that pooled connection gets it."""
    mode = text("SELECT current_setting('plan_cache_mode') AS mode, pg_backend_pid() AS pid")
    async with direct.transaction(async_engine, generic_plans=True) as conn:
        inside = (await conn.execute(mode)).one()
    assert inside.mode == "force_generic_plan"
    with pytest.raises(Exception, match="division by zero"):
        async with direct.transaction(async_engine, generic_plans=True) as conn:
            await conn.execute(text("SELECT 1 / 0 AS x"))
    for _ in range(2):  # every connection the pool holds
        async with direct.transaction(async_engine) as conn:
            after = (await conn.execute(mode)).one()
        assert after.mode == "auto"
    assert async_engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    assert await _pooled_autocommit(async_engine) is False
    with pytest.raises(ValueError, match="generic_plans needs a transaction"):
        async with direct.transaction(async_engine, single=True, generic_plans=True):
            pass


async def test_a_held_connection_serves_transactions_until_one_fails_or_it_is_released(
    engine: Engine, async_engine: AsyncEngine
) -> None:
    """The relay's passes while it is busy: one checkout for many transactions (no pool
    pre-ping, checkout and return each time), pipelined or not; a failed transaction, or
    a server process that died meanwhile, lets go of it and the next checks out afresh."""
    pool = async_engine.pool
    held = direct.HeldConnection(async_engine)
    backend = text("SELECT pg_backend_pid() AS pid")
    pids = []
    for pipelined in (True, False, True):
        async with direct.transaction(async_engine, pipelined=pipelined, held=held) as conn:
            pids.append((await conn.execute(backend)).one().pid)
    assert (len(set(pids)), held.checkouts, held.held) == (1, 1, True)
    assert pool.checkedout() == 1  # type: ignore[attr-defined]
    async with direct.transaction(async_engine, held=held) as outer:
        # another task's transaction while one runs on it: that one takes its own
        async with direct.transaction(async_engine, single=True, held=held) as inner:
            apart = (await inner.execute(backend)).one().pid
        assert (await outer.execute(backend)).one().pid == pids[0] != apart
    assert (held.checkouts, pool.checkedout()) == (1, 1)  # type: ignore[attr-defined]

    with pytest.raises(Exception, match="division by zero"):
        async with direct.transaction(async_engine, pipelined=True, held=held) as conn:
            await conn.execute(text("SELECT 1 / 0 AS x"))
    assert (held.held, pool.checkedout()) == (False, 0)  # type: ignore[attr-defined]
    assert await _pooled_autocommit(async_engine) is False

    async with direct.transaction(async_engine, pipelined=True, held=held) as conn:
        pid = (await conn.execute(backend)).one().pid
    assert scalar(engine, "SELECT pg_terminate_backend(:pid)", pid=pid) is True
    with pytest.raises(Exception, match=r"terminat|closed|lost"):
        async with direct.transaction(async_engine, pipelined=True, held=held) as conn:
            await conn.execute(backend)
    assert held.held is False
    async with direct.transaction(async_engine, pipelined=True, held=held) as conn:
        assert (await conn.execute(backend)).one().pid != pid
    assert held.checkouts == 3
    await held.release()
    assert (held.held, pool.checkedout()) == (False, 0)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="the engine it was made for"):
        async with direct.transaction(engine, held=held):  # type: ignore[arg-type]
            pass
