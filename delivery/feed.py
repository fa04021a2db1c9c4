"""A page of an endpoint's catch-up feed (outbox/feeds.py), signed exactly like a push.

Each item carries the body a POST would carry (the Standard Webhooks envelope,
delivery.worker.render_body) as a string, byte for byte, and the headers a POST would
carry: `webhook-id` (the event's message id, the same as its pushes, so a receiver that
gets both de-duplicates), `webhook-timestamp` (now: the signature is fresh, so receivers
keep their replay tolerance) and `webhook-signature` with every active signing secret of
the endpoint. A receiver verifies an item with any Standard Webhooks library as if it
had been POSTed.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from delivery.signing import signature_header
from delivery.worker import render_body
from outbox.crypto import SecretBox, SigningKey, signing_key
from outbox.endpoints import secret_context
from outbox.feeds import FeedOwner, cursor_for


def _keys(box: SecretBox, owner: FeedOwner, now: dt.datetime) -> list[SigningKey]:
    context = secret_context(owner.uid)
    keys = [signing_key(box.decrypt(owner.signing_secret, context=context))]
    expires = owner.previous_secret_expires_at
    if owner.previous_signing_secret and (expires is None or expires > now):
        keys.append(signing_key(box.decrypt(owner.previous_signing_secret, context=context)))
    return keys


def signed_page(
    box: SecretBox, owner: FeedOwner, after: int, rows: Any, now: dt.datetime, limit: int
) -> dict[str, Any]:
    """The JSON answer of GET /feed/v1/{endpoint}: items, next_cursor, has_more."""
    keys = _keys(box, owner, now)
    timestamp = int(now.timestamp())
    items = []
    for row in rows:
        body = render_body(row.event_type, row.event_created_at, row.payload_json)
        items.append(
            {
                "cursor": cursor_for(owner.uid, row.position),
                "headers": {
                    "content-type": "application/json",
                    "webhook-id": row.message_id,
                    "webhook-timestamp": str(timestamp),
                    "webhook-signature": signature_header(keys, row.message_id, timestamp, body),
                },
                "body": body.decode(),
            }
        )
    last = rows[-1].position if rows else after
    return {
        "items": items,
        "next_cursor": cursor_for(owner.uid, last),
        "has_more": len(rows) == limit and last < owner.last_position,
    }
