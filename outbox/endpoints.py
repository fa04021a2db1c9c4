"""Endpoints: where events go, which events they want, and the secret that signs them.

Every change an operator makes to an endpoint (add, update, enable or disable, rotate or
reveal its secret, set its proxy, delete) is here and writes its audit row in the
caller's transaction. Its delivery rules and custom headers have modules of their own
(outbox.endpoint_rules, outbox.headers), and so has the encryption of its secrets
(outbox.endpoint_secrets); `create_endpoint` is the unaudited insert that
`add_endpoint` audits (tests, the demo and the benchmark create endpoints directly)."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection

from outbox.audit import record_audit, require_reason
from outbox.crypto import (
    SIGNATURE_SCHEMES,
    InvalidSecretError,
    SecretBox,
    generate_signing_secret,
    signature_scheme,
    signing_key,
)
from outbox.endpoint_secrets import (
    check_keys_cover_stored_secrets as check_keys_cover_stored_secrets,
)
from outbox.endpoint_secrets import (
    client_certificate_context as client_certificate_context,
)
from outbox.endpoint_secrets import (
    decrypt_proxy as decrypt_proxy,
)
from outbox.endpoint_secrets import (
    headers_context as headers_context,
)
from outbox.endpoint_secrets import (
    oauth_context as oauth_context,
)
from outbox.endpoint_secrets import (
    proxy_context as proxy_context,
)
from outbox.endpoint_secrets import (
    reencrypt_secrets as reencrypt_secrets,
)
from outbox.endpoint_secrets import (
    secret_columns as secret_columns,
)
from outbox.endpoint_secrets import (
    secret_context as secret_context,
)
from outbox.errors import EndpointError, EndpointNotFoundError
from outbox.feeds import check_delivery_mode, new_feed_token
from outbox.filters import validate_filter
from outbox.ids import new_endpoint_id
from outbox.owners import check_owner
from outbox.schema import LATENCY_BUCKETS, ON_AMBIGUOUS
from outbox.sql import endpoints as queries
from outbox.sql.feeds import ENSURE_ENDPOINT_FEED
from outbox.tenants import DEFAULT_TENANT, scope_params, validate_tenant_uid
from outbox.urls import parse_proxy_url, validate_endpoint_url

_PATTERN = re.compile(r"^(\*|[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9][A-Za-z0-9_-]*)*(\.\*)?)$")


@dataclass(frozen=True, slots=True)
class Endpoint:
    id: int
    uid: str
    tenant: str
    all_tenants: bool
    url: str
    description: str
    event_types: list[str]
    enabled: bool
    disabled_reason: str | None
    disabled_at: dt.datetime | None
    created_at: dt.datetime
    signature_scheme: str = "hmac"
    public_key: str | None = None  # `whpk_...` for ed25519: what the partner verifies with
    proxy: str | None = None  # its own egress proxy as host:port (the URL is a secret)
    delivery_mode: str = "push"  # push, pull (its catch-up feed only) or both (outbox.feeds)
    payload_filter: str | None = None  # a SQL/JSON path predicate (outbox.filters)
    filter_skips: int = 0  # events its filter could not evaluate, skipped (kept until retention)
    on_ambiguous: str = "retry"  # 'hold': an ambiguous outcome waits for a person
    owner: str | None = None  # the team its failures belong to (outbox.owners)
    operational_owner: str | None = None  # takes only this owner's operational events

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.uid,
            "tenant": self.tenant,
            "all_tenants": self.all_tenants,
            "url": self.url,
            "description": self.description,
            "event_types": self.event_types,
            "enabled": self.enabled,
            "disabled_reason": self.disabled_reason,
            "disabled_at": self.disabled_at.isoformat() if self.disabled_at else None,
            "created_at": self.created_at.isoformat(),
            "signature_scheme": self.signature_scheme,
            "public_key": self.public_key,
            "proxy": self.proxy,
            "delivery_mode": self.delivery_mode,
            "payload_filter": self.payload_filter,
            "filter_skips": self.filter_skips,
            "on_ambiguous": self.on_ambiguous,
            "owner": self.owner,
            "operational_owner": self.operational_owner,
        }


@dataclass(frozen=True, slots=True)
class CreatedEndpoint:
    endpoint: Endpoint
    secret: str  # shown once, at creation; stored only encrypted
    feed_token: str | None = None  # a pull or both endpoint's feed token, shown once


def check_signing_secret(secret: str | None, signature: str | None) -> str:
    """The secret to store: the one given (its prefix names its scheme) or a new one of
    `signature`'s scheme (default HMAC). EndpointError when they disagree or it is junk."""
    if signature is not None and signature not in SIGNATURE_SCHEMES:
        raise EndpointError(f"signature {signature!r} is not one of: hmac, ed25519")
    if secret is None:
        return generate_signing_secret(signature or "hmac")
    if signature is not None and signature_scheme(secret) != signature:
        raise EndpointError(
            f"a {signature} endpoint needs a "
            f"{'whsk_ secret key' if signature == 'ed25519' else 'whsec_ secret'}; "
            "omit --secret to have one generated"
        )
    try:
        signing_key(secret)
    except InvalidSecretError as exc:
        raise EndpointError(str(exc)) from exc
    return secret


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


