"""An event type as a workflow: what an ambiguous outcome does, whose failures they are,
and the thresholds its alert signals use (`outbox event-types set`, migration 0031).

Thresholds are validated here, once, for the CLI and the API alike: a positive age or
time at most `MAX_THRESHOLD_SECONDS`, an error rate in (0, 1]. Zero, negative, NaN and
absurd values are refused with what to give instead.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import Connection

from outbox.audit import record_audit
from outbox.errors import CatalogueNotFoundError, OperationError
from outbox.owners import check_owner
from outbox.schema import ON_AMBIGUOUS
from outbox.sql import workflows as queries

MAX_THRESHOLD_SECONDS = 30 * 86400.0
# At most this many event types get per-type alert signals and series: their names are
# metric labels, so the count is capped (the first by name; the rest are left out).
MAX_WORKFLOW_ALERTS = 50
CLEAR = "off"  # what clears a threshold or owner


@dataclass(frozen=True, slots=True)
class Workflow:
    name: str
    on_ambiguous: str
    owner: str | None
    alert_oldest_seconds: float | None
    alert_error_rate: float | None
    alert_processing_p95_seconds: float | None

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def get_workflow(conn: Connection, name: str) -> Workflow:
    row = conn.execute(queries.SELECT_WORKFLOW, {"name": name}).mappings().first()
    if row is None:
        raise CatalogueNotFoundError(
            f"no event type {name!r}; `outbox event-types list` shows them"
        )
    return Workflow(**row)


def with_thresholds(conn: Connection) -> list[Workflow]:
    rows = conn.execute(queries.SELECT_WORKFLOWS_WITH_THRESHOLDS, {"limit": MAX_WORKFLOW_ALERTS})
    return [Workflow(**row) for row in rows.mappings()]


def check_seconds(value: float, what: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise OperationError(f"{what} must be a number of seconds, e.g. 300 (or 5m)")
    if not 0 < value <= MAX_THRESHOLD_SECONDS:
        raise OperationError(
            f"{what} must be more than 0 and at most {MAX_THRESHOLD_SECONDS / 86400:g} days, "
            f"not {value:g}s"
        )
    return float(value)


def check_rate(value: float) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise OperationError("the error rate must be a share between 0 and 1, e.g. 0.2")
    if not 0 < value <= 1:
        raise OperationError(
            f"the error rate must be more than 0 and at most 1 (a share, 0.2 = 20%), not {value:g}"
        )
    return float(value)


_UNSET: Any = object()


def set_workflow(
    conn: Connection,
    name: str,
    *,
    actor: str,
    on_ambiguous: str | None = None,
    owner: str | None = _UNSET,
    alert_oldest_seconds: float | None = _UNSET,
    alert_error_rate: float | None = _UNSET,
    alert_processing_p95_seconds: float | None = _UNSET,
    request_id: str | None = None,
) -> Workflow:
    """Change what is given; None clears an owner or a threshold. Audited."""
    if on_ambiguous is not None and on_ambiguous not in ON_AMBIGUOUS:
        raise OperationError(
            f"on-ambiguous {on_ambiguous!r} is not known: use retry (the default) or hold"
        )
    if owner is not _UNSET and owner is not None:
        check_owner(owner)
    if alert_oldest_seconds is not _UNSET and alert_oldest_seconds is not None:
        check_seconds(alert_oldest_seconds, "the oldest-pending threshold")
    if alert_error_rate is not _UNSET and alert_error_rate is not None:
        check_rate(alert_error_rate)
    if alert_processing_p95_seconds is not _UNSET and alert_processing_p95_seconds is not None:
        check_seconds(alert_processing_p95_seconds, "the processing p95 threshold")
    given = {
        "on_ambiguous": on_ambiguous if on_ambiguous is not None else _UNSET,
        "owner": owner,
        "alert_oldest_seconds": alert_oldest_seconds,
        "alert_error_rate": alert_error_rate,
        "alert_processing_p95_seconds": alert_processing_p95_seconds,
    }
    changed = {key: value for key, value in given.items() if value is not _UNSET}
    if not changed:
        raise OperationError(
            "nothing to change: give --on-ambiguous, --owner, --alert-oldest, "
            "--alert-error-rate or --alert-processing-p95"
        )
    before = get_workflow(conn, name)

    def value(key: str) -> Any:
        return None if given[key] is _UNSET else given[key]

    conn.execute(
        queries.SET_WORKFLOW,
        {
            "name": name,
            "set_on_ambiguous": "on_ambiguous" in changed,
            "on_ambiguous": value("on_ambiguous"),
            "set_owner": "owner" in changed,
            "owner": value("owner"),
            "set_oldest": "alert_oldest_seconds" in changed,
            "oldest": value("alert_oldest_seconds"),
            "set_error_rate": "alert_error_rate" in changed,
            "error_rate": value("alert_error_rate"),
            "set_p95": "alert_processing_p95_seconds" in changed,
            "p95": value("alert_processing_p95_seconds"),
        },
    )
    record_audit(
        conn,
        actor=actor,
        action="event_type.set",
        target_type="event_type",
        target_id=name,
        reason=None,
        details={
            "changed": changed,
            "before": {k: v for k, v in before.as_json().items() if k in changed},
        },
        request_id=request_id,
    )
    return get_workflow(conn, name)
