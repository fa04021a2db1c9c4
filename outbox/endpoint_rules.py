"""An endpoint's own delivery rules: timeout, attempts, schedule and status overrides.

NULL columns mean "the global default applies" (OUTBOX_REQUEST_TIMEOUT,
OUTBOX_MAX_ATTEMPTS, OUTBOX_RETRY_SCHEDULE, the default status table). The
outcomes are strings here because outbox/ never imports delivery/; the worker
turns them into `delivery.policy.Outcome` values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection

from outbox.audit import record_audit
from outbox.endpoints import get_endpoint
from outbox.errors import EndpointError
from outbox.settings import check_retry_schedule
from outbox.sql import endpoints as queries

# Outcomes an endpoint may give a status code; 'ambiguous' describes the transport,
# not an answer, so it cannot be assigned.
OVERRIDE_OUTCOMES = ("succeeded", "retryable", "permanent")
MAX_ENDPOINT_TIMEOUT_SECONDS = 300.0


@dataclass(frozen=True, slots=True)
class DeliveryRules:
    """An endpoint's own delivery rules; None means the global default applies.

    `max_attempts` is fixed on each delivery when it is created; the schedule, the
    timeout and the status overrides apply from the next attempt on.
    """

    timeout_seconds: float | None = None
    max_attempts: int | None = None
    retry_schedule: tuple[float, ...] | None = None
    status_overrides: dict[int, str] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {
            "timeout_seconds": self.timeout_seconds,
            "max_attempts": self.max_attempts,
            "retry_schedule": list(self.retry_schedule) if self.retry_schedule else None,
            "status_overrides": {str(k): v for k, v in sorted(self.status_overrides.items())},
        }


def parse_status_override(text: str) -> tuple[int, str]:
    """'404=retryable' -> (404, 'retryable'), with an error that shows the expected form."""
    status_text, sep, outcome = text.partition("=")
    outcome = outcome.strip().lower()
    if not sep or not status_text.strip().isdigit() or outcome not in OVERRIDE_OUTCOMES:
        raise EndpointError(
            f"status override {text!r} is invalid: write STATUS=OUTCOME, e.g. 404=retryable, "
            f"with OUTCOME one of {', '.join(OVERRIDE_OUTCOMES)}"
        )
    return int(status_text), outcome


def validate_delivery_rules(rules: DeliveryRules) -> DeliveryRules:
    """Refuse rules that would make deliveries misbehave, with a message saying what to use."""
    if rules.timeout_seconds is not None and not (
        0 < rules.timeout_seconds <= MAX_ENDPOINT_TIMEOUT_SECONDS
    ):
        raise EndpointError(
            f"timeout must be more than 0 and at most {MAX_ENDPOINT_TIMEOUT_SECONDS:g} seconds"
        )
    if rules.max_attempts is not None and not 0 < rules.max_attempts <= 100:
        raise EndpointError("max attempts must be between 1 and 100")
    if rules.retry_schedule is not None:
        try:
            check_retry_schedule(list(rules.retry_schedule))
        except ValueError as exc:
            raise EndpointError(f"retry schedule: {exc}") from exc
    for status, outcome in rules.status_overrides.items():
        if not 100 <= status <= 599 or outcome not in OVERRIDE_OUTCOMES:
            raise EndpointError(
                f"status override {status}={outcome} is invalid: the status must be 100-599 "
                f"and the outcome one of {', '.join(OVERRIDE_OUTCOMES)}"
            )
    return rules


def get_delivery_rules(conn: Connection, uid: str, *, scope: str | None = None) -> DeliveryRules:
    if scope is not None:
        get_endpoint(conn, uid, scope=scope)  # another tenant's endpoint: not found
    row = conn.execute(queries.SELECT_ENDPOINT_DELIVERY_RULES, {"uid": uid}).first()
    if row is None:
        raise EndpointError(f"no endpoint {uid!r}; `outbox endpoints list` shows the ids")
    return DeliveryRules(
        timeout_seconds=row.timeout_seconds,
        max_attempts=row.max_attempts,
        retry_schedule=tuple(row.retry_schedule) if row.retry_schedule else None,
        status_overrides={int(k): str(v) for k, v in (row.status_overrides or {}).items()},
    )


def set_delivery_rules(
    conn: Connection,
    uid: str,
    rules: DeliveryRules,
    *,
    actor: str,
    reason: str | None = None,
    scope: str | None = None,
) -> DeliveryRules:
    """Replace an endpoint's delivery rules in the caller's transaction, with an audit entry."""
    validate_delivery_rules(rules)
    if scope is not None:
        get_endpoint(conn, uid, scope=scope)  # another tenant's endpoint: not found
    stored = rules.as_json()
    updated = conn.execute(
        queries.SET_ENDPOINT_DELIVERY_RULES,
        {
            "uid": uid,
            "timeout_seconds": rules.timeout_seconds,
            "max_attempts": rules.max_attempts,
            "retry_schedule": stored["retry_schedule"],
            "status_overrides": json.dumps(stored["status_overrides"])
            if rules.status_overrides
            else None,
        },
    ).first()
    if updated is None:
        raise EndpointError(f"no endpoint {uid!r}; `outbox endpoints list` shows the ids")
    record_audit(
        conn,
        actor=actor,
        action="endpoint.rules",
        target_type="endpoint",
        target_id=uid,
        reason=reason,
        details=stored,
    )
    return get_delivery_rules(conn, uid)
