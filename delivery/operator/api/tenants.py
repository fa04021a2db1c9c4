"""Tenants (the application's customers): list, show, create, change, disable and enable,
delete, and the single-use links into a tenant's portal. A tenant-scoped token sees its
own tenant and changes none."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import Connection

from delivery.operator.api.core import ApiError, Call, Operation, Param
from delivery.operator.console.sessions import MAX_LINK_TTL, issue_portal_link, portal_link
from delivery.operator.handler_inputs import (
    PortalLinkCreate,
    TenantAction,
    TenantCreate,
    TenantDelete,
    TenantDisable,
    TenantListQuery,
    TenantUpdate,
)
from outbox import tenants as tenant_ops
from outbox.errors import NotFoundError, TenantError

TENANT = Param("tenant", "Tenant id (the application's customer id).")


async def create_portal_link(call: Call) -> Any:
    """A single-use link into one tenant's portal (console/sessions.py); audited."""
    tenant = str(call.request.path_params["tenant"])
    ttl = (await call.body()).get("ttl_seconds", 900)
    if isinstance(ttl, bool) or not isinstance(ttl, int):
        raise ApiError(400, "ttl_seconds must be a whole number of seconds, e.g. 900")
    if not 0 < ttl <= MAX_LINK_TTL.total_seconds():  # before timedelta, which overflows
        raise ApiError(400, "a portal link's lifetime must be above 0 and at most 7 days")
    lifetime = dt.timedelta(seconds=ttl)
    now = call.api.clock.now()
    scope = call.scope

    def issue(conn: Connection) -> str:
        # A tenant-scoped token reaches its own tenant only; any other is not found.
        if scope is not None and scope != tenant:
            raise NotFoundError(f"no enabled tenant {tenant!r}")
        return issue_portal_link(conn, tenant, actor=call.actor, now=now, ttl=lifetime)

    secret = await call.api.write(issue)
    return {
        "tenant": tenant,
        "link": portal_link(secret, call.api.config.console.public_url),
        "expires_at": (now + lifetime).isoformat(),
    }


def _path_tenant(call: Call) -> str:
    return str(call.request.path_params["tenant"])


def _tenant_change(call: Call) -> str:
    """The tenant a change names; a scoped token may change no tenant (404 for another's)."""
    uid = _path_tenant(call)
    if call.scope is not None and uid != call.scope:
        raise ApiError(404, f"no tenant {uid!r}; `outbox tenants list` shows them")
    call.unscoped_only("change a tenant")
    return uid


async def list_tenants_route(call: Call) -> Any:
    scope, after = call.scope, call.query("after")
    given_limit = call.query_int("limit")  # 0 is refused by list_tenants, not made 100
    limit = 100 if given_limit is None else given_limit
    enabled = call.query_flag("enabled")
    want = enabled
    found = await call.api.read(
        lambda c: tenant_ops.list_tenants(c, scope=scope, after=after, enabled=want, limit=limit)
    )
    return {
        "items": [t.as_json() for t in found],
        "next_after": found[-1].uid if len(found) == limit else None,
    }


async def show_tenant_route(call: Call) -> Any:
    uid, scope = _path_tenant(call), call.scope
    return (await call.api.read(lambda c: tenant_ops.show_tenant(c, uid, scope=scope))).as_json()


def _reason(data: dict[str, Any]) -> str | None:
    reason = data.get("reason")
    if reason is not None and not isinstance(reason, str):
        raise ApiError(400, 'reason must be a string, e.g. {"reason": "customer left"}')
    return reason


def _caps(data: dict[str, Any]) -> dict[str, Any]:
    """Caps present in a body: 0 or null clears one (no limit); absent keys stay."""
    return {key: data[key] or None for key in ("max_in_flight", "max_per_second") if key in data}


