"""The admin HTTP API: the operator's CLI as JSON, behind bearer tokens, plus /metrics.

Every route is declared once in `ROUTES` (method, path, role, parameters), and both
the Starlette routing and the OpenAPI document are built from that table, so the
document cannot drift from what is served.

Roles: a viewer reads; an operator also replays, discards and changes endpoints.
A token may be confined to one tenant: then every route reads and acts on that
tenant's rows only, enforced in the queries (the `scope` every outbox call takes),
and another tenant's object answers 404 exactly like one that does not exist.
Unscoped tokens can narrow reads with `?tenant=`.
A refused call (401 without a valid token, 403 with too weak a role or for what a
tenant-scoped token may not do) is written
to the audit log like any other action, with the request id. Mutations write
their audit row in the same transaction as the change (see outbox.operations).

The database work is the same synchronous code the CLI runs, executed on the
service's async engine through `run_sync`, so the two can never disagree.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import logging
import re
import socket
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import uvicorn
from alembic.runtime.migration import MigrationContext
from pydantic import BaseModel
from sqlalchemy import Connection, text
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from delivery.operator.console.sessions import issue_portal_link, portal_link
from delivery.operator.console.web import Console, ConsoleConfig
from delivery.operator.metrics import render_metrics
from delivery.operator.refusals import (
    RATE_LIMITED,
    UnauthenticatedLimiter,
    client_address,
    record_refusal,
)
from delivery.operator.validation import (
    AuditQuery,
    DeliveryRef,
    DeliverySearch,
    DiscardMany,
    DiscardOne,
    EndpointAction,
    EndpointCreate,
    EndpointDelete,
    EndpointRef,
    EndpointUpdate,
    InputError,
    ReplayFilter,
    ReplayMany,
    ReplayOne,
    RotateSecret,
    StatsQuery,
    flag_value,
    integer_value,
    nul_in,
    parse,
    time_value,
)
from delivery.ssrf import AddressPolicy, refusal_warning
from outbox import operations as ops
from outbox import tenants as tenant_ops
from outbox.clock import Clock, SystemClock
from outbox.crypto import SecretBox
from outbox.endpoints import Endpoint, get_endpoint, list_endpoints, set_enabled, set_proxy
from outbox.errors import NotFoundError, OutboxError, TenantError
from outbox.migrate import VERSION_TABLE, head_revision, release_version, schema_state
from outbox.schema_rules import DEFAULT_VALIDATION_BUDGET, SchemaLimits
from outbox.stats import AlertThresholds, EndpointHealth, collect_stats, read_totals
from outbox.tenants import DEFAULT_TENANT, require_tenant
from outbox.tokens import (
    MAX_TOKEN_LIFETIME,
    Principal,
    Role,
    TokenRefusedError,
    authenticate,
    create_token,
    list_tokens,
    revoke_token,
    role_allows,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

REQUEST_ID_HEADER = "x-request-id"
_SAFE_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


@dataclass(frozen=True, slots=True)
class AdminConfig:
    stats_window: dt.timedelta = dt.timedelta(hours=1)
    thresholds: AlertThresholds = field(default_factory=AlertThresholds)
    replay_rate_per_minute: float = 600.0
    metrics_public: bool = False
    default_rotation_grace: dt.timedelta = dt.timedelta(hours=24)
    https_only: bool = False
    max_body_bytes: int = 1024 * 1024
    allowed_networks: tuple[str, ...] = ()  # the SSRF guard's, for warnings on save
    refused_interval: dt.timedelta = dt.timedelta(minutes=1)
    unauthenticated_per_minute: float = 60.0
    # OUTBOX_TRUSTED_PROXIES: peers whose X-Forwarded-For names the client (see serve).
    trusted_proxies: tuple[str, ...] = ()
    console: ConsoleConfig = field(default_factory=ConsoleConfig)
    # Event-type schemas (OUTBOX_MAX_SCHEMA_*, OUTBOX_VALIDATION_BUDGET_MS).
    schema_limits: SchemaLimits = field(default_factory=SchemaLimits)
    validation_budget: float = DEFAULT_VALIDATION_BUDGET


class ApiError(Exception):
    """An HTTP error answer; raised inside handlers, rendered once by the dispatcher."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(slots=True)
