"""Admin API routes of the contract: the event-type catalogue, its OpenAPI export, rejected
events and test events. The same functions the CLI calls (outbox.catalogue,
outbox.testevents); declared as `Operation`s so the admin API's own OpenAPI document
lists them like every other route.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from sqlalchemy import Connection

from delivery.operator.api.core import ApiError, Call, Operation, Param
from delivery.operator.api.feed import feed_openapi
from delivery.operator.handler_inputs import (
    ContractExportQuery,
    EventTypeCreate,
    EventTypeUpdate,
    RejectedQuery,
    RequeueRejected,
    SendTestEvent,
)
from delivery.operator.validation import WorkflowSettings
from outbox import catalogue, workflows
from outbox.schema_rules import vet_schema
from outbox.testevents import read_test_outcome, send_test_event

_NAME = Param("name", "Event type name, e.g. order.created.")
_UID = Param("uid", "Endpoint id (ep_...).")
_MESSAGE = Param("message_id", "Message id (msg_...).")
_MAX_WAIT = 30.0


async def list_event_types(call: Call) -> Any:
    items = await call.api.read(catalogue.list_event_types)
    return {"items": [item.as_json() for item in items]}


async def show_event_type(call: Call) -> Any:
    name = call.request.path_params["name"]

    def read(conn: Connection) -> dict[str, Any]:
        item = catalogue.get_event_type(conn, name)
        versions = catalogue.list_versions(conn, name)
        return {**item.as_json(), "versions": [v.as_json() for v in versions]}

    return await call.api.read(read)


async def _checked_schema(call: Call, schema: Any, example: Any) -> catalogue.CheckedSchema:
    """Vet a schema (and the example against it) off the event loop, so /healthz and every
    other request answer while it works; only the catalogue versions it refers to are read
    from the database in between (versions never change, so nothing can race)."""
    config = call.api.config
    refs = await asyncio.to_thread(vet_schema, schema, config.schema_limits)
    versions = await call.api.read(lambda c: catalogue.referenced_versions(c, refs))
    return await asyncio.to_thread(
        catalogue.check_new_schema,
        schema,
        example,
        limits=config.schema_limits,
        versions=lambda _: versions,
        budget=config.validation_budget,
    )


async def add_event_type(call: Call) -> Any:
    call.unscoped_only("change the event-type catalogue (every tenant shares it)")
    data = await call.body()
    name = catalogue.valid_name(data.get("name") or "")
    checked = await _checked_schema(call, data.get("schema"), data.get("example"))
    item = await call.api.write(
        lambda c: catalogue.add_event_type(
            c,
            name,
            schema=checked.schema,
            description=str(data.get("description") or ""),
            actor=call.actor,
            request_id=call.request_id,
            checked=checked,
        )
    )
    return item.as_json()


async def update_event_type(call: Call) -> Any:
    call.unscoped_only("change the event-type catalogue (every tenant shares it)")
    name, data = call.request.path_params["name"], await call.body()
    schema, example = data.get("schema"), data.get("example")
    checked = None
    checked_for = None
    if schema is not None:
        if example is None:
            # The current example must match the new schema too: checked here, off the loop.
            current = await call.api.read(lambda c: catalogue.get_event_type(c, name))
            example = current.example
        checked = await _checked_schema(call, schema, example)
    elif example is not None:
        current = await call.api.read(lambda c: catalogue.get_event_type(c, name))
        await asyncio.to_thread(
            catalogue.check_example, example, current.schema, call.api.config.validation_budget
        )
        checked_for = current.current_version
    item = await call.api.write(
        lambda c: catalogue.update_event_type(
            c,
            name,
            description=data.get("description"),
            example=example,
            status=data.get("status"),
            actor=call.actor,
            request_id=call.request_id,
            checked=checked,
            example_checked_for=checked_for,
            budget=call.api.config.validation_budget,
        )
    )
    return item.as_json()


async def _set_status(call: Call, status: str) -> Any:
    call.unscoped_only("change the event-type catalogue (every tenant shares it)")
    name = call.request.path_params["name"]
    item = await call.api.write(
        lambda c: catalogue.set_status(
            c, name, status, actor=call.actor, request_id=call.request_id
        )
    )
    return item.as_json()


async def deprecate_event_type(call: Call) -> Any:
    return await _set_status(call, "deprecated")


async def archive_event_type(call: Call) -> Any:
    return await _set_status(call, "archived")


async def export_openapi(call: Call) -> Any:
    title = call.query("title") or "Webhooks"
    version = call.query("version") or "1.0.0"
    operational = (call.query("operational") or "true").lower() not in ("0", "false", "no")
    document = await call.api.read(
        lambda c: catalogue.openapi_document(
            c, title=title, version=version, include_operational=operational
        )
    )
    return feed_openapi(document)  # the catch-up feed partners pull from


async def list_rejected(call: Call) -> Any:
    limit = call.query_int("limit", 100) or 100
    scope = call.scope
    items = await call.api.read(lambda c: catalogue.list_rejected(c, limit=limit, scope=scope))
    return {"items": [item.as_json() for item in items]}


async def requeue_rejected(call: Call) -> Any:
    message_id, data = call.request.path_params["message_id"], await call.body()
    skip = bool(data.get("skip_validation"))
    await call.api.write(
        lambda c: catalogue.requeue_rejected(
            c,
            message_id,
            skip_validation=skip,
            actor=call.actor,
            reason=str(data.get("reason") or ""),
            request_id=call.request_id,
            scope=call.scope,
        )
    )
    return {"requeued": message_id, "skip_validation": skip}


async def test_endpoint(call: Call) -> Any:
    uid, data = call.request.path_params["uid"], await call.body()
    try:
        wait = min(float(data.get("wait_seconds", 10.0)), _MAX_WAIT)
    except (TypeError, ValueError) as exc:
        raise ApiError(400, "wait_seconds must be a number of seconds (0 to 30)") from exc
    now = call.api.clock.now()
    sent = await call.api.write(
        lambda c: send_test_event(
            c,
            uid,
            event_type=data.get("event_type"),
            now=now,
            actor=call.actor,
            request_id=call.request_id,
            scope=call.scope,
        )
    )
    deadline = time.monotonic() + max(0.0, wait)
    while True:
        outcome = await call.api.read(lambda c: read_test_outcome(c, sent.delivery_id))
        if outcome.finished or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.1)
    return {**sent.as_json(), "outcome": outcome.as_json(), "finished": outcome.finished}


async def set_workflow(call: Call) -> Any:
    """Hold on ambiguity, owner and alert thresholds of one event type (null clears)."""
    call.unscoped_only("change the event-type catalogue (every tenant shares it)")
    name, data = call.request.path_params["name"], await call.body_as(WorkflowSettings)
    given = {key: getattr(data, key) for key in data.model_fields_set}
    item = await call.api.write(
        lambda c: workflows.set_workflow(
            c, name, actor=call.actor, request_id=call.request_id, **given
        )
    )
    return item.as_json()


routes = [
    Operation("GET", "/v1/event-types", "viewer", "The event-type catalogue.", list_event_types),
    Operation(
        "POST",
        "/v1/event-types",
        "operator",
        "Add an event type with its first schema version.",
        add_event_type,
        body=EventTypeCreate,
    ),
    Operation(
        "GET",
        "/v1/event-types/{name}",
        "viewer",
        "One event type with every schema version it has had.",
        show_event_type,
        (_NAME,),
    ),
    Operation(
        "PATCH",
        "/v1/event-types/{name}",
        "operator",
        "A new schema version, description, example or status.",
        update_event_type,
        (_NAME,),
        body=EventTypeUpdate,
    ),
    Operation(
        "PATCH",
        "/v1/event-types/{name}/workflow",
        "operator",
        "Hold on ambiguity, owner and alert thresholds of an event type (null clears one).",
        set_workflow,
        (_NAME,),
        body=WorkflowSettings,
    ),
    Operation(
        "POST",
        "/v1/event-types/{name}/deprecate",
        "operator",
        "Deprecate: still published, flagged in the generated documentation.",
        deprecate_event_type,
        (_NAME,),
    ),
    Operation(
        "POST",
        "/v1/event-types/{name}/archive",
        "operator",
        "Archive: publishing the type is refused from now on.",
        archive_event_type,
        (_NAME,),
    ),
    Operation(
        "GET",
        "/v1/contract/openapi.json",
        "viewer",
        "The partners' OpenAPI 3.1 document: every event type as a webhook.",
        export_openapi,
        query=ContractExportQuery,
    ),
    Operation(
        "GET",
        "/v1/events/rejected",
        "viewer",
        "Events whose payload broke their schema (published through SQL), newest first.",
        list_rejected,
        query=RejectedQuery,
    ),
    Operation(
        "POST",
        "/v1/events/{message_id}/requeue",
        "operator",
        "Give a rejected event back to the relay (checked again unless skip_validation).",
        requeue_rejected,
        (_MESSAGE,),
        body=RequeueRejected,
    ),
    Operation(
        "POST",
        "/v1/endpoints/{uid}/test",
        "operator",
        "Send a test event (a type's example, or a ping) to one endpoint; waits for the outcome.",
        test_endpoint,
        (_UID,),
        body=SendTestEvent,
    ),
]
