"""What the console and the portal read and do, confined to a session's tenant.

`tenant` None is an unscoped operator (everything); a tenant uid confines every read and
write to that tenant. The confinement is outbox's own (`scope=` on the operator
functions, enforced in their SQL): another tenant's delivery or endpoint answers exactly
like one that does not exist. The actions are the functions the CLI and the admin API
call, each with its audit row in the same transaction, so the three surfaces agree.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy import Connection

from delivery.oauth import OAUTH_FAILURE_PREFIX
from delivery.operator.console import queries
from outbox import audit as audit_log
from outbox import deliveries as delivery_ops
from outbox import endpoints as endpoint_ops
from outbox import feeds
from outbox.crypto import SecretBox
from outbox.endpoint_auth import get_endpoint_auth
from outbox.endpoints import CreatedEndpoint, Endpoint, get_endpoint, reveal_secret, set_enabled
from outbox.endpoints import list_endpoints as list_all_endpoints
from outbox.errors import NotFoundError
from outbox.stats import collect_stats
from outbox.testevents import send_test_event as send_ping


def require_endpoint(conn: Connection, uid: str, tenant: str | None) -> Endpoint:
    return get_endpoint(conn, uid, scope=tenant)


# -- reads ----------------------------------------------------------------------------------


def search_deliveries(
    conn: Connection,
    flt: delivery_ops.DeliveryFilter,
    *,
    tenant: str | None,
    message_id: str | None,
) -> list[delivery_ops.DeliverySummary]:
    """Newest first, one page; `tenant` is the session's scope or the operator's filter."""
    return delivery_ops.search_deliveries(conn, replace(flt, tenant=tenant, message_id=message_id))


def get_delivery(
    conn: Connection, delivery_id: int, tenant: str | None
) -> delivery_ops.DeliveryDetail:
    return delivery_ops.get_delivery(conn, delivery_id, scope=tenant)


def delivery_page(
    conn: Connection, delivery_id: int, tenant: str | None
) -> tuple[delivery_ops.DeliveryDetail, str | None]:
    """A delivery, and the message id of a newer delivered event that supersedes it (the
    warning shown before its replay button), if any."""
    detail = delivery_ops.get_delivery(conn, delivery_id, scope=tenant)
    return detail, delivery_ops.superseded_by(conn, [delivery_id]).get(delivery_id)


def list_endpoints(conn: Connection, tenant: str | None) -> list[Endpoint]:
    return list_all_endpoints(conn, scope=tenant)


# How far back the endpoint page looks for what its OAuth2 token did (its charts' day).
TOKEN_ACTIVITY_WINDOW = dt.timedelta(days=1)


def endpoint_page(
    conn: Connection, uid: str, tenant: str | None, *, now: dt.datetime
) -> dict[str, Any]:
    """An endpoint with its limits, retry policy, rules and authenticated delivery."""
    endpoint = require_endpoint(conn, uid, tenant)
    settings = conn.execute(queries.SELECT_ENDPOINT_SETTINGS, {"uid": uid}).mappings().one()
    return {
        "endpoint": endpoint,
        "settings": dict(settings),
        "auth": endpoint_auth_view(conn, uid, tenant, now=now),
    }


def endpoint_auth_view(
    conn: Connection, uid: str, tenant: str | None, *, now: dt.datetime
) -> dict[str, Any]:
    """What the page shows of mutual TLS and OAuth2: the stored summaries (never the key,
    the client secret or a token) and what the token did lately, from the attempts."""
    auth = get_endpoint_auth(conn, uid, scope=tenant)
    certificate = None
    if auth.client_certificate is not None:
        expires = dt.datetime.fromisoformat(auth.client_certificate["not_after"])
        certificate = {
            **auth.client_certificate,
            "not_after": expires,
            "expired": expires <= now,
            "days_left": (expires - now).days,
        }
    oauth = None
    if auth.oauth is not None:
        activity = (
            conn.execute(
                queries.SELECT_ENDPOINT_TOKEN_ACTIVITY,
                {
                    "uid": uid,
                    "since": now - TOKEN_ACTIVITY_WINDOW,
                    "oauth_failure": OAUTH_FAILURE_PREFIX,
                },
            )
            .mappings()
            .one()
        )
        error = activity["token_error"]
        oauth = {
            **auth.oauth,
            "token_used_at": activity["token_used_at"],
            "token_error_at": activity["token_error_at"],
            "token_error": error.removeprefix(OAUTH_FAILURE_PREFIX) if error else None,
        }
    return {"client_certificate": certificate, "oauth": oauth}


def event_types(conn: Connection, tenant: str) -> list[str]:
    """Types a tenant's endpoints can choose from: those published for it lately."""
    rows = conn.execute(queries.SELECT_TENANT_EVENT_TYPES, {"tenant_uid": tenant}).scalars()
    return [str(value) for value in rows]


@dataclass(frozen=True, slots=True)
class Overview:
    """The overview tiles, for everything or for one tenant."""

    counts_by_state: dict[str, int]
    due_now: int
    oldest_due_age_seconds: float | None
    relay_lag_seconds: float | None
    window: dict[str, Any]
    alerts: list[Any] = field(default_factory=list)
    endpoints: list[Any] = field(default_factory=list)
    dead_by_owner: dict[str, int] = field(default_factory=dict)
    held_by_owner: dict[str, int] = field(default_factory=dict)
    workflows: list[Any] = field(default_factory=list)  # event types with thresholds


