"""The catch-up feed (outbox/feeds.py): GET /feed/v1/{endpoint} for partners, with the
endpoint's feed token instead of an admin token, and what operators change of a feed:
the delivery mode and payload filter (through PATCH /v1/endpoints/{uid}) and the feed
token (POST /v1/endpoints/{uid}/feed-token, shown once)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection
from starlette.responses import JSONResponse

from delivery.feed import signed_page
from delivery.operator.api.core import Call, Operation, Param
from delivery.operator.validation import EndpointUpdate, FeedQuery, FeedTokenRotate
from outbox import feeds
from outbox.errors import FeedAuthError, FeedError, FeedGoneError

ENDPOINT = Param("endpoint", "Endpoint id (ep_...) the feed token belongs to.")
UID = Param("uid", "Endpoint id (ep_...).")


def apply_feed_changes(
    conn: Connection, call: Call, uid: str, data: EndpointUpdate, shown: list[str]
) -> bool:
    """The delivery mode and payload filter of an endpoint update, when given; a feed
    token made for a newly pulled endpoint goes into `shown`. Whether either was given."""
    given = data.model_fields_set
    if "delivery_mode" in given and data.delivery_mode is not None:
        token = feeds.set_delivery_mode(
            conn,
            uid,
            data.delivery_mode,
            actor=call.actor,
            reason=data.reason,
            request_id=call.request_id,
            scope=call.scope,
        )
        if token is not None:
            shown.append(token)
    if "payload_filter" in given:
        feeds.set_payload_filter(
            conn,
            uid,
            data.payload_filter,
            actor=call.actor,
            reason=data.reason,
            request_id=call.request_id,
            scope=call.scope,
        )
    return bool(given & {"delivery_mode", "payload_filter"})


async def rotate_feed_token_route(call: Call) -> Any:
    uid, data = call.path_uid(), await call.body_as(FeedTokenRotate)
    token = await call.api.write(
        lambda c: feeds.rotate_feed_token(
            c,
            uid,
            actor=call.actor,
            reason=data.reason,
            request_id=call.request_id,
            scope=call.scope,
        )
    )
    return {"id": uid, "feed_token": token}


async def read_feed_route(call: Call) -> Any:
    """A page of the endpoint's events, signed like pushes; 401, 404 and 410 as JSON."""
    endpoint = call.request.path_params["endpoint"]
    query = call.query_as(FeedQuery)
    header = call.request.headers.get("authorization", "")
    scheme, _, presented = header.partition(" ")
    token = presented.strip() if scheme.lower() == "bearer" else None
    now = call.api.clock.now()
    try:
        limit = feeds.check_limit(query.limit)

        def read(conn: Connection) -> tuple[feeds.FeedOwner, int, Any]:
            owner = feeds.authenticate_feed(conn, token, endpoint)
            after = feeds.parse_cursor(owner.uid, query.after)
            read_after, rows = feeds.read_feed_rows(conn, owner, after, limit)
            return owner, read_after, rows

        owner, after, rows = await call.api.read(read)
    except FeedAuthError as exc:
        return JSONResponse({"error": str(exc)}, 401, headers={"www-authenticate": "Bearer"})
    except FeedGoneError as exc:
        return JSONResponse({"error": str(exc), "oldest_cursor": exc.oldest_cursor}, 410)
    except FeedError as exc:
        return JSONResponse({"error": str(exc)}, 400)
    return signed_page(call.api.box, owner, after, rows, now, limit)


FEED_ROUTE = Operation(
    "GET",
    "/feed/v1/{endpoint}",
    None,  # the endpoint's feed token, checked by the handler (Authorization: Bearer obf_...)
    "The endpoint's events after `after`, oldest first, each with the body and Standard "
    "Webhooks headers of a push (verify them the same way). Authorization: Bearer "
    "<feed token>. 401: no valid feed token; 404: not this token's endpoint; 410: the "
    "cursor is older than retention kept (the answer's `oldest_cursor` continues).",
    read_feed_route,
    (ENDPOINT,),
    query=FeedQuery,
)

routes = [
    FEED_ROUTE,
    Operation(
        "POST",
        "/v1/endpoints/{uid}/feed-token",
        "operator",
        "A new feed token for the endpoint's catch-up feed, shown only once; the old one "
        "stops working at once.",
        rotate_feed_token_route,
        (UID,),
        body=FeedTokenRotate,
    ),
]


_PAGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["items", "next_cursor", "has_more"],
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["cursor", "headers", "body"],
                "properties": {
                    "cursor": {"type": "string"},
                    "headers": {
                        "type": "object",
                        "description": "webhook-id, webhook-timestamp, webhook-signature, "
                        "content-type: what a push carries.",
                        "additionalProperties": {"type": "string"},
                    },
                    "body": {
                        "type": "string",
                        "description": "The exact body a push carries (the signed bytes, "
                        "UTF-8): verify it with the headers before parsing it.",
                    },
                },
            },
        },
        "next_cursor": {"type": "string", "description": "Pass as `after` next time."},
        "has_more": {"type": "boolean"},
    },
}


def feed_openapi(document: dict[str, Any]) -> dict[str, Any]:
    """The partners' document with the feed added under `paths` (from the same route
    declaration the server dispatches, so its parameters cannot drift)."""
    from delivery.operator.api.core import build_openapi

    built = build_openapi([FEED_ROUTE])
    paths = built["paths"]
    spec = paths[FEED_ROUTE.path]["get"]
    spec["security"] = [{"feedToken": []}]
    spec["responses"].update(
        {
            "200": {
                "description": "A page of events, oldest first",
                "content": {"application/json": {"schema": _PAGE_SCHEMA}},
            },
            "401": {"description": "No valid feed token (missing, rotated or revoked)"},
            "404": {"description": "Not the endpoint of this feed token"},
            "410": {"description": "The cursor is older than retention kept; see oldest_cursor"},
        }
    )
    components = document.setdefault("components", {})
    components.setdefault("schemas", {}).update(built["components"]["schemas"])
    components.setdefault("securitySchemes", {})["feedToken"] = {
        "type": "http",
        "scheme": "bearer",
        "description": "The endpoint's feed token (obf_...), shown once when made.",
    }
    document["paths"] = {**document.get("paths", {}), **paths}
    return document
