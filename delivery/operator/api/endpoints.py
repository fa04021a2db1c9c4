"""Endpoints: list with their health and breaker, add, change, enable and disable, rotate
the signing secret, delete. Every change is audited in its own transaction."""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

from sqlalchemy import Connection

from delivery.operator.api.core import Call, Operation, Param
from delivery.operator.api.feed import apply_feed_changes
from delivery.operator.validation import (
    EndpointAction,
    EndpointAuthUpdate,
    EndpointCreate,
    EndpointDelete,
    EndpointDisable,
    EndpointUpdate,
    FailurePolicy,
    RotateSecret,
)
from outbox import endpoints as endpoint_ops
from outbox.endpoint_auth import (
    EndpointAuth,
    check_client_certificate,
    check_oauth_client,
    get_endpoint_auth,
    set_endpoint_auth,
)
from outbox.endpoints import Endpoint, get_endpoint, list_endpoints, set_enabled, set_proxy
from outbox.errors import EndpointError
from outbox.stats import EndpointHealth, collect_stats
from outbox.tenants import DEFAULT_TENANT

UID = Param("uid", "Endpoint id (ep_...).")


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
        created = endpoint_ops.add_endpoint(
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
            delivery_mode=data.delivery_mode,
            payload_filter=data.payload_filter,
            concurrency=data.concurrency,
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
        feed = {} if created.feed_token is None else {"feed_token": created.feed_token}
        return {**created.endpoint.as_json(), **secret, **feed}

    answer = await call.api.write(create)
    return {**answer, "warnings": await call.api.address_warnings(answer["url"])}


async def update_endpoint_route(call: Call) -> Any:
    uid, data = call.path_uid(), await call.body_as(EndpointUpdate)

    feed_token: list[str] = []

    def update(c: Connection) -> Endpoint:
        proxy_given = "proxy" in data.model_fields_set
        feed_given = apply_feed_changes(c, call, uid, data, feed_token)
        if data.changes_fields or not (proxy_given or feed_given):
            item = endpoint_ops.update_endpoint(
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
        else:
            item = get_endpoint(c, uid, scope=call.scope)
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
    shown = {"feed_token": feed_token[0]} if feed_token else {}
    return {**updated.as_json(), **shown, "warnings": warnings}


async def _set_enabled(call: Call, enabled: bool) -> Any:
    model = EndpointAction if enabled else EndpointDisable
    uid, data = call.path_uid(), await call.body_as(model)

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
        lambda c: endpoint_ops.rotate_secret(
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
        return endpoint_ops.delete_endpoint(
            conn,
            uid,
            actor=call.actor,
            reason=reason,
            force=force,
            request_id=call.request_id,
            scope=scope,
        )

    return {"deleted": uid, **(await call.api.write(delete))}


async def set_failure_policy(call: Call) -> Any:
    """Hold on ambiguity, owner and operational owner of one endpoint (null clears)."""
    uid, data = call.path_uid(), await call.body_as(FailurePolicy)
    given = data.model_fields_set - {"reason"}

    def cleared(key: str) -> str | None:
        value = getattr(data, key)
        return ("" if value is None else value) if key in given else None

    item = await call.api.write(
        lambda c: endpoint_ops.set_failure_policy(
            c,
            uid,
            actor=call.actor,
            on_ambiguous=data.on_ambiguous if "on_ambiguous" in given else None,
            owner=cleared("owner"),
            operational_owner=cleared("operational_owner"),
            reason=data.reason,
            request_id=call.request_id,
            scope=call.scope,
        )
    )
    return item.as_json()


async def set_endpoint_auth_route(call: Call) -> Any:
    uid, data = call.path_uid(), await call.body_as(EndpointAuthUpdate)
    given = data.model_fields_set
    changes: dict[str, Any] = {}
    if ("client_certificate" in given) != ("client_key" in given) or (
        (data.client_certificate is None) != (data.client_key is None)
    ):
        raise EndpointError(
            "give client_certificate and client_key together (both null removes them)"
        )
    if "client_certificate" in given:
        if data.client_certificate is None or data.client_key is None:
            changes["client_certificate"] = None
        else:
            checked, summary = check_client_certificate(
                data.client_certificate, data.client_key, now=call.api.clock.now()
            )
            changes.update(client_certificate=checked, certificate_summary=summary)
    if "oauth" in given:
        if data.oauth is None:
            changes["oauth"] = None
        else:
            client, shown = check_oauth_client(
                data.oauth.token_url,
                data.oauth.client_id,
                data.oauth.client_secret,
                data.oauth.scope,
                https_only=call.api.config.https_only,
            )
            changes.update(oauth=client, oauth_summary=shown)

    def change(conn: Connection) -> EndpointAuth:
        if not changes:
            return get_endpoint_auth(conn, uid, scope=call.scope)
        return set_endpoint_auth(
            conn,
            call.api.box,
            uid,
            actor=call.actor,
            reason=data.reason,
            request_id=call.request_id,
            scope=call.scope,
            **changes,
        )

    return (await call.api.write(change)).as_json()


routes = [
    Operation(
        "GET",
        "/v1/endpoints",
        "viewer",
        "Endpoints with their recent success rate, latency, backlog and circuit breaker; "
        "all-tenants endpoints listed apart.",
        list_endpoints_route,
        tenant_filter=True,
    ),
    Operation(
        "POST",
        "/v1/endpoints",
        "operator",
        "Add an endpoint; the answer holds its secret, shown only once.",
        create_endpoint_route,
        body=EndpointCreate,
    ),
    Operation(
        "PATCH",
        "/v1/endpoints/{uid}",
        "operator",
        "Change an endpoint's URL, events, description, timeout, max attempts, proxy, "
        "delivery mode or payload filter.",
        update_endpoint_route,
        (UID,),
        body=EndpointUpdate,
    ),
    Operation(
        "PATCH",
        "/v1/endpoints/{uid}/failure-policy",
        "operator",
        "Hold on ambiguity, owner and operational owner of an endpoint (null clears one).",
        set_failure_policy,
        (UID,),
        body=FailurePolicy,
    ),
    Operation(
        "PATCH",
        "/v1/endpoints/{uid}/auth",
        "operator",
        "Set (or with null remove) the endpoint's client certificate for mutual TLS and its "
        "OAuth2 client credentials; an empty body shows them. Secrets are never returned.",
        set_endpoint_auth_route,
        (UID,),
        body=EndpointAuthUpdate,
    ),
    Operation(
        "DELETE",
        "/v1/endpoints/{uid}",
        "operator",
        "Delete an endpoint and its history (refused while deliveries are pending).",
        delete_endpoint_route,
        (UID,),
        query=EndpointDelete,
    ),
    Operation(
        "POST",
        "/v1/endpoints/{uid}/enable",
        "operator",
        "Enable an endpoint.",
        enable_endpoint,
        (UID,),
        body=EndpointAction,
    ),
    Operation(
        "POST",
        "/v1/endpoints/{uid}/disable",
        "operator",
        "Disable an endpoint; its deliveries wait.",
        disable_endpoint,
        (UID,),
        body=EndpointDisable,
    ),
    Operation(
        "POST",
        "/v1/endpoints/{uid}/rotate-secret",
        "operator",
        "New signing secret; the old one also signs until the grace period ends.",
        rotate_endpoint_secret,
        (UID,),
        body=RotateSecret,
    ),
]
