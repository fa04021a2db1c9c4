"""Hot statements on psycopg directly, not through SQLAlchemy's async bridge.

The worker's claim and outcome record and the relay's pass run several times a second;
through the async engine each statement cost a greenlet switch, a result object and its
rows (about a fifth of the worker's CPU at fan-out 1, a quarter of the relay's pass).
Here the same statements, the named Core statements of the packages' queries.py
compiled once to the SQL SQLAlchemy itself would send,
run on the pooled connection's psycopg connection: prepared on first use, results in
binary. The connection still comes from, and goes back to, the engine's pool, so pre-ping,
invalidation after a lost connection and disposal behave as for every other statement.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from sqlalchemy import TextClause
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import MultipleResultsFound, NoResultFound
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.pool import PoolProxiedConnection
from sqlalchemy.sql.sqltypes import NullType
from sqlalchemy.util import greenlet_spawn


class Rows(list[Any]):
    """A statement's rows (attribute access and `_mapping`, like SQLAlchemy's): the part
    of SQLAlchemy's Result the hot path reads."""

    def all(self) -> list[Any]:
        return self

    def one(self) -> Any:
        if not self:
            raise NoResultFound("No row was found when one was required")
        if len(self) > 1:
            raise MultipleResultsFound("Multiple rows were found when exactly one was required")
        return self[0]


class DirectConnection:
    """A transaction's statements on one psycopg connection (see `transaction`)."""

    def __init__(
        self,
        connection: psycopg.AsyncConnection[Any],
        dialect: Dialect,
        *,
        single: bool = False,
        pipeline: psycopg.AsyncPipeline | None = None,
    ) -> None:
        self._connection = connection
        self._dialect = dialect
        self._single = single  # autocommit: a second statement would not share the first's
        self._pipeline = pipeline  # statements are queued: each one's result waits for a sync
        self._statements = 0

    async def execute(
        self, statement: TextClause, parameters: Mapping[str, Any] | None = None
    ) -> Rows:
        """Run one of the named queries.py statements with these parameters (as
        `AsyncConnection.execute` would: the same SQL, the same parameter values)."""
        sql = compiled_sql(statement, self._dialect)
        self._statements += 1
        if self._single and self._statements > 1:
            raise RuntimeError(
                "a second statement in outbox.direct.transaction(single=True), which "
                "commits each statement by itself: open it without single=True"
            )
        async with self._connection.cursor(row_factory=_row_maker, binary=True) as cursor:
            await cursor.execute(sql, parameters, prepare=True)
            if self._pipeline is not None:
                await self._pipeline.sync()  # what is queued goes out, in one round trip
            if cursor.description is None:
                return Rows()
            return Rows(await cursor.fetchall())


# What delivery's health/, operational and worker parts and the relay's pass take: the hot
# path runs them on a DirectConnection, everything else (and the outcomes that touch
# breakers, the schema check of SQL-published events) on SQLAlchemy.
Statements = AsyncConnection | DirectConnection

_compiled: dict[int, tuple[TextClause, str]] = {}


def compiled_sql(statement: TextClause, dialect: Dialect) -> str:
    """The SQL SQLAlchemy sends for `statement` (psycopg's %(name)s placeholders), compiled
    once (every psycopg dialect compiles text() alike). Only untyped parameters are
    allowed: they reach psycopg as given, so running the string directly cannot change
    what a parameter means."""
    found = _compiled.get(id(statement))
    if found is not None and found[0] is statement:
        return found[1]
    if len(_compiled) > 1_000:  # queries.py's statements are a few dozen; only bounded
        _compiled.clear()
    compiled = statement.compile(dialect=dialect)
    typed = sorted(
        name for name, bind in compiled.binds.items() if not isinstance(bind.type, NullType)
    )
    if typed or compiled.positional:
        raise TypeError(
            f"outbox.direct runs plain text() statements with untyped :name parameters; "
            f"this one has typed parameters {typed} or positional ones: run it through "
            "SQLAlchemy, or drop the bindparam types"
        )
    _compiled[id(statement)] = (statement, compiled.string)
    return compiled.string


# A statement PostgreSQL plans anew on every run (its custom plans look cheaper than the
# generic one, whose estimates cannot see the parameters) spends milliseconds planning:
# CLAIM_FOLDED planned at about 3 ms a claim, more than half its run time. Its generic
# plan is the same shape (index probes per endpoint), so the claim asks for it.
_GENERIC_PLANS = "SET LOCAL plan_cache_mode = force_generic_plan"


