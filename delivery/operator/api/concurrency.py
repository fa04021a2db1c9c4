"""An endpoint's concurrency: read its mode, ceiling and the adaptive limit now; switch
between a fixed and an adaptive in-flight limit and set the maximum. Audited like every
endpoint change (`endpoint.limits`, the row the CLI's `outbox endpoints limits` writes)."""

from __future__ import annotations

import dataclasses
from typing import Any

from sqlalchemy import Connection

from delivery.health.limits import (
    get_endpoint_concurrency,
    get_endpoint_limits,
    set_endpoint_limits,
)
from delivery.operator.api.core import Call, Operation
from delivery.operator.api.endpoints import UID
from delivery.operator.validation import ConcurrencyUpdate


async def get_concurrency(call: Call) -> Any:
    uid, scope = call.path_uid(), call.scope
    ceiling = call.api.config.adaptive_default_max
    found = await call.api.read(
        lambda c: get_endpoint_concurrency(c, uid, scope=scope, default_maximum=ceiling)
    )
    return found.as_json()


async def set_concurrency(call: Call) -> Any:
    """Change what is given; the other limits (rate, ordering) stay as they are."""
    uid, data = call.path_uid(), await call.body_as(ConcurrencyUpdate)
    given = data.model_fields_set - {"reason"}

    def change(conn: Connection) -> dict[str, Any]:
        current = get_endpoint_limits(conn, uid, scope=call.scope)
        if given:
            changed = dataclasses.replace(
                current,
                max_in_flight=data.max_in_flight
                if "max_in_flight" in given
                else current.max_in_flight,
                adaptive=(data.mode == "adaptive") if data.mode is not None else current.adaptive,
            )
            set_endpoint_limits(
                conn,
                uid,
                changed,
                actor=call.actor,
                scope=call.scope,
                reason=data.reason,
                request_id=call.request_id,
            )
        return get_endpoint_concurrency(
            conn, uid, scope=call.scope, default_maximum=call.api.config.adaptive_default_max
        ).as_json()

    return await call.api.write(change)


routes = [
    Operation(
        "GET",
        "/v1/endpoints/{uid}/concurrency",
        "viewer",
        "The endpoint's in-flight limit: fixed or adaptive, its maximum, the limit the "
        "adaptive limiter has reached and how many deliveries are in flight.",
        get_concurrency,
        (UID,),
    ),
    Operation(
        "PATCH",
        "/v1/endpoints/{uid}/concurrency",
        "operator",
        "Switch the endpoint between a fixed and an adaptive in-flight limit and set its "
        "maximum (adaptive without one: OUTBOX_ADAPTIVE_DEFAULT_MAX); fields not given stay. "
        "The limiter starts afresh.",
        set_concurrency,
        (UID,),
        body=ConcurrencyUpdate,
    ),
]