def set_proxy(
    conn: Connection,
    box: SecretBox,
    uid: str,
    proxy: str | None,
    *,
    actor: str,
    reason: str | None = None,
    request_id: str | None = None,
    scope: str | None = None,
) -> Endpoint:
    """Send this endpoint's deliveries through its own egress proxy (None: the default).

    The URL (`http://user:password@host:port`) is stored encrypted, since it may carry
    credentials; the endpoint shows, and the audit row records, only `host:port`. The
    proxy changes where bytes go, never what the SSRF guard allows.
    """
    parsed = None if proxy is None else parse_proxy_url(proxy, what="the endpoint's proxy URL")
    stored = None if proxy is None else box.encrypt(proxy, context=proxy_context(uid))
    shown = None if parsed is None else parsed.display
    updated = conn.execute(
        queries.SET_ENDPOINT_PROXY,
        {"uid": uid, "proxy_url": stored, "proxy_host": shown, **scope_params(conn, scope)},
    ).first()
    if updated is None:
        raise endpoint_not_found(uid)
    record_audit(
        conn,
        actor=actor,
        action="endpoint.proxy",
        target_type="endpoint",
        target_id=uid,
        reason=reason,
        request_id=request_id,
        details={"proxy": shown},
    )
    return get_endpoint(conn, uid)


def create_endpoint(
    conn: Connection,
    box: SecretBox,
    *,
    url: str,
    event_types: str | Iterable[str],
    secret: str | None = None,
    description: str = "",
    https_only: bool = False,
    tenant: str = DEFAULT_TENANT,
    all_tenants: bool = False,
    signature: str | None = None,
    delivery_mode: str = "push",
    payload_filter: str | None = None,
    concurrency: str = "adaptive",
) -> CreatedEndpoint:
    """Insert an endpoint of `tenant` in the caller's transaction; the secret is stored
    encrypted. `all_tenants` makes it receive every tenant's matching events.
    `signature` is 'hmac' (v1, the default) or 'ed25519' (v1a). A 'pull' or 'both'
    endpoint gets a feed token (outbox.feeds), shown once in the answer. `concurrency`
    'adaptive' (the default, measured in docs/performance-history.md) lets the worker
    find its in-flight limit up to OUTBOX_ADAPTIVE_DEFAULT_MAX; 'fixed' means no limit
    until one is set."""
    tenant = validate_tenant_uid(tenant, error=EndpointError)
    check_concurrency_mode(concurrency)
    url = validate_endpoint_url(url, https_only=https_only)
    patterns = parse_event_patterns(event_types)
    plain_secret = check_signing_secret(secret, signature)
    check_delivery_mode(delivery_mode)
    stored_filter = validate_filter(conn, payload_filter)
    uid = new_endpoint_id()
    feed_token, feed_token_hash = (None, None)
    if delivery_mode != "push":
        feed_token, feed_token_hash = new_feed_token(uid)
    inserted = conn.execute(
        queries.INSERT_ENDPOINT,
        {
            "uid": uid,
            "tenant": tenant,
            "all_tenants": all_tenants,
            "url": url,
            "description": description,
            "event_types": patterns,
            **secret_columns(box, uid, plain_secret),
            "delivery_mode": delivery_mode,
            "payload_filter": stored_filter,
            "feed_token_hash": feed_token_hash,
            "adaptive": concurrency == "adaptive",
        },
    ).first()
    if inserted is None:
        raise EndpointError(
            f"unknown tenant {tenant!r}: create it first with `outbox tenants add {tenant}`"
        )
    if feed_token is not None:
        conn.execute(ENSURE_ENDPOINT_FEED, {"id": inserted.id})
    return CreatedEndpoint(
        endpoint=get_endpoint(conn, uid), secret=plain_secret, feed_token=feed_token
    )


