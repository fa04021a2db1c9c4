"""Console and portal sessions, and the single-use links that open the portal.

A session id is 32 random bytes in an HttpOnly cookie; the database keeps only its SHA-256,
so a database dump opens no session. Each session carries its own CSRF token, which every
state-changing request must echo (a form field or the X-CSRF-Token header).

A session is checked on every request against what opened it (one primary-key lookup
with two joins): a console session against its token (revoked or expired: signed out),
console and portal sessions and portal links against the tenant's internal id (deleted:
the rows cascade away; a new tenant with the same uid is not the same tenant).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets
from dataclasses import dataclass

from sqlalchemy import Connection

from delivery.operator.console import queries
from outbox.audit import record_audit
from outbox.errors import NotFoundError, OperationError

LINK_PREFIX = "obxl_"
# A portal link is a bearer credential in a URL until it is used: keep it short-lived.
MAX_LINK_TTL = dt.timedelta(days=7)


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class WebSession:
    """Who is looking: an operator (tenant None: everything) or one tenant's people."""

    kind: str  # 'console' or 'portal'
    actor: str
    role: str  # 'viewer' or 'operator'
    tenant_uid: str | None
    csrf_token: str
    # The tenant's display name, for the portal's header (never the actor or role).
    tenant_name: str | None = None

    @property
    def can_act(self) -> bool:
        return self.role == "operator"


def open_session(
    conn: Connection,
    *,
    kind: str,
    actor: str,
    role: str,
    tenant_uid: str | None,
    now: dt.datetime,
    ttl: dt.timedelta,
    token_row: int | None = None,
) -> tuple[str, WebSession] | None:
    """Store a new session; returns the cookie value (shown to nobody else) and the session.

    The session is bound to the tenant's internal id (None when `tenant_uid` no longer
    exists) and, for the console, to the token that opened it (`token_row`): it ends
    when that tenant is deleted or that token is revoked or expires.
    """
    if kind == "console" and token_row is None:
        raise ValueError("a console session needs the token that opens it")
    cookie = secrets.token_urlsafe(32)
    session = WebSession(
        kind=kind,
        actor=actor,
        role=role,
        tenant_uid=tenant_uid,
        csrf_token=secrets.token_urlsafe(24),
    )
    conn.execute(queries.DELETE_EXPIRED_SESSIONS, {"now": now})
    stored = conn.execute(
        queries.INSERT_SESSION,
        {
            "id_hash": _hash(cookie),
            "kind": kind,
            "actor": actor,
            "role": role,
            "tenant_uid": tenant_uid,
            "token_row": token_row,
            "csrf_token": session.csrf_token,
            "now": now,
            "expires_at": now + ttl,
        },
    ).first()
    return None if stored is None else (cookie, session)


def load_session(
    conn: Connection, cookie: str, *, kind: str, now: dt.datetime
) -> WebSession | None:
    if not cookie or len(cookie) > 128:
        return None
    row = conn.execute(queries.SELECT_SESSION, {"id_hash": _hash(cookie), "now": now}).first()
    if row is None or row.kind != kind:
        return None
    return WebSession(
        kind=str(row.kind),
        actor=str(row.actor),
        role=str(row.role),
        tenant_uid=row.tenant_uid,
        csrf_token=str(row.csrf_token),
        tenant_name=row.tenant_name,
    )


def close_session(conn: Connection, cookie: str) -> None:
    conn.execute(queries.DELETE_SESSION, {"id_hash": _hash(cookie)})


def issue_portal_link(
    conn: Connection, tenant_uid: str, *, actor: str, now: dt.datetime, ttl: dt.timedelta
) -> str:
    """A single-use secret that opens the portal of `tenant_uid` until `now + ttl`; audited."""
    if not dt.timedelta(0) < ttl <= MAX_LINK_TTL:
        raise OperationError("a portal link's lifetime must be above 0 and at most 7 days")
    secret = LINK_PREFIX + secrets.token_urlsafe(32)
    created = conn.execute(
        queries.INSERT_PORTAL_LINK,
        {
            "id_hash": _hash(secret),
            "tenant_uid": tenant_uid,
            "actor": actor,
            "now": now,
            "expires_at": now + ttl,
        },
    ).first()
    if created is None:
        raise NotFoundError(f"no enabled tenant {tenant_uid!r}: `outbox tenants list` shows them")
    record_audit(
        conn,
        actor=actor,
        action="portal.link",
        target_type="tenant",
        target_id=tenant_uid,
        details={"expires_at": (now + ttl).isoformat()},
        tenant=tenant_uid,
    )
    return secret


def redeem_portal_link(conn: Connection, secret: str, *, now: dt.datetime) -> str | None:
    """The link's tenant, once: a used, expired or unknown link gives None."""
    if not secret.startswith(LINK_PREFIX) or len(secret) > 128:
        return None
    row = conn.execute(queries.REDEEM_PORTAL_LINK, {"id_hash": _hash(secret), "now": now}).first()
    return None if row is None else str(row.tenant_uid)


def portal_link(secret: str, public_url: str | None) -> str:
    """The link to hand the tenant: a full URL when the public base URL is configured."""
    return f"{public_url or ''}/portal/enter?link={secret}"