class Call:
    """What a handler gets: the request, who is asking, and the shared pieces."""

    request: Request
    request_id: str
    principal: Principal | None
    api: AdminApi
    _body: Any = None

    @property
    def actor(self) -> str:
        return self.principal.actor if self.principal else "anonymous"

    @property
    def scope(self) -> str | None:
        """The tenant a scoped token is confined to; None for an unscoped caller."""
        return self.principal.tenant if self.principal else None

    async def tenant(self, requested: Any = None, *, from_query: bool = True) -> str | None:
        """The tenant to narrow to: the scope, or the `tenant` asked for (which must exist).

        `requested` defaults to the `tenant` query parameter. A scoped caller asking for
        another tenant gets the not-found an unknown one gets.
        """
        if requested is None and from_query:
            requested = self.query("tenant")
        if requested is None:
            return self.scope
        scope = self.scope
        return await self.api.read(lambda c: require_tenant(c, requested, scope=scope))

    def unscoped_only(self, what: str) -> None:
        if self.scope is not None:
            raise ApiError(403, f"a tenant-scoped token cannot {what}; use an unscoped token")

    def query(self, name: str) -> str | None:
        value = self.request.query_params.get(name)
        if value and "\x00" in value:
            # PostgreSQL cannot hold a NUL anywhere: refused for every route, not only
            # those whose parameters go through a model.
            raise InputError(f"{name}: contains a NUL: remove it")
        return value if value not in (None, "") else None

    def query_as(self, model: type[M]) -> M:
        """The query string as `model` (shared with the CLI: delivery.operator.validation).

        Parameters the model does not know are left alone: `tenant`, for one, is
        resolved against the database by `tenant()`.
        """
        data = {}
        for name in model.model_fields:
            value = self.query(name)
            if value is not None:
                data[name] = value
        return parse(model, data)

    def query_int(self, name: str, default: int | None = None) -> int | None:
        """One integer query parameter, as strict as the models (no `1.5`, no full-width)."""
        value = self.query(name)
        return default if value is None else integer_value(name, value)

    def query_flag(self, name: str) -> bool | None:
        """true/false, 1/0, yes/no, or None when absent; anything else is refused."""
        value = self.query(name)
        return None if value is None else flag_value(name, value)

    def query_time(self, name: str) -> dt.datetime | None:
        value = self.query(name)
        return None if value is None else time_value(name, value)

    def path_int(self, name: str) -> int:
        return integer_value(name, self.request.path_params[name], ge=1)

    def path_id(self) -> int:
        return parse(DeliveryRef, {"id": self.request.path_params["id"]}).id

    def path_uid(self) -> str:
        return parse(EndpointRef, {"uid": self.request.path_params["uid"]}).uid

    async def body(self) -> dict[str, Any]:
        if self._body is None:
            raw = await read_capped_body(self.request, self.api.config.max_body_bytes)
            try:
                self._body = json.loads(raw) if raw.strip() else {}
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc
            except RecursionError as exc:
                raise ApiError(400, "the request body nests too deeply") from exc
            if not isinstance(self._body, dict):
                raise ApiError(400, "the request body must be a JSON object")
            where = nul_in(self._body)
            if where is not None:
                raise InputError(f"{where}: contains a NUL: remove it")
        return dict(self._body)

    async def body_as(self, model: type[M]) -> M:
        return parse(model, await self.body())


async def read_capped_body(request: Request, limit: int) -> bytes:
    """The body, or 413 as soon as it is known to be over `limit` (the rest is never read).

    A Content-Length over the limit is refused before a byte of the body is read; a
    chunked body is refused at the first chunk that passes it.
    """
    too_big = ApiError(
        413,
        f"the request body is over {limit} bytes (OUTBOX_ADMIN_MAX_BODY_BYTES); "
        "send less, e.g. replay by filter instead of listing ids",
    )
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