CONCURRENCY_MODES = ("adaptive", "fixed")


def check_concurrency_mode(mode: str) -> None:
    if mode not in CONCURRENCY_MODES:
        raise EndpointError(
            f"concurrency must be 'adaptive' (the default) or 'fixed', not {mode!r}"
        )


def endpoint_not_found(uid: str) -> EndpointNotFoundError:
    return EndpointNotFoundError(f"no endpoint {uid!r}; `outbox endpoints list` shows the ids")


def get_endpoint(conn: Connection, uid: str, *, scope: str | None = None) -> Endpoint:
    """The endpoint; with `scope` (a tenant uid) only if it is that tenant's, else not found."""
    row = (
        conn.execute(queries.SELECT_ENDPOINT_BY_UID, {"uid": uid, **scope_params(conn, scope)})
        .mappings()
        .first()
    )
    if row is None:
        raise endpoint_not_found(uid)
    return Endpoint(**row)


def list_endpoints(conn: Connection, *, scope: str | None = None) -> list[Endpoint]:
    """Every endpoint, or with `scope` only that tenant's."""
    rows = conn.execute(queries.SELECT_ENDPOINTS, scope_params(conn, scope)).mappings()
    return [Endpoint(**row) for row in rows]


def set_enabled(
    conn: Connection,
    uid: str,
    *,
    enabled: bool,
    reason: str | None = None,
    actor: str,
    request_id: str | None = None,
    scope: str | None = None,
) -> Endpoint:
    """Enable or disable an endpoint; disabling keeps its pending deliveries waiting."""
    if not enabled and not (reason and reason.strip()):
        raise EndpointError("disabling an endpoint needs a reason (--reason)")
    updated = conn.execute(
        queries.SET_ENDPOINT_ENABLED,
        {"uid": uid, "enabled": enabled, "reason": reason, **scope_params(conn, scope)},
    ).first()
    if updated is None:
        raise endpoint_not_found(uid)
    if enabled:
        # Recover gently: one probe first, then the ramp (delivery/health/).
        conn.execute(queries.RESET_ENDPOINT_HEALTH_ON_ENABLE, {"id": updated.id})
    record_audit(
        conn,
        actor=actor,
        action="endpoint.enable" if enabled else "endpoint.disable",
        target_type="endpoint",
        target_id=uid,
        reason=reason,
        request_id=request_id,
    )
    return get_endpoint(conn, uid)


def reveal_secret(
    conn: Connection,
    box: SecretBox,
    uid: str,
    *,
    actor: str,
    reason: str,
    scope: str | None = None,
    request_id: str | None = None,
) -> str:
    """Decrypt one endpoint's secret for a person; audited in the same transaction."""
    if not reason.strip():
        raise EndpointError("revealing a secret needs a reason (--reason)")
    row = conn.execute(
        queries.SELECT_ENDPOINT_SECRET, {"uid": uid, **scope_params(conn, scope)}
    ).first()
    if row is None:
        raise endpoint_not_found(uid)
    record_audit(
        conn,
        actor=actor,
        action="endpoint.reveal_secret",
        target_type="endpoint",
        target_id=uid,
        reason=reason,
        request_id=request_id,
    )
    return box.decrypt(row.signing_secret, context=secret_context(uid))


