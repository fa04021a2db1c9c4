"""The audit log: who did what to which row, when and why."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection

from outbox import queries


def record_audit(
    conn: Connection,
    *,
    actor: str,
    action: str,
    target_type: str,
    target_id: str | None,
    reason: str | None = None,
    details: dict[str, Any] | None = None,
    request_id: str | None = None,
    tenant: str | None = None,
) -> None:
    """Write an audit row in the same transaction as the action it records.

    `tenant` is the tenant the action concerned; when not given, a row about an
    endpoint or a delivery takes that row's tenant (tenant-scoped callers read only
    their tenant's rows).
    """
    conn.execute(
        queries.INSERT_AUDIT,
        {
            "actor": actor,
            "action": action,
            "target_type": target_type,
            "target_id": target_id,
            "reason": reason,
            "details": json.dumps(details or {}),
            "request_id": request_id,
            "tenant_uid": tenant,
        },
    )


def record_audit_many(
    conn: Connection,
    *,
    actor: str,
    action: str,
    target_type: str,
    targets: Sequence[tuple[str, dict[str, Any]]],
    reason: str | None = None,
    request_id: str | None = None,
    tenant: str | None = None,
) -> None:
    """One audit row per (target id, details), in one statement: bulk actions stay cheap.

    Each row takes `tenant`, or else its endpoint's or delivery's tenant (see record_audit).
    """
    if not targets:
        return
    conn.execute(
        queries.INSERT_AUDIT_MANY,
        {
            "actor": actor,
            "action": action,
            "target_type": target_type,
            "reason": reason,
            "request_id": request_id,
            "tenant_uid": tenant,
            "target_ids": [target_id for target_id, _ in targets],
            "details": [json.dumps(details) for _, details in targets],
        },
    )