async def create_tenant_route(call: Call) -> Any:
    call.unscoped_only("create tenants")
    data = await call.body()
    uid = data.get("id")
    if not isinstance(uid, str):
        raise TenantError('give the tenant id (your customer id) as a string: {"id": "..."}')
    created = await call.api.write(
        lambda c: tenant_ops.add_tenant(
            c,
            uid,
            actor=call.actor,
            name=str(data.get("name") or ""),
            metadata=data.get("metadata"),
            request_id=call.request_id,
            **_caps(data),
        )
    )
    return created.as_json()


async def update_tenant_route(call: Call) -> Any:
    uid, data = _tenant_change(call), await call.body()
    now = call.api.clock.now()
    name = data.get("name")
    if name is not None and not isinstance(name, str):
        raise TenantError("name must be a string")
    updated = await call.api.write(
        lambda c: tenant_ops.update_tenant(
            c,
            uid,
            actor=call.actor,
            now=now,
            name=name,
            metadata=data.get("metadata"),
            reason=_reason(data),
            request_id=call.request_id,
            **_caps(data),
        )
    )
    return updated.as_json()


async def _tenant_enabled(call: Call, enabled: bool) -> Any:
    uid, data = _tenant_change(call), await call.body()
    now = call.api.clock.now()
    changed = await call.api.write(
        lambda c: tenant_ops.set_tenant_enabled(
            c,
            uid,
            enabled=enabled,
            actor=call.actor,
            now=now,
            reason=_reason(data),
            request_id=call.request_id,
        )
    )
    return changed.as_json()


async def disable_tenant_route(call: Call) -> Any:
    return await _tenant_enabled(call, False)


async def enable_tenant_route(call: Call) -> Any:
    return await _tenant_enabled(call, True)


async def delete_tenant_route(call: Call) -> Any:
    uid = _tenant_change(call)
    force = bool(call.query_flag("force"))
    reason, now = call.query("reason"), call.api.clock.now()
    result = await call.api.write(
        lambda c: tenant_ops.delete_tenant(
            c, uid, actor=call.actor, reason=reason, now=now, force=force,
            request_id=call.request_id,
        )
    )  # fmt: skip
    return {"deleted": uid, **result}


routes = [
    Operation(
        "GET",
        "/v1/tenants",
        "viewer",
        "Tenants in id order (a scoped token sees its own).",
        list_tenants_route,
        query=TenantListQuery,
    ),
    Operation(
        "POST",
        "/v1/tenants",
        "operator",
        "Create a tenant (unscoped tokens only).",
        create_tenant_route,
        body=TenantCreate,
    ),
    Operation(
        "GET",
        "/v1/tenants/{tenant}",
        "viewer",
        "A tenant with its endpoint, event, delivery and token counts.",
        show_tenant_route,
        (TENANT,),
    ),
    Operation(
        "PATCH",
        "/v1/tenants/{tenant}",
        "operator",
        "Change a tenant's name, metadata or caps (0 or null: no limit).",
        update_tenant_route,
        (TENANT,),
        body=TenantUpdate,
    ),
    Operation(
        "POST",
        "/v1/tenants/{tenant}/disable",
        "operator",
        "Disable a tenant: its deliveries are held (nothing is dropped) until enabled.",
        disable_tenant_route,
        (TENANT,),
        body=TenantDisable,
    ),
    Operation(
        "POST",
        "/v1/tenants/{tenant}/enable",
        "operator",
        "Enable a tenant; its held deliveries resume.",
        enable_tenant_route,
        (TENANT,),
        body=TenantAction,
    ),
    Operation(
        "DELETE",
        "/v1/tenants/{tenant}",
        "operator",
        "Delete a tenant, its endpoints and history, revoking its tokens "
        "(refused while anything is pending).",
        delete_tenant_route,
        (TENANT,),
        query=TenantDelete,
    ),
    Operation(
        "POST",
        "/v1/tenants/{tenant}/portal-links",
        "operator",
        "A single-use, short-lived link that opens the tenant's portal (audited).",
        create_portal_link,
        (TENANT,),
        body=PortalLinkCreate,
    ),
]