def add_endpoint(
    conn: Connection,
    box: SecretBox,
    *,
    actor: str,
    url: str,
    event_types: str | Sequence[str],
    secret: str | None = None,
    description: str = "",
    request_id: str | None = None,
    https_only: bool = False,
    signature: str | None = None,
    tenant: str = DEFAULT_TENANT,
    all_tenants: bool = False,
    delivery_mode: str = "push",
    payload_filter: str | None = None,
    concurrency: str = "adaptive",
) -> CreatedEndpoint:
    """`create_endpoint` (which validates the URL) plus an audit row; the secret is never logged."""
    created = create_endpoint(
        conn,
        box,
        url=url,
        event_types=event_types,
        secret=secret,
        description=description,
        https_only=https_only,
        signature=signature,
        tenant=tenant,
        all_tenants=all_tenants,
        delivery_mode=delivery_mode,
        payload_filter=payload_filter,
        concurrency=concurrency,
    )
    record_audit(
        conn,
        actor=actor,
        action="endpoint.create",
        target_type="endpoint",
        target_id=created.endpoint.uid,
        details={
            "url": created.endpoint.url,
            "event_types": created.endpoint.event_types,
            "all_tenants": all_tenants,
            "delivery_mode": delivery_mode,
            "payload_filter": created.endpoint.payload_filter,
            "concurrency": concurrency,
        },
        request_id=request_id,
    )
    return created


def update_endpoint(
    conn: Connection,
    uid: str,
    *,
    actor: str,
    url: str | None = None,
    description: str | None = None,
    event_types: str | Sequence[str] | None = None,
    timeout_seconds: float | None = None,
    max_attempts: int | None = None,
    reason: str | None = None,
    request_id: str | None = None,
    https_only: bool = False,
    scope: str | None = None,
) -> Endpoint:
    """Change what is given and nothing else; the audit row keeps the before and after."""
    before = get_endpoint(conn, uid, scope=scope)
    patterns = parse_event_patterns(event_types) if event_types is not None else None
    if timeout_seconds is not None and timeout_seconds <= 0:
        raise EndpointError("the timeout must be a positive number of seconds")
    if max_attempts is not None and not 0 < max_attempts <= 100:
        raise EndpointError("max attempts must be between 1 and 100")
    changes = {
        "url": validate_endpoint_url(url, https_only=https_only) if url is not None else None,
        "description": description,
        "event_types": patterns,
        "timeout_seconds": timeout_seconds,
        "max_attempts": max_attempts,
    }
    changed = {key: value for key, value in changes.items() if value is not None}
    if not changed:
        raise EndpointError("nothing to change: give --url, --events, --description, ...")
    conn.execute(
        queries.UPDATE_ENDPOINT,
        {
            "uid": uid,
            **changes,
            "set_timeout": timeout_seconds is not None,
            "set_max_attempts": max_attempts is not None,
            **scope_params(conn, scope),
        },
    )
    record_audit(
        conn,
        actor=actor,
        action="endpoint.update",
        target_type="endpoint",
        target_id=uid,
        reason=reason,
        details={
            "changed": changed,
            "before": {k: v for k, v in before.as_json().items() if k in changed},
        },
        request_id=request_id,
    )
    return get_endpoint(conn, uid, scope=scope)


def set_failure_policy(
    conn: Connection,
    uid: str,
    *,
    actor: str,
    on_ambiguous: str | None = None,
    owner: str | None = None,
    operational_owner: str | None = None,
    reason: str | None = None,
    request_id: str | None = None,
    scope: str | None = None,
) -> Endpoint:
    """Set what an ambiguous outcome does ('retry' or 'hold'), the endpoint's owner and the
    owner whose operational events it takes; None leaves a field, "" clears an owner."""
    if on_ambiguous is not None and on_ambiguous not in ON_AMBIGUOUS:
        raise EndpointError(
            f"on-ambiguous {on_ambiguous!r} is not known: use retry (the default) or hold"
        )
    for value in (owner, operational_owner):
        if value:
            check_owner(value)
    if on_ambiguous is None and owner is None and operational_owner is None:
        raise EndpointError(
            "nothing to change: give --on-ambiguous, --owner or --operational-owner"
        )
    before = get_endpoint(conn, uid, scope=scope)
    conn.execute(
        queries.SET_ENDPOINT_FAILURE_POLICY,
        {
            "uid": uid,
            "set_on_ambiguous": on_ambiguous is not None,
            "on_ambiguous": on_ambiguous,
            "set_owner": owner is not None,
            "owner": owner or None,
            "set_operational_owner": operational_owner is not None,
            "operational_owner": operational_owner or None,
            **scope_params(conn, scope),
        },
    )
    changed = {
        key: value or None
        for key, value in (
            ("on_ambiguous", on_ambiguous),
            ("owner", owner),
            ("operational_owner", operational_owner),
        )
        if value is not None
    }
    record_audit(
        conn,
        actor=actor,
        action="endpoint.update",
        target_type="endpoint",
        target_id=uid,
        reason=reason,
        details={
            "changed": changed,
            "before": {k: v for k, v in before.as_json().items() if k in changed},
        },
        request_id=request_id,
    )
    return get_endpoint(conn, uid, scope=scope)


