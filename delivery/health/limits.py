"""The operator's side of endpoint health: per-endpoint limits and the health report."""

from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection

from delivery import queries
from outbox.audit import record_audit
from outbox.endpoints import get_endpoint
from outbox.errors import EndpointError


@dataclass(frozen=True, slots=True)
class EndpointLimits:
    max_in_flight: int | None = None
    max_per_second: float | None = None
    ordered: bool = False
    dead_head: str = "block"
    adaptive: bool = False  # the in-flight limit adapts between 1 and max_in_flight

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def get_endpoint_limits(conn: Connection, uid: str, *, scope: str | None = None) -> EndpointLimits:
    if scope is not None:
        get_endpoint(conn, uid, scope=scope)  # another tenant's endpoint: not found
    row = conn.execute(queries.SELECT_ENDPOINT_LIMITS, {"uid": uid}).first()
    if row is None:
        raise EndpointError(f"no endpoint {uid!r}; `outbox endpoints list` shows the ids")
    return EndpointLimits(
        row.max_in_flight, row.max_per_second, row.ordered, row.dead_head, row.adaptive
    )


def set_endpoint_limits(
    conn: Connection, uid: str, limits: EndpointLimits, *, actor: str, scope: str | None = None
) -> EndpointLimits:
    """Set an endpoint's limits and ordering (replacing the previous ones), with an audit row."""
    if scope is not None:
        get_endpoint(conn, uid, scope=scope)  # another tenant's endpoint: not found
    if limits.max_in_flight is not None and limits.max_in_flight <= 0:
        raise EndpointError("max in flight must be a positive number, or unset for no limit")
    if limits.max_per_second is not None and limits.max_per_second <= 0:
        raise EndpointError("max per second must be a positive number, or unset for no limit")
    if limits.adaptive and limits.max_in_flight is None:
        raise EndpointError(
            "adaptive concurrency needs a ceiling: give --max-in-flight N with "
            "--concurrency adaptive"
        )
    if limits.dead_head not in ("block", "skip"):
        raise EndpointError("dead head behaviour must be 'block' or 'skip'")
    row = conn.execute(
        queries.SET_ENDPOINT_LIMITS, {"uid": uid, **dataclasses.asdict(limits)}
    ).first()
    if row is None:
        raise EndpointError(f"no endpoint {uid!r}; `outbox endpoints list` shows the ids")
    record_audit(
        conn,
        actor=actor,
        action="endpoint.limits",
        target_type="endpoint",
        target_id=uid,
        details=limits.as_json(),
    )
    return limits


def endpoint_health_report(conn: Connection) -> list[dict[str, Any]]:
    """Every endpoint's limits and breaker state, for operators (`outbox endpoints health`)."""
    report = []
    for row in conn.execute(queries.SELECT_ENDPOINT_HEALTH).mappings():
        item = {
            key: value.isoformat() if isinstance(value, dt.datetime) else value
            for key, value in row.items()
        }
        report.append(item)
    return report
