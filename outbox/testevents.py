"""Test events: send one event to one endpoint through the real pipeline.

`outbox endpoints test ID [--event-type T]` sends T's catalogue example (or, without T,
a built-in ping) to that endpoint only. The event row is written already relayed, with
one delivery for this endpoint: the worker signs and sends it like any other (same
headers, same SSRF guard, same breaker), once, at the highest priority, and the
outcome is read back from the delivery row.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection

from outbox.audit import record_audit
from outbox.catalogue import get_event_type
from outbox.endpoints import get_endpoint
from outbox.errors import CatalogueError, EndpointError
from outbox.ids import new_message_id
from outbox.sql import deliveries as queries

PING_EVENT_TYPE = "webhook.test"


@dataclass(frozen=True, slots=True)
class SentTest:
    endpoint_uid: str
    delivery_id: int
    message_id: str
    event_type: str
    payload: dict[str, Any]

    def as_json(self) -> dict[str, Any]:
        return {
            "endpoint_id": self.endpoint_uid,
            "delivery_id": self.delivery_id,
            "message_id": self.message_id,
            "event_type": self.event_type,
            "payload": self.payload,
        }


@dataclass(frozen=True, slots=True)
class SentTestOutcome:
    state: str
    attempts: int
    status_code: int | None
    error: str | None
    duration_ms: int | None

    @property
    def finished(self) -> bool:
        return self.attempts > 0 or self.state in ("succeeded", "dead", "discarded")

    @property
    def succeeded(self) -> bool:
        return self.state == "succeeded"

    def as_json(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "attempts": self.attempts,
            "status_code": self.status_code,
            "error": self.error,
            "duration_ms": self.duration_ms,
        }


def send_test_event(
    conn: Connection,
    uid: str,
    *,
    event_type: str | None = None,
    now: dt.datetime,
    actor: str,
    request_id: str | None = None,
    scope: str | None = None,
) -> SentTest:
    """Queue the test event for `uid` in the caller's transaction (nothing else receives it).
    With `scope` (a tenant uid), only that tenant's endpoints exist."""
    endpoint = get_endpoint(conn, uid, scope=scope)
    if not endpoint.enabled:
        # Said without a command: the CLI, the API, the console and the portal all ask.
        raise EndpointError(
            f"endpoint {uid} is disabled ({endpoint.disabled_reason}): enable it, then send "
            "the test (a test to a disabled endpoint would only wait)"
        )
    if endpoint.delivery_mode == "pull":
        raise EndpointError(
            f"endpoint {uid} is pull-only: it gets no POSTs, so a test would never be sent; "
            "its partner reads events from its feed (set the mode to both to test pushes)"
        )
    if event_type is None:
        name = PING_EVENT_TYPE
        payload: dict[str, Any] = {
            "message": "a test event from webhook-outbox",
            "endpoint_id": uid,
            "sent_at": now.isoformat(),
        }
    else:
        catalogued = get_event_type(conn, event_type)
        if catalogued.example is None:
            raise CatalogueError(
                f"event type {event_type!r} has no example to send: add one with "
                f"`outbox event-types update {event_type} --example FILE`, or omit "
                "--event-type for a ping"
            )
        name, payload = catalogued.name, catalogued.example
    message_id = new_message_id()
    delivery_id = conn.execute(
        queries.INSERT_TEST_DELIVERY,
        {
            "uid": uid,
            "message_id": message_id,
            "event_type": name,
            "payload": json.dumps(payload),
            "now": now,
        },
    ).scalar_one()
    record_audit(
        conn,
        actor=actor,
        action="endpoint.test",
        target_type="endpoint",
        target_id=uid,
        details={"event_type": name, "delivery_id": delivery_id, "message_id": message_id},
        request_id=request_id,
        tenant=endpoint.tenant,
    )
    return SentTest(uid, int(delivery_id), message_id, name, payload)


def read_test_outcome(conn: Connection, delivery_id: int) -> SentTestOutcome:
    row = conn.execute(queries.SELECT_TEST_OUTCOME, {"id": delivery_id}).first()
    if row is None:
        raise EndpointError(f"no test delivery {delivery_id}")
    return SentTestOutcome(
        state=row.state,
        attempts=row.attempts,
        status_code=row.last_status_code,
        error=row.final_reason or row.last_error,
        duration_ms=row.duration_ms,
    )
