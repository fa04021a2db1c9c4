"""Endpoint health written back: outcomes folded into the locked rows, transitions logged."""

from __future__ import annotations

import datetime as dt
import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from delivery import queries
from delivery.health.rules import (
    CLOSED,
    HALF_OPEN,
    OPEN,
    STATE_FIELDS,
    Health,
    HealthConfig,
    Observation,
    after_outcomes,
    disable_reason,
    summarize,
)
from outbox.audit import record_audit
from outbox.direct import Statements

# Endpoint health's one logger, named as before it became a package.
log = logging.getLogger("delivery.health")


# The float8[] columns of SAVE_ENDPOINT_HEALTH.
_FLOAT_FIELDS = ("tokens", "latency_baseline_ms", "adaptive_estimate")


async def save(conn: Statements, rows: Sequence[Health], *, now: dt.datetime) -> None:
    if not rows:
        return
    params: dict[str, Any] = {name: [getattr(r, name) for r in rows] for name in STATE_FIELDS}
    for name in _FLOAT_FIELDS:
        # One array per column: a latency measured in whole milliseconds (an int) beside
        # another endpoint's float would make psycopg refuse the mixed list.
        params[name] = [None if value is None else float(value) for value in params[name]]
    params["now"] = now
    await conn.execute(queries.SAVE_ENDPOINT_HEALTH, params)


async def record_observations(
    conn: AsyncConnection,
    observations: Sequence[Observation],
    *,
    now: dt.datetime,
    config: HealthConfig,
    names: Mapping[int, str] | None = None,
) -> list[int]:
    """Update breakers from a batch of outcomes, in the outcomes' transaction.

    Returns the ids of endpoints disabled because they failed for too long. Call
    `ensure_health_rows` first (outside this transaction) so every row exists: the
    rows are then locked in id order, which keeps concurrent writers deadlock-free.
    A breaker that opens or closes, and an endpoint disabled, each log one line
    (`names` maps endpoint ids to the uids operators know).
    """
    summaries = summarize(observations, config)
    if not summaries:
        return []
    ids = sorted(summaries)
    current = await _lock_for_update(conn, ids)
    updated: list[Health] = []
    disabled: list[int] = []
    for endpoint_id in ids:
        health = current.get(endpoint_id, Health(endpoint_id))
        after = after_outcomes(health, summaries[endpoint_id], now=now, config=config)
        reason = (
            disable_reason(after, now=now, config=config)
            if summaries[endpoint_id].failures
            else None
        )
        if reason is not None:
            disabled_row = await conn.execute(
                queries.AUTO_DISABLE_ENDPOINT,
                {"id": endpoint_id, "reason": reason, "now": now},
            )
            uid = disabled_row.scalar_one_or_none()
            if uid is not None:
                disabled.append(endpoint_id)
                await conn.run_sync(_audit_disable, uid, reason)
                log.warning("endpoint %s disabled: %s", uid, reason)
            after = Health(endpoint_id, after.max_in_flight, after.max_per_second)
        else:
            log_transition(health, after, (names or {}).get(endpoint_id), now=now)
        if after != health:
            updated.append(after)
    await save(conn, updated, now=now)
    return disabled


def log_transition(before: Health, after: Health, uid: str | None, *, now: dt.datetime) -> None:
    """One line when a breaker opens (with why and for how long) and one when it closes."""
    name = uid or f"#{before.endpoint_id}"
    if after.breaker_state == OPEN and after.trips > before.trips:
        reopened = " again (the probe failed)" if before.breaker_state == HALF_OPEN else ""
        probe_in = (after.open_until - now).total_seconds() if after.open_until else 0.0
        log.warning(
            "circuit breaker of endpoint %s opened%s (%d consecutive failures, trip %d); "
            "last error: %s; its deliveries wait, next probe in %.0fs",
            name,
            reopened,
            after.consecutive_failures,
            after.trips,
            after.last_failure or "unknown",
            probe_in,
        )
    elif before.breaker_state != CLOSED and after.breaker_state == CLOSED:
        log.warning(
            "circuit breaker of endpoint %s closed: the probe succeeded; its backlog ramps back up",
            name,
        )


async def ensure_health_rows(
    engine: AsyncEngine, endpoint_ids: Iterable[int], known: set[int]
) -> None:
    """Create missing endpoint_health rows in a transaction of their own.

    `known` caches the ids this process has already seen, so this is a no-op on the hot
    path. Inserting in id order in one short statement cannot deadlock with anyone.
    """
    missing = sorted(set(endpoint_ids) - known)
    if not missing:
        return
    async with engine.begin() as conn:
        await conn.execute(queries.INSERT_MISSING_ENDPOINT_HEALTH, {"ids": missing})
    known.update(missing)


def _audit_disable(conn: Connection, uid: str, reason: str) -> None:
    record_audit(
        conn,
        actor="system:breaker",
        action="endpoint.auto_disable",
        target_type="endpoint",
        target_id=uid,
        reason=reason,
    )


async def _lock_for_update(conn: AsyncConnection, ids: Sequence[int]) -> dict[int, Health]:
    rows = await conn.execute(queries.LOCK_ENDPOINT_HEALTH, {"ids": list(ids)})
    return {row.endpoint_id: Health.from_row(row) for row in rows}


def claimed_per_endpoint(endpoint_ids: Iterable[int]) -> dict[int, int]:
    return dict(Counter(endpoint_ids))
