"""API tokens: list (never their secrets), create (the answer holds it, once), revoke."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import Connection

from delivery.operator.api.core import ApiError, Call, Operation, Param
from delivery.operator.handler_inputs import TokenCreate
from outbox.tokens import MAX_TOKEN_LIFETIME, create_token, list_tokens, revoke_token


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


routes = [
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
        body=TokenCreate,
    ),
    Operation(
        "DELETE",
        "/v1/tokens/{token}",
        "operator",
        "Revoke a token by name or token id; it stops working at once, and so do the "
        "console sessions it opened.",
        revoke_token_route,
        (Param("token", "Token name or token id."),),
    ),
]
