"""Endpoints: where events go, which events they want, and the secret that signs them."""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection

from outbox import queries
from outbox.audit import record_audit
from outbox.crypto import InvalidSecretError, SecretBox, generate_secret, secret_key_bytes
from outbox.errors import EndpointError
from outbox.ids import new_endpoint_id

_PATTERN = re.compile(r"^(\*|[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9][A-Za-z0-9_-]*)*(\.\*)?)$")


@dataclass(frozen=True, slots=True)
class Endpoint:
    id: int
    uid: str
    url: str
    description: str
    event_types: list[str]
    enabled: bool
    disabled_reason: str | None
    disabled_at: dt.datetime | None
    created_at: dt.datetime

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.uid,
            "url": self.url,
            "description": self.description,
            "event_types": self.event_types,
            "enabled": self.enabled,
            "disabled_reason": self.disabled_reason,
            "disabled_at": self.disabled_at.isoformat() if self.disabled_at else None,
            "created_at": self.created_at.isoformat(),
        }


@dataclass(frozen=True, slots=True)
class CreatedEndpoint:
    endpoint: Endpoint
    secret: str  # shown once, at creation; stored only encrypted


def parse_event_patterns(value: str | Iterable[str]) -> list[str]:
    """'order.*, invoice.paid' -> ['order.*', 'invoice.paid'], with a clear error for junk."""
    items = value.split(",") if isinstance(value, str) else list(value)
    patterns = [item.strip() for item in items if item.strip()]
    if not patterns:
        raise EndpointError("give at least one event type pattern, e.g. --events 'order.*'")
    for pattern in patterns:
        if not _PATTERN.match(pattern):
            raise EndpointError(
                f"event pattern {pattern!r} is invalid: use '*', an exact type like "
                "'invoice.paid', or a prefix like 'order.*'"
            )
    return list(dict.fromkeys(patterns))


def secret_context(uid: str) -> str:
    """Associated data that ties an encrypted secret to its endpoint row."""
    return f"endpoint:{uid}"


def create_endpoint(
    conn: Connection,
    box: SecretBox,
    *,
    url: str,
    event_types: str | Iterable[str],
    secret: str | None = None,
    description: str = "",
) -> CreatedEndpoint:
    """Insert an endpoint in the caller's transaction. `url` must already be validated."""
    patterns = parse_event_patterns(event_types)
    plain_secret = secret or generate_secret()
    try:
        secret_key_bytes(plain_secret)
    except InvalidSecretError as exc:
        raise EndpointError(str(exc)) from exc
    uid = new_endpoint_id()
    conn.execute(
        queries.INSERT_ENDPOINT,
        {
            "uid": uid,
            "url": url,
            "description": description,
            "event_types": patterns,
            "signing_secret": box.encrypt(plain_secret, context=secret_context(uid)),
        },
    )
    return CreatedEndpoint(endpoint=get_endpoint(conn, uid), secret=plain_secret)


def get_endpoint(conn: Connection, uid: str) -> Endpoint:
    row = conn.execute(queries.SELECT_ENDPOINT_BY_UID, {"uid": uid}).mappings().first()
    if row is None:
        raise EndpointError(f"no endpoint {uid!r}; `outbox endpoints list` shows the ids")
    return Endpoint(**row)


def list_endpoints(conn: Connection) -> list[Endpoint]:
    return [Endpoint(**row) for row in conn.execute(queries.SELECT_ENDPOINTS).mappings()]


def set_enabled(
    conn: Connection, uid: str, *, enabled: bool, reason: str | None = None, actor: str
) -> Endpoint:
    """Enable or disable an endpoint; disabling keeps its pending deliveries waiting."""
    if not enabled and not (reason and reason.strip()):
        raise EndpointError("disabling an endpoint needs a reason (--reason)")
    updated = conn.execute(
        queries.SET_ENDPOINT_ENABLED, {"uid": uid, "enabled": enabled, "reason": reason}
    ).first()
    if updated is None:
        raise EndpointError(f"no endpoint {uid!r}; `outbox endpoints list` shows the ids")
    record_audit(
        conn,
        actor=actor,
        action="endpoint.enable" if enabled else "endpoint.disable",
        target_type="endpoint",
        target_id=uid,
        reason=reason,
    )
    return get_endpoint(conn, uid)


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
        from outbox.settings import check_retry_schedule

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


def get_delivery_rules(conn: Connection, uid: str) -> DeliveryRules:
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
    conn: Connection, uid: str, rules: DeliveryRules, *, actor: str, reason: str | None = None
) -> DeliveryRules:
    """Replace an endpoint's delivery rules in the caller's transaction, with an audit entry."""
    validate_delivery_rules(rules)
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