Handler = Callable[[Call], Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    description: str
    kind: str = "string"  # OpenAPI type
    where: str = "query"


@dataclass(frozen=True, slots=True)
class Operation:
    method: str
    path: str
    role: Role | None  # None: no token needed
    summary: str
    handler: Handler
    params: tuple[Param, ...] = ()
    body: dict[str, Any] | None = None  # JSON schema of the request body
    raw: bool = False  # the handler returns a Response itself


# -- handlers ---------------------------------------------------------------------------


async def list_deliveries(call: Call) -> Any:
    flt = call.query_as(DeliverySearch).to_filter(tenant=await call.tenant())
    items = await call.api.read(lambda c: ops.search_deliveries(c, flt))
    return {
        "items": [item.as_json() for item in items],
        "next_before": items[-1].id if len(items) == flt.limit else None,
    }


async def show_delivery(call: Call) -> Any:
    delivery_id, scope = call.path_id(), call.scope
    return (await call.api.read(lambda c: ops.get_delivery(c, delivery_id, scope=scope))).as_json()


async def replay_one(call: Call) -> Any:
    delivery_id, data = call.path_id(), await call.body_as(ReplayOne)
    now = call.api.clock.now()
    result = await call.api.write(
        lambda c: ops.replay(
            c,
            [delivery_id],
            actor=call.actor,
            reason=data.reason,
            now=now,
            force=data.force,
            again=data.again,
            request_id=call.request_id,
            scope=call.scope,
        )
    )
    return result.as_json()


async def replay_many(call: Call) -> Any:
    data = await call.body_as(ReplayMany)
    now = call.api.clock.now()
    rate = data.rate_per_minute or call.api.config.replay_rate_per_minute
    if data.ids and data.filter is not None:
        raise ApiError(400, 'give "ids" or "filter", not both')
    if data.ids:
        ids = data.ids
        result = await call.api.write(
            lambda c: ops.replay(
                c,
                ids,
                actor=call.actor,
                reason=data.reason,
                now=now,
                force=data.force,
                again=data.again,
                rate_per_minute=rate,
                request_id=call.request_id,
                scope=call.scope,
            )
        )
        return result.as_json()
    criteria = data.filter or ReplayFilter()
    tenant = await call.tenant(criteria.tenant, from_query=False)
    flt = criteria.to_filter(tenant=tenant)
    result = await call.api.write(
        lambda c: ops.bulk_replay(
            c,
            flt,
            actor=call.actor,
            reason=data.reason,
            now=now,
            dry_run=data.dry_run,
            force=data.force,
            max_count=data.max_count,
            rate_per_minute=rate,
            request_id=call.request_id,
        )
    )
    return result.as_json()


async def discard_one(call: Call) -> Any:
    delivery_id, data = call.path_id(), await call.body_as(DiscardOne)
    return await _discard(call, [delivery_id], data.reason)


async def discard_many(call: Call) -> Any:
    data = await call.body_as(DiscardMany)
    return await _discard(call, data.ids, data.reason)


async def _discard(call: Call, ids: list[int], reason: str | None) -> Any:
    now = call.api.clock.now()
    done = await call.api.write(
        lambda c: ops.discard(
            c,
            ids,
            actor=call.actor,
            reason=reason,
            now=now,
            request_id=call.request_id,
            scope=call.scope,
        )
    )
    return {"discarded": done}


def _endpoint_json(health: EndpointHealth | None, data: dict[str, Any]) -> dict[str, Any]:
    """The endpoint, its recent health and its breaker: the same block `outbox stats` shows.

    The breaker sits beside `health` (not inside it) because it is the first thing an
    operator looks for, and it is the very dict `/v1/stats` reports for that endpoint.
    """
    if health is not None:
        stats = health.as_json()
        data["breaker"] = stats.pop("breaker")
        data["health"] = {k: v for k, v in stats.items() if k not in ("uid", "url", "enabled")}
    return data


async def list_endpoints_route(call: Call) -> Any:
    """The tenant's endpoints in `items`; those receiving every tenant's events apart."""
    now, tenant = call.api.clock.now(), await call.tenant()

    def read(conn: Connection) -> list[dict[str, Any]]:
        stats = collect_stats(conn, now=now, window=call.api.config.stats_window, scope=tenant)
        health = {item.uid: item for item in stats.endpoints}
        return [
            _endpoint_json(health.get(e.uid), e.as_json())
            for e in list_endpoints(conn, scope=tenant)
        ]

    found = await call.api.read(read)
    return {
        "items": [e for e in found if not e["all_tenants"]],
        "all_tenants": [e for e in found if e["all_tenants"]],
    }


async def create_endpoint_route(call: Call) -> Any:
    data = await call.body_as(EndpointCreate)
    all_tenants = data.all_tenants
    if all_tenants:
        call.unscoped_only("create an endpoint that receives every tenant's events")
    owner = await call.tenant(data.tenant, from_query=False) or DEFAULT_TENANT

    def create(conn: Connection) -> dict[str, Any]:
        created = ops.add_endpoint(
            conn,
            call.api.box,
            actor=call.actor,
            url=data.url,
            event_types=data.event_types,
            secret=data.secret,
            description=data.description,
            request_id=call.request_id,
            https_only=call.api.config.https_only,
            signature=data.signature,
            tenant=owner,
            all_tenants=all_tenants,
        )
        if data.proxy is not None:
            endpoint = set_proxy(
                conn,
                call.api.box,
                created.endpoint.uid,
                data.proxy,
                actor=call.actor,
                request_id=call.request_id,
            )
            created = dataclasses.replace(created, endpoint=endpoint)
        # An ed25519 endpoint's answer holds its whpk_ public key (in the endpoint), no secret.
        secret = (
            {} if created.endpoint.signature_scheme == "ed25519" else {"secret": created.secret}
        )
        return {**created.endpoint.as_json(), **secret}

    answer = await call.api.write(create)
    return {**answer, "warnings": await call.api.address_warnings(answer["url"])}


async def update_endpoint_route(call: Call) -> Any:
    uid, data = call.path_uid(), await call.body_as(EndpointUpdate)

    def update(c: Connection) -> Endpoint:
        proxy_given = "proxy" in data.model_fields_set
        if data.changes_fields or not proxy_given:
            item = ops.update_endpoint(
                c,
                uid,
                actor=call.actor,
                url=data.url,
                description=data.description,
                event_types=data.event_types,
                timeout_seconds=data.timeout_seconds,
                max_attempts=data.max_attempts,
                reason=data.reason,
                request_id=call.request_id,
                https_only=call.api.config.https_only,
                scope=call.scope,
            )
        if proxy_given:
            item = set_proxy(
                c,
                call.api.box,
                uid,
                data.proxy,
                actor=call.actor,
                reason=data.reason,
                request_id=call.request_id,
                scope=call.scope,
            )
        return item

    updated = await call.api.write(update)
    warnings = await call.api.address_warnings(updated.url) if data.url is not None else []
    return {**updated.as_json(), "warnings": warnings}


async def _set_enabled(call: Call, enabled: bool) -> Any:
    uid, data = call.path_uid(), await call.body_as(EndpointAction)

    def change(conn: Connection) -> dict[str, Any]:
        item = set_enabled(
            conn,
            uid,
            enabled=enabled,
            reason=data.reason,
            actor=call.actor,
            request_id=call.request_id,
            scope=call.scope,
        )
        return item.as_json()

    return await call.api.write(change)


async def enable_endpoint(call: Call) -> Any:
    return await _set_enabled(call, True)


async def disable_endpoint(call: Call) -> Any:
    return await _set_enabled(call, False)


async def rotate_endpoint_secret(call: Call) -> Any:
    uid, data = call.path_uid(), await call.body_as(RotateSecret)
    grace = (
        dt.timedelta(seconds=data.grace_seconds)
        if data.grace_seconds is not None
        else call.api.config.default_rotation_grace
    )
    now = call.api.clock.now()
    rotated = await call.api.write(
        lambda c: ops.rotate_secret(
            c,
            call.api.box,
            uid,
            actor=call.actor,
            now=now,
            grace=grace,
            secret=data.secret,
            reason=data.reason,
            request_id=call.request_id,
            signature=data.signature,
            scope=call.scope,
        )
    )
    ed25519 = rotated.endpoint.signature_scheme == "ed25519"
    return {
        **rotated.endpoint.as_json(),
        **({} if ed25519 else {"secret": rotated.secret}),
        "previous_secret_expires_at": rotated.previous_expires_at.isoformat(),
    }


async def delete_endpoint_route(call: Call) -> Any:
    uid = call.path_uid()
    query = call.query_as(EndpointDelete)
    force, reason = query.force, query.reason

    scope = call.scope

    def delete(conn: Connection) -> dict[str, Any]:
        get_endpoint(conn, uid, scope=scope)
        return ops.delete_endpoint(
            conn,
            uid,
            actor=call.actor,
            reason=reason,
            force=force,
            request_id=call.request_id,
            scope=scope,
        )

    return {"deleted": uid, **(await call.api.write(delete))}


async def stats_route(call: Call) -> Any:
    seconds = call.query_as(StatsQuery).window
    window = dt.timedelta(seconds=seconds) if seconds else call.api.config.stats_window
    now, tenant = call.api.clock.now(), await call.tenant()
    thresholds = call.api.config.thresholds
    stats = await call.api.read(
        lambda c: collect_stats(c, now=now, window=window, thresholds=thresholds, scope=tenant)
    )
    return {"tenant": tenant, **stats.as_json()}


async def audit_route(call: Call) -> Any:
    query = call.query_as(AuditQuery)
    tenant = await call.tenant()
    entries = await call.api.read(
        lambda c: ops.list_audit(
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


async def create_portal_link(call: Call) -> Any:
    """A single-use link into one tenant's portal (console/sessions.py); audited."""
    tenant = str(call.request.path_params["tenant"])
    ttl = (await call.body()).get("ttl_seconds", 900)
    if isinstance(ttl, bool) or not isinstance(ttl, int):
        raise ApiError(400, "ttl_seconds must be a whole number of seconds, e.g. 900")
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


async def metrics_route(call: Call) -> Any:
    """Every figure for the installation, or one tenant's (a scoped token, or ?tenant=).

    No series gets a tenant label: with thousands of tenants that would multiply the
    series count by the tenant count. Per-tenant numbers are a scrape per tenant (a
    scoped token, or `?tenant=`); the tenant count by state is the one tenant gauge.
    """
    now, tenant = call.api.clock.now(), await call.tenant()
    config = call.api.config

    def read(conn: Connection) -> bytes:
        stats = collect_stats(
            conn, now=now, window=config.stats_window, thresholds=config.thresholds, scope=tenant
        )
        totals = read_totals(conn, ops.LATENCY_BUCKETS, scope=tenant)
        counts = None if tenant is not None else tenant_ops.count_tenants(conn)
        return render_metrics(totals, stats, tenants=counts)

    body = await call.api.read(read)
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


# -- tenants and tokens ---------------------------------------------------------------


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
            reason=data.get("reason"),
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
            reason=data.get("reason"),
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


async def list_tokens_route(call: Call) -> Any:
    scope = call.scope
    found = await call.api.read(lambda c: list_tokens(c, scope=scope))
    return {"items": [t.as_json() for t in found]}


async def create_token_route(call: Call) -> Any:
    """A scoped operator may create tokens of its own tenant only (and no unscoped ones)."""
    data = await call.body()
    tenant = data.get("tenant")
    seconds = data.get("expires_in_seconds")
    if seconds is not None and (
        isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0
    ):
        raise ApiError(400, "expires_in_seconds must be a number of seconds above 0")
    expires_in = None
    if seconds is not None:
        if seconds > MAX_TOKEN_LIFETIME.total_seconds():
            raise ApiError(400, "expires_in_seconds must be at most 3650 days (315360000)")
        expires_in = dt.timedelta(seconds=seconds)
    now = call.api.clock.now()

    def create(conn: Connection) -> dict[str, Any]:
        info, secret = create_token(
            conn,
            name=str(data.get("name") or ""),
            role=str(data.get("role") or ""),
            actor=call.actor,
            tenant=tenant,
            scope=call.scope,
            request_id=call.request_id,
            expires_in=expires_in,
            now=now,
        )
        return {**info.as_json(), "token": secret}

    return await call.api.write(create)


async def revoke_token_route(call: Call) -> Any:
    """By name or token id; a scoped caller can revoke its own tenant's tokens only."""
    name, now, scope = str(call.request.path_params["token"]), call.api.clock.now(), call.scope
    revoked = await call.api.write(
        lambda c: revoke_token(c, name, actor=call.actor, now=now, scope=scope)
    )
    return {"revoked": revoked}


async def healthz(call: Call) -> Any:
    return {"status": "ok"}


async def readyz(call: Call) -> Any:
    def check(conn: Connection) -> str | None:
        conn.execute(text("SELECT 1"))
        context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        return context.get_current_revision()

    release = {"version": release_version(), "needs": call.api.head}
    try:
        revision = await call.api.read(check)
    except Exception as exc:
        log.warning("readiness check failed: %s", exc)
        return JSONResponse(
            {"status": "unavailable", "error": "database unreachable", **release}, 503
        )
    state = schema_state(revision)
    if not state.usable:
        return JSONResponse(
            {
                "status": "unavailable",
                "error": f"schema at {revision}, needs {call.api.head}: run `outbox migrate`",
                "schema": revision,
                **release,
            },
            503,
        )
    # "newer": a later release migrated it, which this one runs on (docs/operating.md, Upgrading).
    return {"status": "ready", "schema": revision, "schema_state": state.state, **release}


async def openapi_route(call: Call) -> Any:
    return openapi_document()


_ID = Param("id", "Delivery id.", "integer", "path")
_TENANT = Param("tenant", "Tenant id (the application's customer id).", where="path")
_TENANT_FILTER = Param(
    "tenant", "Only this tenant's (a tenant-scoped token is always confined to its own)."
)
_UID = Param("uid", "Endpoint id (ep_...).", where="path")
_PROXY = {
    "type": "string",
    "description": (
        "The endpoint's own egress proxy, http://user:password@host:port; stored encrypted, "
        "shown as host:port only (null removes it)."
    ),
}
_REASON = {"reason": {"type": "string", "description": "Why; goes in the audit log."}}
_FILTER_PARAMS = (
    Param("state", "Comma-separated states: scheduled, in_flight, succeeded, dead, discarded."),
    Param("endpoint", "Endpoint id."),
    Param("event_type", "Exact event type."),
    Param("error", "Text contained in the last error or any attempt's error (any case)."),
    Param("message_id", "The event's message id (the webhook-id header), e.g. msg_..."),
    Param("since", "Created at or after (ISO 8601)."),
    Param("until", "Created before (ISO 8601)."),
    Param("before", "Paging: only ids below this (pass next_before).", "integer"),
    Param("limit", "Page size, 1..1000 (default 50).", "integer"),
    _TENANT_FILTER,
)
_FILTER_SCHEMA = {
    "type": "object",
    "properties": {
        "tenant": {"type": "string"},
        "state": {"type": "array", "items": {"type": "string"}},
        "endpoint": {"type": "string"},
        "event_type": {"type": "string"},
        "error": {"type": "string"},
        "message_id": {"type": "string"},
        "since": {"type": "string", "format": "date-time"},
        "until": {"type": "string", "format": "date-time"},
    },
}

ROUTES: tuple[Operation, ...] = (
    Operation("GET", "/healthz", None, "The process is alive.", healthz),
    Operation(
        "GET",
        "/readyz",
        None,
        "The database is reachable and migrated: this release's version, the schema "
        "revision it needs and the database's.",
        readyz,
    ),
    Operation("GET", "/openapi.json", None, "This document.", openapi_route),
    Operation(
        "GET",
        "/metrics",
        "viewer",
        "Prometheus metrics (one tenant's with a scoped token or ?tenant=).",
        metrics_route,
        (_TENANT_FILTER,),
        raw=True,
    ),
    Operation(
        "GET", "/v1/deliveries", "viewer", "Search deliveries.", list_deliveries, _FILTER_PARAMS
    ),
    Operation(
        "GET",
        "/v1/deliveries/{id}",
        "viewer",
        "A delivery with its event, attempt history and replays.",
        show_delivery,
        (_ID,),
    ),
    Operation(
        "POST",
        "/v1/deliveries/{id}/replay",
        "operator",
        "Replay one delivery as a new delivery (same webhook-id).",
        replay_one,
        (_ID,),
        {
            "type": "object",
            "required": ["reason"],
            "properties": {
                **_REASON,
                "force": {"type": "boolean"},
                "again": {"type": "boolean", "description": "Replay it even if replayed before."},
            },
        },
    ),
    Operation(
        "POST",
        "/v1/replays",
        "operator",
        "Replay listed ids, or what a filter matches (dead by default), rate-capped.",
        replay_many,
        (),
        {
            "type": "object",
            "required": ["reason"],
            "properties": {
                **_REASON,
                "ids": {"type": "array", "items": {"type": "integer"}},
                "filter": _FILTER_SCHEMA,
                "dry_run": {"type": "boolean"},
                "force": {"type": "boolean"},
                "again": {"type": "boolean", "description": "With ids: replay them once more."},
                "max_count": {"type": "integer"},
                "rate_per_minute": {"type": "number"},
            },
        },
    ),
    Operation(
        "POST",
        "/v1/deliveries/{id}/discard",
        "operator",
        "Discard a scheduled or dead delivery.",
        discard_one,
        (_ID,),
        {"type": "object", "required": ["reason"], "properties": _REASON},
    ),
    Operation(
        "POST",
        "/v1/discards",
        "operator",
        "Discard several deliveries (all or nothing).",
        discard_many,
        (),
        {
            "type": "object",
            "required": ["ids", "reason"],
            "properties": {**_REASON, "ids": {"type": "array", "items": {"type": "integer"}}},
        },
    ),
    Operation(
        "GET",
        "/v1/endpoints",
        "viewer",
        "Endpoints with their recent success rate, latency, backlog and circuit breaker; "
        "all-tenants endpoints listed apart.",
        list_endpoints_route,
        (_TENANT_FILTER,),
    ),
    Operation(
        "POST",
        "/v1/endpoints",
        "operator",
        "Add an endpoint; the answer holds its secret, shown only once.",
        create_endpoint_route,
        (),
        {
            "type": "object",
            "required": ["url", "event_types"],
            "properties": {
                "url": {"type": "string"},
                "event_types": {"type": "array", "items": {"type": "string"}},
                "description": {"type": "string"},
                "secret": {"type": "string"},
                "signature": {"enum": ["hmac", "ed25519"]},
                "tenant": {"type": "string", "description": "Owner (default: the default)."},
                "all_tenants": {"type": "boolean", "description": "Receive every tenant's."},
                "proxy": _PROXY,
            },
        },
    ),
    Operation(
        "PATCH",
        "/v1/endpoints/{uid}",
        "operator",
        "Change an endpoint's URL, events, description, timeout or max attempts.",
        update_endpoint_route,
        (_UID,),
        {
            "type": "object",
            "properties": {
                **_REASON,
                "url": {"type": "string"},
                "event_types": {"type": "array", "items": {"type": "string"}},
                "description": {"type": "string"},
                "timeout_seconds": {"type": "number"},
                "max_attempts": {"type": "integer"},
                "proxy": {**_PROXY, "type": ["string", "null"]},
            },
        },
    ),
    Operation(
        "DELETE",
        "/v1/endpoints/{uid}",
        "operator",
        "Delete an endpoint and its history (refused while deliveries are pending).",
        delete_endpoint_route,
        (_UID, Param("reason", "Why (required)."), Param("force", "Delete pending ones too.")),
    ),
    Operation(
        "POST",
        "/v1/endpoints/{uid}/enable",
        "operator",
        "Enable an endpoint.",
        enable_endpoint,
        (_UID,),
    ),
    Operation(
        "POST",
        "/v1/endpoints/{uid}/disable",
        "operator",
        "Disable an endpoint; its deliveries wait.",
        disable_endpoint,
        (_UID,),
        {"type": "object", "required": ["reason"], "properties": _REASON},
    ),
    Operation(
        "POST",
        "/v1/endpoints/{uid}/rotate-secret",
        "operator",
        "New signing secret; the old one also signs until the grace period ends.",
        rotate_endpoint_secret,
        (_UID,),
        {
            "type": "object",
            "properties": {
                **_REASON,
                "grace_seconds": {"type": "number"},
                "secret": {"type": "string"},
                "signature": {"enum": ["hmac", "ed25519"]},
            },
        },
    ),
    Operation(
        "GET",
        "/v1/stats",
        "viewer",
        "Backlog, lag, rates, per-endpoint health, top errors and alert signals.",
        stats_route,
        (Param("window", "Window in seconds (default from settings).", "integer"), _TENANT_FILTER),
    ),
    Operation(
        "POST",
        "/v1/tenants/{tenant}/portal-links",
        "operator",
        "A single-use, short-lived link that opens the tenant's portal (audited).",
        create_portal_link,
        (Param("tenant", "Tenant id.", where="path"),),
        {
            "type": "object",
            "properties": {
                "ttl_seconds": {
                    "type": "integer",
                    "description": "How long the link works (default 900, at most 7 days).",
                }
            },
        },
    ),
    Operation(
        "GET",
        "/v1/audit",
        "viewer",
        "The audit log, newest first.",
        audit_route,
        (
            Param("actor", "Exact actor."),
            Param("action", "Action or prefix (delivery, endpoint.update, api.refused)."),
            Param("target", "Target id."),
            Param("since", "At or after (ISO 8601)."),
            Param("before", "Paging: only ids below this.", "integer"),
            Param("limit", "Page size (default 50).", "integer"),
            _TENANT_FILTER,
        ),
    ),
    Operation(
        "GET",
        "/v1/tenants",
        "viewer",
        "Tenants in id order (a scoped token sees its own).",
        list_tenants_route,
        (
            Param("after", "Paging: only ids after this (pass next_after)."),
            Param("enabled", "true or false."),
            Param("limit", "Page size, 1..1000 (default 100).", "integer"),
        ),
    ),
    Operation(
        "POST",
        "/v1/tenants",
        "operator",
        "Create a tenant (unscoped tokens only).",
        create_tenant_route,
        (),
        {
            "type": "object",
            "required": ["id"],
            "properties": {
                "id": {"type": "string"},
                "name": {"type": "string"},
                "metadata": {"type": "object"},
                "max_in_flight": {"type": "integer"},
                "max_per_second": {"type": "number"},
            },
        },
    ),
    Operation(
        "GET",
        "/v1/tenants/{tenant}",
        "viewer",
        "A tenant with its endpoint, event, delivery and token counts.",
        show_tenant_route,
        (_TENANT,),
    ),
    Operation(
        "PATCH",
        "/v1/tenants/{tenant}",
        "operator",
        "Change a tenant's name, metadata or caps (0 or null: no limit).",
        update_tenant_route,
        (_TENANT,),
        {
            "type": "object",
            "properties": {
                **_REASON,
                "name": {"type": "string"},
                "metadata": {"type": "object"},
                "max_in_flight": {"type": ["integer", "null"]},
                "max_per_second": {"type": ["number", "null"]},
            },
        },
    ),
    Operation(
        "POST",
        "/v1/tenants/{tenant}/disable",
        "operator",
        "Disable a tenant: its deliveries are held (nothing is dropped) until enabled.",
        disable_tenant_route,
        (_TENANT,),
        {"type": "object", "required": ["reason"], "properties": _REASON},
    ),
    Operation(
        "POST",
        "/v1/tenants/{tenant}/enable",
        "operator",
        "Enable a tenant; its held deliveries resume.",
        enable_tenant_route,
        (_TENANT,),
    ),
    Operation(
        "DELETE",
        "/v1/tenants/{tenant}",
        "operator",
        "Delete a tenant, its endpoints and history, revoking its tokens "
        "(refused while anything is pending).",
        delete_tenant_route,
        (_TENANT, Param("reason", "Why (required)."), Param("force", "Delete pending ones too.")),
    ),
    Operation(
        "GET",
        "/v1/tokens",
        "operator",
        "Active tokens, never their secrets (a scoped token sees its tenant's).",
        list_tokens_route,
    ),
    Operation(
        "POST",
        "/v1/tokens",
        "operator",
        "Create a token, optionally confined to a tenant; the answer holds it, shown once.",
        create_token_route,
        (),
        {
            "type": "object",
            "required": ["name", "role"],
            "properties": {
                "name": {"type": "string"},
                "role": {"type": "string", "enum": ["viewer", "operator"]},
                "tenant": {"type": "string"},
                "expires_in_seconds": {"type": "number", "exclusiveMinimum": 0},
            },
        },
    ),
    Operation(
        "DELETE",
        "/v1/tokens/{token}",
        "operator",
        "Revoke a token by name or token id; it stops working at once, and so do the "
        "console sessions it opened.",
        revoke_token_route,
        (Param("token", "Token name or token id.", where="path"),),
    ),
)


def all_routes() -> tuple[Operation, ...]:
    """ROUTES plus the routes kept in modules of their own (they import this module)."""
    from delivery.operator.api_contract import CONTRACT_ROUTES

    return (*ROUTES, *CONTRACT_ROUTES)


def openapi_document() -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for op in all_routes():
        spec: dict[str, Any] = {
            "summary": op.summary,
            "operationId": f"{op.method.lower()}_{op.handler.__name__}",
            "parameters": [
                {
                    "name": p.name,
                    "in": p.where,
                    "required": p.where == "path",
                    "description": p.description,
                    "schema": {"type": p.kind},
                }
                for p in op.params
            ],
            "responses": {
                "200": {"description": "OK"},
                "400": {"description": "Refused: the error message says why"},
            },
        }
        if op.role is not None:
            spec["security"] = [{"bearer": []}]
            spec["x-required-role"] = op.role
            spec["responses"]["401"] = {"description": "No valid bearer token"}
            spec["responses"]["403"] = {"description": f"Needs the {op.role} role"}
            spec["responses"]["429"] = {
                "description": "Too many calls without a valid token; see Retry-After"
            }
        if op.body is not None:
            spec["responses"]["413"] = {"description": "Body over OUTBOX_ADMIN_MAX_BODY_BYTES"}
            spec["requestBody"] = {
                "required": bool(op.body.get("required")),
                "content": {"application/json": {"schema": op.body}},
            }
        paths.setdefault(op.path, {})[op.method.lower()] = spec
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "webhook-outbox admin API",
            "version": "1",
            "description": "Viewer tokens read; operator tokens also act. A token confined "
            "to a tenant sees and acts on that tenant's objects only; any other tenant's "
            "object answers 404. Create tokens with "
            "`outbox tokens create NAME --role viewer|operator [--tenant T]`.",
        },
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": paths,
    }


# -- the application --------------------------------------------------------------------


class AdminApi:
    """Shared state of one app: engine, secret box, clock and settings."""

    def __init__(
        self,
        engine: AsyncEngine,
        box: SecretBox,
        *,
        clock: Clock | None = None,
        config: AdminConfig | None = None,
    ) -> None:
        self.engine = engine
        self.box = box
        self.clock = clock or SystemClock()
        self.config = config or AdminConfig()
        self.limiter = UnauthenticatedLimiter(self.config.unauthenticated_per_minute)
        self.head = head_revision()

    async def address_warnings(self, url: str) -> list[str]:
        """What the SSRF guard will refuse about `url` today (advice; nothing is refused)."""
        warning = await refusal_warning(AddressPolicy(self.config.allowed_networks), url)
        return [warning] if warning else []

    async def read(self, func: Callable[[Connection], T]) -> T:
        async with self.engine.connect() as conn:
            return await conn.run_sync(func)

    async def write(self, func: Callable[[Connection], T]) -> T:
        """Run `func` in one transaction: the change and its audit row commit together."""
        async with self.engine.begin() as conn:
            return await conn.run_sync(func)

    async def authorize(self, call: Call, needed: Role) -> Response | None:
        """None when allowed; otherwise the 401/403/429 answer (see delivery.operator.refusals).

        401 and 403 are audited, aggregated per client and reason; a client without a
        valid token past its rate limit gets 429 and costs no write at all.
        """
        header = call.request.headers.get("authorization", "")
        scheme, _, presented = header.partition(" ")
        now = self.clock.now()
        principal = None
        if scheme.lower() == "bearer" and presented:
            try:
                principal = await self.write(lambda c: authenticate(c, presented, now=now))
            except TokenRefusedError as exc:
                await self._refuse(call, 401, str(exc), "anonymous")
                return JSONResponse(
                    {"error": str(exc)}, 401, headers={"www-authenticate": "Bearer"}
                )
        if principal is None:
            wait = self.limiter.take(client_address(call.request) or "unknown", now)
            if wait is not None:
                return JSONResponse(
                    {"error": f"{RATE_LIMITED}; try again in {wait:.0f}s with a valid token"},
                    429,
                    headers={"retry-after": f"{wait:.0f}"},
                )
            why = "no bearer token" if not header else "invalid or revoked bearer token"
            await self._refuse(call, 401, why, "anonymous")
            return JSONResponse(
                {"error": f"{why}: send 'Authorization: Bearer obx_...' "
                 "(create one with `outbox tokens create`)"},
                401,
                headers={"www-authenticate": "Bearer"},
            )  # fmt: skip
        call.principal = principal
        if not role_allows(principal.role, needed):
            why = f"role {principal.role} cannot do this; it needs {needed}"
            await self._refuse(call, 403, why, principal.actor, principal.tenant)
            return JSONResponse({"error": why}, 403)
        return None

    async def _refuse(
        self, call: Call, status: int, why: str, actor: str, tenant: str | None = None
    ) -> None:
        client = client_address(call.request)
        # The client's 429s so far ride along with its next written 401.
        limited = self.limiter.limited_since_written(client or "unknown") if status == 401 else 0
        await self.record_refused(
            call.request,
            request_id=call.request_id,
            status=status,
            why=why,
            actor=actor,
            tenant=tenant,
            limited=limited,
        )

    async def record_refused(
        self,
        request: Request,
        *,
        request_id: str,
        status: int,
        why: str,
        actor: str,
        tenant: str | None = None,
        limited: int = 0,
    ) -> None:
        """Audit one refused request, plus `limited` earlier 429s of the same client, in the
        aggregated rows of delivery.operator.refusals (the API's and the console's sign-in)."""
        client = client_address(request)
        now = self.clock.now()

        def audit(conn: Connection) -> None:
            for code, reason, count in ((status, why, 1), (429, RATE_LIMITED, limited)):
                if count:
                    record_refusal(
                        conn,
                        now=now,
                        interval=self.config.refused_interval,
                        actor=actor,
                        client=client,
                        status=code,
                        reason=reason,
                        method=request.method,
                        path=request.url.path,
                        user_agent=request.headers.get("user-agent"),
                        request_id=request_id,
                        count=count,
                        tenant=tenant,
                    )

        await self.write(audit)

    def endpoint(self, op: Operation) -> Callable[[Request], Awaitable[Response]]:
        async def dispatch(request: Request) -> Response:
            incoming = request.headers.get(REQUEST_ID_HEADER, "")
            request_id = incoming if _SAFE_REQUEST_ID.match(incoming) else uuid.uuid4().hex
            call = Call(request=request, request_id=request_id, principal=None, api=self)
            response = await self._answer(call, op)
            response.headers[REQUEST_ID_HEADER] = request_id
            return response

        return dispatch

    async def _answer(self, call: Call, op: Operation) -> Response:
        needed = op.role
        if op.path == "/metrics" and self.config.metrics_public:
            needed = None
        if needed is not None:
            refused = await self.authorize(call, needed)
            if refused is not None:
                return refused
        try:
            result = await op.handler(call)
        except ApiError as exc:
            if exc.status == 403:  # a scoped token beyond its scope: refused like a role
                await self._refuse(call, 403, exc.message, call.actor, call.scope)
            return JSONResponse({"error": exc.message}, exc.status)
        except NotFoundError as exc:
            return JSONResponse({"error": str(exc)}, 404)
        except (OutboxError, ValueError, TypeError) as exc:
            # Refused input such as a wrong JSON type (the transaction rolled back): say
            # why, never a stack trace.
            return JSONResponse({"error": str(exc) or type(exc).__name__}, 400)
        if isinstance(result, Response):
            return result
        return JSONResponse(json.loads(json.dumps(result, default=str)))

    def routes(self) -> list[Route]:
        grouped: dict[str, list[Operation]] = {}
        for op in all_routes():
            grouped.setdefault(op.path, []).append(op)
        routes = []
        for path, ops_for_path in grouped.items():
            by_method = {op.method: self.endpoint(op) for op in ops_for_path}
            routes.append(Route(path, _by_method(by_method), methods=list(by_method)))
        return routes


def _by_method(
    handlers: dict[str, Callable[[Request], Awaitable[Response]]],
) -> Callable[[Request], Awaitable[Response]]:
    async def route(request: Request) -> Response:
        return await handlers[request.method](request)

    return route


def create_app(
    engine: AsyncEngine,
    box: SecretBox,
    *,
    clock: Clock | None = None,
    config: AdminConfig | None = None,
) -> Starlette:
    api = AdminApi(engine, box, clock=clock, config=config)
    app = Starlette(routes=[*api.routes(), *Console(api, api.config.console).routes()])
    app.state.api = api
    return app


def forwarded_options(trusted_proxies: Sequence[str]) -> dict[str, Any]:
    """uvicorn's proxy options for OUTBOX_TRUSTED_PROXIES, always explicit.

    Left out, uvicorn believes X-Forwarded-For from 127.0.0.1 and ::1 (or whatever
    FORWARDED_ALLOW_IPS says); with no trusted proxy it reads no forwarded header at all.
    """
    trusted = list(trusted_proxies)
    return {"proxy_headers": bool(trusted), "forwarded_allow_ips": trusted}


def _admin_config(app: Starlette) -> AdminConfig:
    api = getattr(app.state, "api", None)
    return api.config if isinstance(api, AdminApi) else AdminConfig()


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its own signal handling: the host process owns SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(
    app: Starlette,
    *,
    host: str,
    port: int,
    stop: asyncio.Event,
    on_started: Callable[[int], None] | None = None,
    sock: socket.socket | None = None,
) -> None:
    """Serve `app` until `stop` is set; `on_started` gets the bound port (port 0 picks one).

    `sock`, already bound, is served instead of binding host:port here: the CLI binds
    it before anything else starts, so a busy port is reported first.

    X-Forwarded-For and X-Forwarded-Proto are honoured only from the app's trusted
    proxies (AdminConfig.trusted_proxies), and then the client is the rightmost address
    that is not itself a trusted proxy. uvicorn would otherwise trust them from any
    loopback peer (its default), letting a local client pick the address it is rate
    limited and audited under.
    """
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        lifespan="off",
        **forwarded_options(_admin_config(app).trusted_proxies),
    )
    server = _EmbeddedServer(config)
    task = asyncio.create_task(server.serve(sockets=None if sock is None else [sock]))
    try:
        while not server.started:
            if task.done():
                await task  # surfaces the bind error
                raise OSError(f"the admin API could not listen on {host}:{port}")
            await asyncio.sleep(0.01)
        if on_started is not None:
            bound = server.servers[0].sockets[0].getsockname()[1]
            on_started(int(bound))
        await stop.wait()
    finally:
        server.should_exit = True
        await task
