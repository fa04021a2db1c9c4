"""Deliveries: search, show, replay (one, listed or by filter, rate-capped), discard, and
confirm or retry a held one."""

from __future__ import annotations

from typing import Any

from delivery.operator.api.core import ApiError, Call, Operation, Param
from delivery.operator.validation import (
    DeliverySearch,
    DiscardMany,
    DiscardOne,
    ReplayFilter,
    ReplayMany,
    ReplayOne,
)
from outbox import deliveries as delivery_ops

ID = Param("id", "Delivery id.", "integer")


async def list_deliveries(call: Call) -> Any:
    flt = call.query_as(DeliverySearch).to_filter(tenant=await call.tenant())
    items = await call.api.read(lambda c: delivery_ops.search_deliveries(c, flt))
    return {
        "items": [item.as_json() for item in items],
        "next_before": items[-1].id if len(items) == flt.limit else None,
    }


async def show_delivery(call: Call) -> Any:
    delivery_id, scope = call.path_id(), call.scope
    return (
        await call.api.read(lambda c: delivery_ops.get_delivery(c, delivery_id, scope=scope))
    ).as_json()


async def replay_one(call: Call) -> Any:
    delivery_id, data = call.path_id(), await call.body_as(ReplayOne)
    now = call.api.clock.now()
    result = await call.api.write(
        lambda c: delivery_ops.replay(
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
            lambda c: delivery_ops.replay(
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
        lambda c: delivery_ops.bulk_replay(
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
        lambda c: delivery_ops.discard(
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


async def confirm_held(call: Call) -> Any:
    return await _settle_held(call, "confirm")


async def retry_held(call: Call) -> Any:
    return await _settle_held(call, "retry")


async def _settle_held(call: Call, action: str) -> Any:
    delivery_id, data = call.path_id(), await call.body_as(DiscardOne)
    now = call.api.clock.now()
    done = await call.api.write(
        lambda c: delivery_ops.resolve_held(
            c,
            [delivery_id],
            action=action,
            actor=call.actor,
            reason=data.reason,
            now=now,
            request_id=call.request_id,
            scope=call.scope,
        )
    )
    return {"confirmed" if action == "confirm" else "retried": done}


routes = [
    Operation(
        "GET",
        "/v1/deliveries",
        "viewer",
        "Search deliveries.",
        list_deliveries,
        query=DeliverySearch,
        tenant_filter=True,
    ),
    Operation(
        "GET",
        "/v1/deliveries/{id}",
        "viewer",
        "A delivery with its event, attempt history and replays.",
        show_delivery,
        (ID,),
    ),
    Operation(
        "POST",
        "/v1/deliveries/{id}/replay",
        "operator",
        "Replay one delivery as a new delivery (same webhook-id).",
        replay_one,
        (ID,),
        body=ReplayOne,
    ),
    Operation(
        "POST",
        "/v1/replays",
        "operator",
        "Replay listed ids, or what a filter matches (dead by default), rate-capped.",
        replay_many,
        body=ReplayMany,
    ),
    Operation(
        "POST",
        "/v1/deliveries/{id}/discard",
        "operator",
        "Discard a scheduled, dead or held delivery.",
        discard_one,
        (ID,),
        body=DiscardOne,
    ),
    Operation(
        "POST",
        "/v1/deliveries/{id}/confirm",
        "operator",
        "Confirm a held delivery arrived: recorded succeeded, with the reason.",
        confirm_held,
        (ID,),
        body=DiscardOne,
    ),
    Operation(
        "POST",
        "/v1/deliveries/{id}/retry",
        "operator",
        "Send a held delivery again now (the same delivery and webhook-id).",
        retry_held,
        (ID,),
        body=DiscardOne,
    ),
    Operation(
        "POST",
        "/v1/discards",
        "operator",
        "Discard several deliveries (all or nothing).",
        discard_many,
        body=DiscardMany,
    ),
]
