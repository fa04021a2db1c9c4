"""Deliveries in chosen states without HTTP, and exact-message checks, for operator tests."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import publish
from outbox.clock import ManualClock
from outbox.relay import Relay
from tests.helpers import rows


async def deliveries_in(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    endpoint_uid: str,
    states: Sequence[str],
    *,
    event_type: str = "order.created",
    tenant: str = "default",
) -> list[int]:
    """One delivery per state, to `endpoint_uid` (made by the relay, then set by SQL)."""
    with engine.begin() as conn:
        for n in range(len(states)):
            publish(conn, event_type, {"n": n}, tenant=tenant)
    await Relay(async_engine, clock).run_until_idle()
    with engine.begin() as conn:
        ids = conn.execute(
            text(
                "SELECT d.id FROM deliveries d JOIN endpoints e ON e.id = d.endpoint_id"
                " WHERE e.uid = :uid AND d.state = 'scheduled' AND d.attempts = 0"
                " AND d.replay_of IS NULL ORDER BY d.id DESC LIMIT :n"
            ),
            {"uid": endpoint_uid, "n": len(states)},
        ).scalars()
        made = sorted(int(i) for i in ids)
        for delivery_id, state in zip(made, states, strict=True):
            set_state(conn, delivery_id, state)
    return made


def set_state(conn: Connection, delivery_id: int, state: str) -> None:
    """Move a delivery to `state` the way a worker or operator would leave it."""
    leased = state == "in_flight"
    finished = state in ("succeeded", "dead", "discarded")
    conn.execute(
        text(
            "UPDATE deliveries SET state = :state, attempts = :attempts,"
            " locked_by = CASE WHEN :leased THEN 'w1' END,"
            " lease_expires_at = CASE WHEN :leased THEN now() + interval '1 minute' END,"
            " completed_at = CASE WHEN :finished THEN now() END,"
            " final_reason = CASE WHEN :state = 'dead' THEN '500 Internal Server Error' END"
            " WHERE id = :id"
        ),
        {
            "state": state,
            "attempts": 0 if state == "scheduled" else 1,
            "leased": leased,
            "finished": finished,
            "id": delivery_id,
        },
    )


@contextmanager
def refused(kind: type[Exception], message: str) -> Iterator[None]:
    """The block raises `kind` with exactly `message` (what the operator reads)."""
    with pytest.raises(kind) as info:
        yield
    assert str(info.value) == message


def audit_rows(engine: Engine, action: str) -> list[dict[str, Any]]:
    """The audit rows of one action, oldest first, with every column a test pins."""
    found = rows(
        engine,
        "SELECT actor, action, target_type, target_id, reason, details, request_id, tenant_uid"
        " FROM audit_log WHERE action = :action ORDER BY id",
        action=action,
    )
    return [dict(r) for r in found]
