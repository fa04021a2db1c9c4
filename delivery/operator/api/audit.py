"""The audit log, newest first: every operator action and every refused call."""

from __future__ import annotations

from typing import Any

from delivery.operator.api.core import Call, Operation
from delivery.operator.validation import AuditQuery
from outbox import audit as audit_log


async def audit_route(call: Call) -> Any:
    query = call.query_as(AuditQuery)
    tenant = await call.tenant()
    entries = await call.api.read(
        lambda c: audit_log.list_audit(
            c,
            actor=query.actor,
            action=query.action,
            target_id=query.target,
            since=query.since,
            before_id=query.before,
            limit=query.limit,
            scope=tenant,
        )
    )
    return {"items": [entry.as_json() for entry in entries]}


routes = [
    Operation(
        "GET",
        "/v1/audit",
        "viewer",
        "The audit log, newest first.",
        audit_route,
        query=AuditQuery,
        tenant_filter=True,
    ),
]