@dataclass(frozen=True, slots=True)
class RotatedSecret:
    endpoint: Endpoint
    secret: str  # the new secret, shown once
    previous_expires_at: dt.datetime


def rotate_secret(
    conn: Connection,
    box: SecretBox,
    uid: str,
    *,
    actor: str,
    now: dt.datetime,
    grace: dt.timedelta,
    secret: str | None = None,
    reason: str | None = None,
    request_id: str | None = None,
    signature: str | None = None,
    scope: str | None = None,
) -> RotatedSecret:
    """Install a new signing secret; the old one keeps signing too until `now + grace`.

    The new secret keeps the endpoint's scheme unless `signature` names the other one
    ('hmac' or 'ed25519'); during the grace both signatures go out, whatever schemes."""
    if grace < dt.timedelta(0):
        raise EndpointError("the grace period cannot be negative")
    if signature is None and secret is None:
        signature = get_endpoint(conn, uid, scope=scope).signature_scheme  # keep its scheme
    new_secret = check_signing_secret(secret, signature)
    expires = now + grace
    updated = conn.execute(
        queries.ROTATE_ENDPOINT_SECRET,
        {
            "uid": uid,
            "expires_at": expires,
            **secret_columns(box, uid, new_secret),
            **scope_params(conn, scope),
        },
    ).first()
    if updated is None:
        raise endpoint_not_found(uid)
    record_audit(
        conn,
        actor=actor,
        action="endpoint.rotate_secret",
        target_type="endpoint",
        target_id=uid,
        reason=reason,
        details={
            "previous_expires_at": expires.isoformat(),
            "signature_scheme": signature_scheme(new_secret),
        },
        request_id=request_id,
    )
    return RotatedSecret(get_endpoint(conn, uid, scope=scope), new_secret, expires)


def delete_endpoint(
    conn: Connection,
    uid: str,
    *,
    actor: str,
    reason: str | None,
    force: bool = False,
    request_id: str | None = None,
    scope: str | None = None,
) -> dict[str, int]:
    """Delete an endpoint and its delivery history; refused while deliveries are pending.

    Pending deliveries would be lost silently, so they must be discarded first (or
    `force` given). Disabling is the reversible alternative.
    """
    why = require_reason(reason, "deleting an endpoint")
    endpoint = get_endpoint(conn, uid, scope=scope)
    counts = conn.execute(
        queries.COUNT_ENDPOINT_DELIVERIES, {"uid": uid, **scope_params(conn, scope)}
    ).one()
    if counts.pending and not force:
        raise EndpointError(
            f"endpoint {uid} has {counts.pending} pending deliveries: discard them, or disable "
            "the endpoint instead, or pass --force to delete them too"
        )
    row = conn.execute(
        queries.DELETE_ENDPOINT,
        {"uid": uid, "buckets": list(LATENCY_BUCKETS), **scope_params(conn, scope)},
    ).one()
    result = {"deliveries": int(counts.total), "attempts": int(row.attempts)}
    record_audit(
        conn,
        actor=actor,
        action="endpoint.delete",
        target_type="endpoint",
        target_id=uid,
        reason=why,
        details={**result, "pending": int(counts.pending), "forced": force},
        request_id=request_id,
        tenant=endpoint.tenant,  # the row is gone: name its tenant explicitly
    )
    return result
