"""Tenants: the owners of endpoints, identified by the application's own customer ids.

Routing rule: an event published for tenant T reaches T's enabled endpoints whose patterns
match, plus the endpoints created with `all_tenants`; nothing else. An event published
without a tenant belongs to the default tenant, so a single-tenant installation never
names one.
"""

from __future__ import annotations

import json
import unicodedata
from typing import Any

from sqlalchemy import Connection

from outbox import queries
from outbox.errors import TenantError
from outbox.schema import DEFAULT_TENANT

MAX_TENANT_ID = 255

__all__ = ["DEFAULT_TENANT", "MAX_TENANT_ID", "create_tenant", "validate_tenant_uid"]


def validate_tenant_uid(value: object, *, error: type[Exception] = TenantError) -> str:
    """The tenant id as given, or `error` saying what is wrong with it (nothing is written)."""
    if not isinstance(value, str):
        raise error(f"tenant must be a string (your own customer id), not {type(value).__name__}")
    if not value:
        raise error("tenant must not be empty: pass your customer id, or omit it for the default")
    if len(value) > MAX_TENANT_ID:
        raise error(f"tenant id is {len(value)} characters, over the limit of {MAX_TENANT_ID}")
    if any(unicodedata.category(ch) in ("Cc", "Cs") for ch in value):
        raise error("tenant id contains a control character (or a lone surrogate): remove it")
    return value


def create_tenant(
    conn: Connection, uid: str, *, name: str = "", metadata: dict[str, Any] | None = None
) -> int:
    """Insert a tenant in the caller's transaction; returns its internal id."""
    uid = validate_tenant_uid(uid)
    try:
        metadata_json = json.dumps(metadata or {}, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TenantError(f"tenant metadata must be a JSON object of plain values ({exc})") from exc
    created = conn.execute(
        queries.INSERT_TENANT, {"uid": uid, "name": name, "metadata": metadata_json}
    ).scalar_one_or_none()
    if created is None:
        raise TenantError(f"tenant {uid!r} exists already; `outbox tenants show {uid}` shows it")
    return int(created)