def overview(
    conn: Connection,
    tenant: str | None,
    *,
    now: dt.datetime,
    window: dt.timedelta,
    thresholds: Any,
) -> Overview:
    stats = collect_stats(conn, now=now, window=window, thresholds=thresholds, scope=tenant)
    return Overview(
        counts_by_state=dict(stats.counts_by_state),
        due_now=stats.due_now,
        oldest_due_age_seconds=stats.oldest_due_age_seconds,
        relay_lag_seconds=stats.relay_lag_seconds,
        window=dict(stats.window),
        alerts=list(stats.alerts),
        endpoints=list(stats.endpoints),
        dead_by_owner=dict(stats.dead_by_owner),
        held_by_owner=dict(stats.held_by_owner),
        workflows=list(stats.workflows),
    )


def list_audit(
    conn: Connection, tenant: str | None, *, actor: str | None, action: str | None, limit: int
) -> list[audit_log.AuditEntry]:
    return audit_log.list_audit(conn, actor=actor, action=action, limit=limit, scope=tenant)


# -- actions --------------------------------------------------------------------------------


def replay(
    conn: Connection,
    delivery_id: int,
    tenant: str | None,
    *,
    actor: str,
    reason: str | None,
    now: dt.datetime,
    force: bool = False,
) -> delivery_ops.ReplayResult:
    return delivery_ops.replay(
        conn, [delivery_id], actor=actor, reason=reason, now=now, scope=tenant, force=force
    )


def discard(
    conn: Connection,
    delivery_id: int,
    tenant: str | None,
    *,
    actor: str,
    reason: str | None,
    now: dt.datetime,
) -> list[int]:
    return delivery_ops.discard(
        conn, [delivery_id], actor=actor, reason=reason, now=now, scope=tenant
    )


def resolve_held(
    conn: Connection,
    delivery_id: int,
    tenant: str | None,
    *,
    action: str,
    actor: str,
    reason: str | None,
    now: dt.datetime,
) -> list[int]:
    return delivery_ops.resolve_held(
        conn, [delivery_id], action=action, actor=actor, reason=reason, now=now, scope=tenant
    )


def add_endpoint(
    conn: Connection,
    box: SecretBox,
    tenant: str,
    *,
    actor: str,
    url: str,
    event_types: list[str],
    description: str,
    https_only: bool,
    delivery_mode: str = "push",
    payload_filter: str | None = None,
    concurrency: str = "adaptive",
) -> CreatedEndpoint:
    """A new endpoint of `tenant` (never all_tenants from here), audited."""
    return endpoint_ops.add_endpoint(
        conn,
        box,
        actor=actor,
        url=url,
        event_types=event_types,
        description=description,
        https_only=https_only,
        tenant=tenant,
        delivery_mode=delivery_mode,
        payload_filter=payload_filter,
        concurrency=concurrency,
    )


def set_feed_fields(
    conn: Connection,
    uid: str,
    tenant: str | None,
    *,
    actor: str,
    delivery_mode: str | None,
    payload_filter: str | None,
) -> str | None:
    """The edit form's delivery mode and payload filter, where they changed; a feed token
    made for an endpoint that now has its first feed (shown once)."""
    endpoint = require_endpoint(conn, uid, tenant)
    token = None
    if delivery_mode is not None and delivery_mode != endpoint.delivery_mode:
        token = feeds.set_delivery_mode(conn, uid, delivery_mode, actor=actor, scope=tenant)
    if payload_filter is not None and (payload_filter.strip() or None) != endpoint.payload_filter:
        feeds.set_payload_filter(conn, uid, payload_filter, actor=actor, scope=tenant)
    return token


def rotate_feed_token(conn: Connection, uid: str, tenant: str | None, *, actor: str) -> str:
    require_endpoint(conn, uid, tenant)
    return feeds.rotate_feed_token(conn, uid, actor=actor, scope=tenant)


def update_endpoint(
    conn: Connection,
    uid: str,
    tenant: str | None,
    *,
    actor: str,
    url: str | None,
    description: str | None,
    event_types: list[str] | None,
    https_only: bool,
) -> Endpoint:
    return endpoint_ops.update_endpoint(
        conn,
        uid,
        actor=actor,
        url=url,
        description=description,
        event_types=event_types,
        https_only=https_only,
        scope=tenant,
    )


def set_endpoint_enabled(
    conn: Connection,
    uid: str,
    tenant: str | None,
    *,
    enabled: bool,
    actor: str,
    reason: str | None,
) -> Endpoint:
    return set_enabled(conn, uid, enabled=enabled, reason=reason, actor=actor, scope=tenant)


def delete_endpoint(
    conn: Connection, uid: str, tenant: str | None, *, actor: str, reason: str | None
) -> dict[str, int]:
    return endpoint_ops.delete_endpoint(conn, uid, actor=actor, reason=reason, scope=tenant)


def reveal(conn: Connection, box: SecretBox, uid: str, tenant: str | None, *, actor: str) -> str:
    return reveal_secret(
        conn, box, uid, actor=actor, reason="shown in the web console", scope=tenant
    )


def rotate(
    conn: Connection,
    box: SecretBox,
    uid: str,
    tenant: str | None,
    *,
    actor: str,
    now: dt.datetime,
    grace: dt.timedelta,
) -> endpoint_ops.RotatedSecret:
    return endpoint_ops.rotate_secret(
        conn, box, uid, actor=actor, now=now, grace=grace, scope=tenant
    )


def send_test_event(
    conn: Connection, uid: str, tenant: str | None, *, actor: str, now: dt.datetime
) -> int:
    """The ping `outbox endpoints test` sends, to this endpoint only; the delivery id."""
    return send_ping(conn, uid, now=now, actor=actor, scope=tenant).delivery_id


def issue_link_checked(conn: Connection, tenant: str, scope: str | None) -> None:
    """A tenant-scoped caller may issue links to its own tenant only (others: not found)."""
    if scope is not None and scope != tenant:
        raise NotFoundError(f"no tenant {tenant!r}")
