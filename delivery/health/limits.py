"""The operator's side of endpoint health: per-endpoint limits and the health report."""

from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection

from delivery import queries
from delivery.health.adaptive import DEFAULT_MAXIMUM, AdaptiveConfig
from delivery.health.rules import Health, HealthConfig, adaptive_maximum, in_flight_limit
from outbox.audit import record_audit
from outbox.endpoints import get_endpoint
from outbox.errors import EndpointError

# The largest in-flight limit or ceiling an endpoint may have: far above what one worker
# fleet sends one partner, and far below what the column holds.
MAX_IN_FLIGHT = 100_000


@dataclass(frozen=True, slots=True)
class EndpointLimits:
    max_in_flight: int | None = None
    max_per_second: float | None = None
    ordered: bool = False
    dead_head: str = "block"
    # the in-flight limit adapts between 1 and max_in_flight (unset: the default maximum,
    # OUTBOX_ADAPTIVE_DEFAULT_MAX)
    adaptive: bool = False

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
    conn: Connection,
    uid: str,
    limits: EndpointLimits,
    *,
    actor: str,
    scope: str | None = None,
    reason: str | None = None,
    request_id: str | None = None,
) -> EndpointLimits:
    """Set an endpoint's limits and ordering (replacing the previous ones), with an audit row."""
    if scope is not None:
        get_endpoint(conn, uid, scope=scope)  # another tenant's endpoint: not found
    if limits.max_in_flight is not None and limits.max_in_flight <= 0:
        raise EndpointError("max in flight must be a positive number, or unset for no limit")
    if limits.max_in_flight is not None and limits.max_in_flight > MAX_IN_FLIGHT:
        raise EndpointError(
            f"max in flight {limits.max_in_flight} is more than {MAX_IN_FLIGHT:,}: give a "
            "smaller number, or unset it for no limit"
        )
    if limits.max_per_second is not None and limits.max_per_second <= 0:
        raise EndpointError("max per second must be a positive number, or unset for no limit")
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
        reason=reason,
        request_id=request_id,
    )
    return limits


@dataclass(frozen=True, slots=True)
class EndpointConcurrency:
    """How many deliveries of one endpoint may be in flight, and why (the admin API)."""

    endpoint: str
    mode: str  # "adaptive" or "fixed"
    max_in_flight: int | None  # the fixed limit, or the adaptive limit's ceiling
    limit: int | None  # what the claim gate applies now (None: no limit)
    in_flight: int
    latency_baseline_ms: float | None  # adaptive: the unloaded latency it compares with

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def get_endpoint_concurrency(
    conn: Connection,
    uid: str,
    *,
    scope: str | None = None,
    default_maximum: int = DEFAULT_MAXIMUM,
) -> EndpointConcurrency:
    """One endpoint's concurrency: its mode, ceiling (for an adaptive endpoint without a
    maximum of its own, `default_maximum`: OUTBOX_ADAPTIVE_DEFAULT_MAX), current limit and
    what is in flight."""
    config = HealthConfig(adaptive=AdaptiveConfig(default_maximum=default_maximum))
    get_endpoint(conn, uid, scope=scope)  # unknown, or another tenant's: not found
    row = conn.execute(queries.SELECT_ENDPOINT_CONCURRENCY, {"uid": uid}).one()
    health = Health(
        row.id,
        max_in_flight=row.max_in_flight,
        adaptive=row.adaptive,
        adaptive_limit=row.adaptive_limit,
    )
    return EndpointConcurrency(
        endpoint=uid,
        mode="adaptive" if row.adaptive else "fixed",
        max_in_flight=adaptive_maximum(health, config) or row.max_in_flight,
        limit=in_flight_limit(health, config),
        in_flight=row.in_flight,
        latency_baseline_ms=row.latency_baseline_ms if row.adaptive else None,
    )


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
