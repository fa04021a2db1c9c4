"""Bearer tokens of the admin HTTP API, with a role each: viewer (read) or operator (act).

A token may be confined to one tenant (`tenant_uid`): every read and write it makes is
then scoped to that tenant's rows in the queries themselves (see outbox.tenants).

A token reads `obx_<token_id>_<secret>`. The token id is public and finds the row;
only a SHA-256 of the secret is stored, and the presented secret's hash is compared
with `hmac.compare_digest`, so neither the database nor response timing reveals it.
The secret has 256 bits of entropy, so a fast hash is enough (no password stretching).
A token may expire (`expires_at`); revoked or expired, it is refused, and so are the
console sessions it opened (delivery/operator/console/sessions.py).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import Connection

from outbox.audit import record_audit
from outbox.errors import NotFoundError, OperationError, OutboxError
from outbox.sql import tokens as queries
from outbox.tenants import require_tenant

Role = Literal["viewer", "operator"]
ROLES: tuple[Role, ...] = ("viewer", "operator")
PREFIX = "obx_"
# Longer than this is a typo (and would overflow a timedelta sooner or later).
MAX_TOKEN_LIFETIME = dt.timedelta(days=3650)
_TOKEN = re.compile(r"^obx_([0-9a-f]{16})_([A-Za-z0-9_-]{43})$")


class TokenRefusedError(OutboxError):
    """A well-formed, known token that may not be used; the message says why (401)."""


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def role_allows(role: str, needed: Role) -> bool:
    """An operator may do everything a viewer may."""
    return role == "operator" or needed == "viewer"


@dataclass(frozen=True, slots=True)
class TokenInfo:
    token_id: str
    name: str
    role: str
    created_by: str
    created_at: dt.datetime
    last_used_at: dt.datetime | None
    revoked_at: dt.datetime | None
    tenant: str | None
    expires_at: dt.datetime | None = None

    def expired(self, now: dt.datetime) -> bool:
        return self.expires_at is not None and self.expires_at <= now

    def as_json(self) -> dict[str, Any]:
        return {
            "token_id": self.token_id,
            "name": self.name,
            "role": self.role,
            "tenant": self.tenant,
            "created_by": self.created_by,
            "created_at": self.created_at.isoformat(),
            "last_used_at": self.last_used_at.isoformat() if self.last_used_at else None,
            "revoked_at": self.revoked_at.isoformat() if self.revoked_at else None,
            "expires_at": self.expires_at.isoformat() if self.expires_at else None,
        }


def _info(row: Any) -> TokenInfo:
    return TokenInfo(**{name: row[name] for name in TokenInfo.__dataclass_fields__})


@dataclass(frozen=True, slots=True)
class Principal:
    """Who an authenticated request acts as."""

    token_row: int
    name: str
    role: str
    tenant: str | None = None  # None: every tenant; else the only tenant it sees

    @property
    def actor(self) -> str:
        return f"token:{self.name}"


def create_token(
    conn: Connection,
    *,
    name: str,
    role: str,
    actor: str,
    tenant: str | None = None,
    scope: str | None = None,
    request_id: str | None = None,
    expires_in: dt.timedelta | None = None,
    now: dt.datetime | None = None,
) -> tuple[TokenInfo, str]:
    """Store a new token and return it in clear text: the only time it is ever shown.

    `tenant` confines the token to that tenant. A caller itself confined (`scope`) can
    only create tokens of its own tenant: another tenant is not found. `expires_in`
    (from `now`) makes the token stop working then, and the console sessions it opened.
    """
    expires_at = None
    if expires_in is not None:
        if now is None:
            raise ValueError("an expiring token needs `now`")
        if not dt.timedelta(0) < expires_in <= MAX_TOKEN_LIFETIME:
            raise OperationError(
                "a token's lifetime must be above 0 and at most 3650 days; "
                "leave it out for a token that does not expire"
            )
        expires_at = now + expires_in
    if role not in ROLES:
        raise OperationError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
    name = name.strip()
    if not name:
        raise OperationError("give the token a name that says who or what uses it")
    if scope is not None and tenant is None:
        tenant = scope
    if tenant is not None:
        tenant = require_tenant(conn, tenant, scope=scope)
    active = [t for t in list_tokens(conn, scope=tenant) if t.name == name and t.tenant == tenant]
    if active:
        raise OperationError(f"a token named {name!r} exists; revoke it first or pick another name")
    token_id = secrets.token_hex(8)
    secret = secrets.token_urlsafe(32)
    row = (
        conn.execute(
            queries.INSERT_TOKEN,
            {
                "token_id": token_id,
                "name": name,
                "role": role,
                "secret_hash": _hash(secret),
                "created_by": actor,
                "tenant_uid": tenant,
                "expires_at": expires_at,
            },
        )
        .mappings()
        .one()
    )
    record_audit(
        conn,
        actor=actor,
        action="token.create",
        target_type="token",
        target_id=token_id,
        details={
            "name": name,
            "role": role,
            "tenant": tenant,
            "expires_at": expires_at.isoformat() if expires_at else None,
        },
        request_id=request_id,
        tenant=tenant,
    )
    return _info(row), f"{PREFIX}{token_id}_{secret}"


def list_tokens(
    conn: Connection, *, include_revoked: bool = False, scope: str | None = None
) -> list[TokenInfo]:
    rows = conn.execute(
        queries.SELECT_TOKENS, {"include_revoked": include_revoked, "scope": scope}
    ).mappings()
    return [_info(row) for row in rows]


def revoke_token(
    conn: Connection, name: str, *, actor: str, now: dt.datetime, scope: str | None = None
) -> str:
    """Revoke by name or token id; returns the token id. The row stays for the record.

    Names are unique per tenant, so an unscoped caller naming a token that several
    tenants use is asked for the token id instead.
    """
    found = conn.execute(queries.SELECT_TOKENS_TO_REVOKE, {"name": name, "scope": scope}).all()
    if not found:
        raise NotFoundError(f"no active token {name!r}; `outbox tokens list` shows them")
    if len(found) > 1:
        ids = ", ".join(f"{r.token_id} ({r.tenant_uid or 'unscoped'})" for r in found)
        raise OperationError(
            f"{len(found)} active tokens are named {name!r}: revoke one by its token id ({ids})"
        )
    row = conn.execute(queries.REVOKE_TOKEN, {"id": found[0].id, "now": now}).one()
    record_audit(
        conn,
        actor=actor,
        action="token.revoke",
        target_type="token",
        target_id=str(row.token_id),
        details={"name": name},
        tenant=row.tenant_uid,
    )
    return str(row.token_id)


def authenticate(conn: Connection, presented: str, *, now: dt.datetime) -> Principal | None:
    """The principal of a presented token, or None when it is malformed, unknown or revoked.

    A genuine token confined to a tenant that no longer exists, or past its expiry, raises
    TokenRefusedError saying so (deleting a tenant revokes its tokens; the name check also
    covers a tenant row removed by other means).
    """
    match = _TOKEN.match(presented.strip())
    if match is None:
        return None
    token_id, secret = match.groups()
    row = conn.execute(queries.SELECT_TOKEN_FOR_AUTH, {"token_id": token_id}).first()
    if row is None or not hmac.compare_digest(_hash(secret), str(row.secret_hash)):
        return None
    if not row.tenant_exists:
        raise TokenRefusedError(
            f"this token is scoped to tenant {row.tenant_uid!r}, which was deleted: "
            "create a new token (`outbox tokens create NAME --role ... --tenant ...`)"
        )
    if row.revoked_at is not None:
        return None
    if row.expires_at is not None and row.expires_at <= now:
        raise TokenRefusedError(
            f"this token expired at {row.expires_at.isoformat(timespec='seconds')}: "
            "create a new one (`outbox tokens create NAME --role ... --expires-in ...`)"
        )
    conn.execute(queries.TOUCH_TOKEN, {"id": row.id, "now": now})
    return Principal(
        token_row=int(row.id), name=str(row.name), role=str(row.role), tenant=row.tenant_uid
    )
