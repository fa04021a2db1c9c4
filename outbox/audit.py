"""The audit log: who did what to which row, when and why.

Actions write their rows here (record_audit, record_audit_many) in their own
transaction; operators read them back with list_audit.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import Connection

from outbox.errors import OperationError
from outbox.sql import audit as queries

MAX_AUDIT_PAGE = 1000


def require_reason(reason: str | None, what: str) -> str:
    """The reason an action gives for its audit row, stripped; OperationError without one."""
    if not reason or not reason.strip():
        raise OperationError(f"{what} needs a reason (--reason TEXT): it goes in the audit log")
    return reason.strip()


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


@dataclass(frozen=True, slots=True)
class AuditEntry:
    id: int
    at: dt.datetime
    actor: str
    action: str
    target_type: str
    target_id: str | None
    reason: str | None
    details: dict[str, Any]
    request_id: str | None
    tenant: str | None

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "at": self.at.isoformat()}


def list_audit(
    conn: Connection,
    *,
    actor: str | None = None,
    action: str | None = None,
    target_id: str | None = None,
    since: dt.datetime | None = None,
    before_id: int | None = None,
    limit: int = 50,
    scope: str | None = None,
) -> list[AuditEntry]:
    """Newest first; `action` matches exactly or as a prefix ('delivery' finds replays too).

    With `scope` (a tenant uid) only the rows about that tenant's objects.
    """
    if not 0 < limit <= MAX_AUDIT_PAGE:
        raise OperationError(f"limit must be between 1 and {MAX_AUDIT_PAGE}")
    rows = conn.execute(
        queries.SELECT_AUDIT,
        {
            "actor": actor,
            "action": action,
            "target_id": target_id,
            "since": since,
            "before_id": before_id,
            "limit": limit,
            "scope": scope,
        },
    ).mappings()
    return [AuditEntry(**row) for row in rows]
