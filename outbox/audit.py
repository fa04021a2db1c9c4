"""The audit log: who did what to which row, when and why."""

from __future__ import annotations

import json
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
) -> None:
    """Write an audit row in the same transaction as the action it records."""
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
        },
    )