class HeldConnection:
    """One pooled connection a loop keeps across its transactions while it is busy.

    Why: the relay runs a pass or two per event in the open loop (events arrive one per
    transaction), and taking a connection from the pool for each cost a round trip of its
    own (the pool's pre-ping, which PostgreSQL also counts as a commit) plus the pool's
    checkout and return through the greenlet bridge, about a tenth of the service's CPU
    at 25 events/s. Held (`transaction(..., held=)`), that is paid once per busy spell;
    `release` gives the connection back when the loop goes idle. A transaction that fails
    lets go of it too (invalidated when it cannot be trusted), so the next one checks out
    afresh, pre-ping included: a connection lost while held costs one failed transaction,
    as a connection lost mid-transaction does anyway.
    """

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._pooled: PoolProxiedConnection | None = None
        self.in_use = False  # a transaction runs on it: a concurrent one takes its own
        self.checkouts = 0  # connections taken from the pool (the tests count them)

    @property
    def held(self) -> bool:
        return self._pooled is not None

    async def _take(self) -> PoolProxiedConnection:
        if self._pooled is None:
            self._pooled = await self.engine.raw_connection()
            self.checkouts += 1
        return self._pooled

    async def release(self) -> None:
        """Back to the pool (the loop goes idle, or stops); not while a transaction runs
        on it (that transaction's end decides)."""
        if self.in_use:
            return
        pooled, self._pooled = self._pooled, None
        if pooled is not None:
            await greenlet_spawn(pooled.close)


@contextlib.asynccontextmanager
async def transaction(
    engine: AsyncEngine,
    *,
    single: bool = False,
    generic_plans: bool = False,
    pipelined: bool = False,
    held: HeldConnection | None = None,
) -> AsyncIterator[DirectConnection]:
    """A connection from the engine's pool for one transaction, committed at the end.

    `single`: the body runs one statement, which commits by itself (autocommit): no
    BEGIN and COMMIT round trips. `pipelined`: the BEGIN goes out with the first
    statement, in one round trip (psycopg's pipeline mode; each statement still waits
    for its own answer). `generic_plans`: pipelined, and the transaction's prepared
    statements run on their generic plan (SET LOCAL plan_cache_mode, sent with the
    BEGIN: no round trip of its own; see _GENERIC_PLANS). `held`: the connection
    `held` keeps (see HeldConnection) instead of one from the pool for this transaction
    alone. On an error the transaction is rolled back; a connection that is broken or
    left mid-statement (cancelled) is invalidated, so the pool replaces it instead of
    handing it out again.
    """
    if single and (generic_plans or pipelined):
        raise ValueError(
            "generic_plans needs a transaction (SET LOCAL), pipelined a BEGIN to send with "
            "the first statement: neither goes with single=True"
        )
    if held is not None and held.engine is not engine:
        raise ValueError("a HeldConnection serves the engine it was made for")
    if held is not None and held.in_use:
        held = None  # another task's transaction is on it: this one takes its own
    pooled = await (held._take() if held is not None else engine.raw_connection())
    kept = held is not None
    if held is not None:
        held.in_use = True
    try:
        connection = pooled.driver_connection
        assert isinstance(connection, psycopg.AsyncConnection)  # the engine's driver is psycopg
        if single:
            await connection.set_autocommit(True)
        try:
            pipeline = generic_plans or pipelined
            async with connection.pipeline() if pipeline else contextlib.nullcontext() as pipe:
                if generic_plans:
                    await connection.execute(_GENERIC_PLANS)
                yield DirectConnection(connection, engine.dialect, single=single, pipeline=pipe)
                if not single:
                    await connection.commit()
        except BaseException as exc:
            kept = False
            await _after_error(connection, pooled.invalidate, exc)
            raise
        finally:
            if single and not connection.closed:
                # Never back to the pool in autocommit: SQLAlchemy's transactions rely on it.
                if connection.info.transaction_status == TransactionStatus.IDLE:
                    await connection.set_autocommit(False)
                else:
                    kept = False
                    await greenlet_spawn(pooled.invalidate)
    finally:
        if held is None:
            await greenlet_spawn(pooled.close)
        else:
            held.in_use = False
            if not kept:
                await held.release()


async def _after_error(
    connection: psycopg.AsyncConnection[Any],
    invalidate: Callable[[BaseException], None],
    exc: BaseException,
) -> None:
    """Roll back what the error left open; a connection that cannot be trusted is invalidated."""
    usable = not (connection.closed or connection.broken)
    status = connection.info.transaction_status
    if usable and status == TransactionStatus.IDLE:
        return
    if usable and status in (TransactionStatus.INTRANS, TransactionStatus.INERROR):
        with contextlib.suppress(Exception):  # failing too, the connection is invalidated
            await connection.rollback()
            return
    await greenlet_spawn(invalidate, exc)


@functools.lru_cache(maxsize=256)
def _row_class(names: tuple[str, ...]) -> type[Any]:
    base = collections.namedtuple("Row", names, rename=True)  # type: ignore[misc]

    def mapping(row: Any) -> dict[str, Any]:
        return dict(zip(names, row, strict=True))

    return type("Row", (base,), {"__slots__": (), "_mapping": property(mapping)})


def _row_maker(cursor: Any) -> Callable[[Sequence[Any]], Any]:
    description = cursor.description
    if description is None:
        return tuple
    return _row_class(tuple(column.name for column in description))._make  # type: ignore[no-any-return]
