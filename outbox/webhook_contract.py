"""The partners' contract: an OpenAPI 3.1 document of every webhook they can receive.

Each catalogued type becomes a `webhooks` entry (the envelope around its payload schema,
an example, the Standard Webhooks signature headers), beside the service's own
operational events. Rendering is apart from the catalogue's storage: it is given the
types (outbox.catalogue.openapi_document reads them) and touches no database.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, Protocol


class DocumentedType(Protocol):
    """What the document needs of an event type (outbox.catalogue.EventType has it)."""

    @property
    def name(self) -> str: ...
    @property
    def description(self) -> str: ...
    @property
    def status(self) -> str: ...
    @property
    def current_version(self) -> int: ...
    @property
    def schema(self) -> dict[str, Any]: ...
    @property
    def example(self) -> dict[str, Any] | None: ...


_SIGNATURE_HEADERS: list[dict[str, Any]] = [
    {
        "name": "webhook-id",
        "in": "header",
        "required": True,
        "description": "The message id; the same on every retry and replay: deduplicate on it.",
        "schema": {"type": "string", "example": "msg_0192f1c5e1f07b2c9e6f4a1d2b3c4d5e"},
    },
    {
        "name": "webhook-timestamp",
        "in": "header",
        "required": True,
        "description": "Unix seconds when this attempt was sent; reject it if far from now.",
        "schema": {"type": "string", "pattern": "^[0-9]+$"},
    },
    {
        "name": "webhook-signature",
        "in": "header",
        "required": True,
        "description": (
            "Standard Webhooks signatures over '{webhook-id}.{webhook-timestamp}.{body}', "
            "space separated (two during a key rotation): 'v1,<base64 HMAC-SHA256>' keyed "
            "with your whsec_ secret, or 'v1a,<base64 ed25519 signature>' checked with the "
            "whpk_ public key. Any one valid signature authenticates the request."
        ),
        "schema": {"type": "string", "example": "v1,K5oZfzN95Z9UVu1EsfQmfVNQhnkZ2pj9o9NDN/H/pI4="},
    },
]


def _envelope(name: str, data: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["type", "timestamp", "data"],
        "properties": {
            "type": {"type": "string", "const": name},
            "timestamp": {"type": "string", "format": "date-time"},
            "data": dict(data),
        },
    }


_TIME = {"type": ["string", "null"], "format": "date-time"}
_ENDPOINT = {"type": "string", "description": "The endpoint's id (ep_...)."}

# The service's own events (delivery/operational.py): documented for partners beside the
# catalogue, so an operational endpoint can be generated from the same document.
OPERATIONAL_SCHEMAS: dict[str, tuple[str, dict[str, Any]]] = {
    "endpoint.disabled": (
        "An endpoint was disabled (by an operator, a 410 Gone, or auto-disable).",
        {"endpoint_id": _ENDPOINT, "url": {"type": "string"}, "reason": {"type": "string"},
         "disabled_at": _TIME},
    ),
    "endpoint.breaker_opened": (
        "An endpoint's circuit breaker opened: its deliveries wait until a probe succeeds.",
        {"endpoint_id": _ENDPOINT, "opened_at": _TIME, "open_until": _TIME,
         "consecutive_failures": {"type": "integer"},
         "last_failure": {"type": ["string", "null"]}},
    ),
    "endpoint.recovered": (
        "An endpoint's circuit breaker closed again after a successful probe.",
        {"endpoint_id": _ENDPOINT, "recovered_at": _TIME},
    ),
    "delivery.dead": (
        "A delivery used up its attempts or failed for good; many at one endpoint within a "
        "minute are summarised (summary: true, count, window_start, window_end).",
        {"endpoint_id": _ENDPOINT, "delivery_id": {"type": "integer"},
         "message_id": {"type": "string"}, "event_type": {"type": "string"},
         "attempts": {"type": "integer"}, "reason": {"type": ["string", "null"]},
         "last_status_code": {"type": ["integer", "null"]}, "summary": {"type": "boolean"},
         "owner": {"type": ["string", "null"]},
         "count": {"type": "integer"}, "window_start": _TIME, "window_end": _TIME},
    ),
    "delivery.held": (
        "An attempt's outcome was ambiguous (sent, no answer) and its endpoint or event type "
        "holds such deliveries for review: confirm it delivered, send it again or discard it.",
        {"endpoint_id": _ENDPOINT, "delivery_id": {"type": "integer"},
         "message_id": {"type": "string"}, "event_type": {"type": "string"},
         "attempts": {"type": "integer"}, "reason": {"type": ["string", "null"]},
         "owner": {"type": ["string", "null"]}},
    ),
    "tenant.disabled": (
        "A tenant was disabled.",
        {"tenant_id": {"type": "string"}, "reason": {"type": ["string", "null"]},
         "disabled_at": _TIME},
    ),
}  # fmt: skip


def _webhook(
    name: str, description: str, schema: dict[str, Any], example: Any, *, deprecated: bool
) -> dict[str, Any]:
    body: dict[str, Any] = {"schema": _envelope(name, schema)}
    if example is not None:
        body["example"] = {"type": name, "timestamp": "2026-01-01T00:00:00Z", "data": example}
    return {
        "post": {
            "operationId": "webhook_" + re.sub(r"[^A-Za-z0-9_]", "_", name),
            "summary": description,
            "deprecated": deprecated,
            "parameters": _SIGNATURE_HEADERS,
            "requestBody": {"required": True, "content": {"application/json": body}},
            "responses": {
                "2XX": {"description": "Received. Any other answer is retried later."},
                "410": {"description": "Gone: the endpoint is disabled; nothing is dropped."},
            },
        }
    }


def render_openapi(
    event_types: Iterable[DocumentedType],
    *,
    title: str = "Webhooks",
    version: str = "1.0.0",
    include_operational: bool = True,
) -> dict[str, Any]:
    """An OpenAPI 3.1 document whose `webhooks` describe `event_types` (the envelope around
    the payload schema, an example, the signature headers), and the service's own
    operational events."""
    webhooks: dict[str, Any] = {}
    if include_operational:
        for name, (description, properties) in OPERATIONAL_SCHEMAS.items():
            schema = {"type": "object", "required": list(properties)[:1],
                      "properties": properties}  # fmt: skip
            webhooks[name] = _webhook(name, description, schema, None, deprecated=False)
    for event_type in event_types:
        webhooks[event_type.name] = _webhook(
            event_type.name,
            event_type.description or event_type.name,
            event_type.schema,
            event_type.example,
            deprecated=event_type.status == "deprecated",
        )
        webhooks[event_type.name]["post"]["description"] = (
            f"Schema version {event_type.current_version}."
        )
    return {
        "openapi": "3.1.0",
        "info": {
            "title": title,
            "version": version,
            "description": (
                "Events are POSTed as JSON with Standard Webhooks headers "
                "(https://www.standardwebhooks.com). Verify the signature over the raw body "
                "before parsing it."
            ),
        },
        "webhooks": webhooks,
    }
