"""Catch-up feeds: a partner pulls an endpoint's events in order instead of (or as well
as) receiving POSTs, e.g. after an outage or when it cannot expose a public URL.

An endpoint's `delivery_mode` is 'push' (HTTP POSTs only, the default), 'pull' (only
the feed: the relay inserts no delivery row, so no worker ever claims one and nothing
waits as pending) or 'both'. The relay appends each matching event to the feed of a
pull or both endpoint (outbox/sql/relay.py) at the next position, in commit order.

The feed is read with a feed token (`obf_<endpoint id>.<secret>`), one per endpoint,
shown once when created or rotated and stored only as its SHA-256. The token names its
endpoint; a feed request for any other endpoint is not found (404), whoever owns it.
Cursors are opaque (`<position>.<tag>`): the tag ties a cursor to its endpoint, so a
cursor from another feed, or a made-up one, is refused instead of silently paging the
wrong place. Entries are kept for OUTBOX_RETENTION_DAYS (delivery/retention.py); a
cursor older than that answers 410 with the oldest cursor still served.

This module holds the rows and the rules; delivery/feed.py signs a page exactly as a
push is signed, and the admin server serves it at GET /feed/v1/{endpoint}.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection

from outbox.audit import record_audit
from outbox.errors import (
    EndpointError,
    EndpointNotFoundError,
    FeedAuthError,
    FeedError,
    FeedGoneError,
)
from outbox.filters import validate_filter
from outbox.schema import DELIVERY_MODES
from outbox.sql import feeds as queries
from outbox.tenants import scope_params

TOKEN_PREFIX = "obf_"  # noqa: S105 (a prefix, not a secret)
DEFAULT_PAGE = 100
MAX_PAGE = 1000
_UID = re.compile(r"^ep_[0-9a-f]{32}$")
_CURSOR = re.compile(r"^(0|[1-9][0-9]{0,17})\.([0-9a-f]{12})$")


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _not_found(uid: str) -> EndpointNotFoundError:
    """The answer for an unknown endpoint (outbox.endpoints says the same; it imports us)."""
    return EndpointNotFoundError(f"no endpoint {uid!r}; `outbox endpoints list` shows the ids")


def check_delivery_mode(mode: str) -> str:
    """'push', 'pull' or 'both', else EndpointError naming them."""
    if mode not in DELIVERY_MODES:
        raise EndpointError(
            f"delivery mode {mode!r} is not one of: push (HTTP POSTs), pull (the catch-up "
            "feed only), both"
        )
    return mode


def new_feed_token(uid: str) -> tuple[str, str]:
    """(token to show once, hash to store)."""
    secret = secrets.token_hex(32)
    return f"{TOKEN_PREFIX}{uid}.{secret}", _hash(secret)


@dataclass(frozen=True, slots=True)
class FeedSettings:
    """What an endpoint shows of its feed and filter (never the token)."""

    delivery_mode: str
    payload_filter: str | None
    has_feed_token: bool
    last_position: int
    pruned_through: int
    filter_skips: int

    def as_json(self) -> dict[str, Any]:
        return {
            "delivery_mode": self.delivery_mode,
            "payload_filter": self.payload_filter,
            "feed_token": self.has_feed_token,
            "feed_last_position": self.last_position,
            "filter_skips": self.filter_skips,
        }


def feed_settings(conn: Connection, uid: str, *, scope: str | None = None) -> FeedSettings:
    row = conn.execute(queries.SELECT_ENDPOINT_FEED, {"uid": uid, **scope_params(conn, scope)})
    found = row.first()
    if found is None:
        raise _not_found(uid)
    return FeedSettings(
        delivery_mode=found.delivery_mode,
        payload_filter=found.payload_filter,
        has_feed_token=bool(found.has_feed_token),
        last_position=int(found.last_position),
        pruned_through=int(found.pruned_through),
        filter_skips=int(found.filter_skips),
    )


def rotate_feed_token(
    conn: Connection,
    uid: str,
    *,
    actor: str,
    reason: str | None = None,
    request_id: str | None = None,
    scope: str | None = None,
) -> str:
    """A new feed token for the endpoint (the old one stops working at once); shown once."""
    token, token_hash = new_feed_token(uid)
    updated = conn.execute(
        queries.SET_FEED_TOKEN, {"uid": uid, "token_hash": token_hash, **scope_params(conn, scope)}
    ).first()
    if updated is None:
        raise _not_found(uid)
    conn.execute(queries.ENSURE_ENDPOINT_FEED, {"id": updated.id})
    record_audit(
        conn,
        actor=actor,
        action="endpoint.rotate_feed_token",
        target_type="endpoint",
        target_id=uid,
        reason=reason,
        request_id=request_id,
    )
    return token


def set_delivery_mode(
    conn: Connection,
    uid: str,
    mode: str,
    *,
    actor: str,
    reason: str | None = None,
    request_id: str | None = None,
    scope: str | None = None,
) -> str | None:
    """Switch push/pull/both for events relayed from now on; deliveries already scheduled
    go out as they are. Returns a new feed token when the endpoint now has a feed and had
    no token yet (shown once), else None."""
    check_delivery_mode(mode)
    before = feed_settings(conn, uid, scope=scope)
    updated = conn.execute(
        queries.SET_DELIVERY_MODE, {"uid": uid, "mode": mode, **scope_params(conn, scope)}
    ).first()
    if updated is None:
        raise _not_found(uid)
    record_audit(
        conn,
        actor=actor,
        action="endpoint.delivery_mode",
        target_type="endpoint",
        target_id=uid,
        reason=reason,
        request_id=request_id,
        details={"delivery_mode": mode, "before": before.delivery_mode},
    )
    if mode != "push":
        conn.execute(queries.ENSURE_ENDPOINT_FEED, {"id": updated.id})
        if not before.has_feed_token:
            return rotate_feed_token(
                conn, uid, actor=actor, reason=reason, request_id=request_id, scope=scope
            )
    return None


def set_payload_filter(
    conn: Connection,
    uid: str,
    payload_filter: str | None,
    *,
    actor: str,
    reason: str | None = None,
    request_id: str | None = None,
    scope: str | None = None,
) -> None:
    """Set (validated, outbox.filters) or clear (None or blank) the endpoint's filter."""
    stored = validate_filter(conn, payload_filter)
    before = feed_settings(conn, uid, scope=scope)
    conn.execute(
        queries.SET_PAYLOAD_FILTER, {"uid": uid, "filter": stored, **scope_params(conn, scope)}
    )
    record_audit(
        conn,
        actor=actor,
        action="endpoint.payload_filter",
        target_type="endpoint",
        target_id=uid,
        reason=reason,
        request_id=request_id,
        details={"payload_filter": stored, "before": before.payload_filter},
    )


# -- reading a feed --------------------------------------------------------------------


def cursor_for(uid: str, position: int) -> str:
    """The opaque cursor of `position` in `uid`'s feed."""
    tag = hashlib.sha256(f"{uid}:{position}".encode()).hexdigest()[:12]
    return f"{position}.{tag}"


def parse_cursor(uid: str, cursor: str | None) -> int | None:
    """The position after which to read (None: from the oldest kept); FeedError for junk."""
    if cursor is None or cursor == "":
        return None
    match = _CURSOR.match(cursor)
    if match is None or not hmac.compare_digest(cursor_for(uid, int(match[1])), cursor):
        raise FeedError(
            f"cursor {cursor[:40]!r} is not one this feed gave out: pass a `next_cursor` "
            "of this endpoint's feed, or leave `after` out to start from the oldest event kept"
        )
    return int(match[1])


def check_limit(limit: int | None) -> int:
    if limit is None:
        return DEFAULT_PAGE
    if not 1 <= limit <= MAX_PAGE:
        raise FeedError(f"limit must be between 1 and {MAX_PAGE} (asked for {limit})")
    return limit


@dataclass(frozen=True, slots=True)
class FeedOwner:
    """The endpoint a valid feed token names, with its (encrypted) signing secrets."""

    id: int
    uid: str
    signing_secret: str
    previous_signing_secret: str | None
    previous_secret_expires_at: Any
    last_position: int
    pruned_through: int


def authenticate_feed(conn: Connection, presented: str | None, endpoint_uid: str) -> FeedOwner:
    """The endpoint of a valid token, if it is `endpoint_uid`.

    FeedAuthError (401) for a missing, malformed, rotated or revoked token; not found
    (404) when the token is valid but names another endpoint, whoever owns that one.
    """
    if not presented or not presented.startswith(TOKEN_PREFIX):
        raise FeedAuthError(
            "no feed token: send 'Authorization: Bearer obf_...' (the endpoint's feed "
            "token; `outbox endpoints feed-token EP` makes a new one)"
        )
    uid, _, secret = presented[len(TOKEN_PREFIX) :].partition(".")
    row = None
    if _UID.match(uid) and secret:
        row = conn.execute(queries.SELECT_FEED_OWNER, {"uid": uid}).first()
    if (
        row is None
        or not row.feed_token_hash
        or not hmac.compare_digest(_hash(secret), str(row.feed_token_hash))
    ):
        raise FeedAuthError(
            "invalid, rotated or revoked feed token: ask for the endpoint's current one"
        )
    if uid != endpoint_uid or row.delivery_mode == "push":
        raise _not_found(endpoint_uid)
    return FeedOwner(
        id=row.id,
        uid=row.uid,
        signing_secret=row.signing_secret,
        previous_signing_secret=row.previous_signing_secret,
        previous_secret_expires_at=row.previous_secret_expires_at,
        last_position=int(row.last_position),
        pruned_through=int(row.pruned_through),
    )


def read_feed_rows(
    conn: Connection, owner: FeedOwner, after: int | None, limit: int
) -> tuple[int, Sequence[Any]]:
    """(the position read after, the entries after it, oldest first). `after` None starts
    at the oldest entry kept; a cursor older than that is 410 (events were missed), one
    past the end 400."""
    if after is None:
        after = owner.pruned_through
    elif after < owner.pruned_through:
        raise FeedGoneError(
            f"events up to position {owner.pruned_through} were pruned by retention "
            "(OUTBOX_RETENTION_DAYS); continue from `oldest_cursor` (the events in between "
            "are gone)",
            cursor_for(owner.uid, owner.pruned_through),
        )
    if after > owner.last_position:
        raise FeedError(
            f"cursor is past the end of this feed (position {after} of {owner.last_position})"
        )
    rows = conn.execute(
        queries.SELECT_FEED_PAGE, {"endpoint_id": owner.id, "after": after, "limit": limit}
    ).all()
    return after, rows


def refuse_pushes_to_pull_endpoints(conn: Connection, delivery_ids: Sequence[int]) -> None:
    """A replay is a POST: refused for a pull-only endpoint, saying how to get it."""
    rows = conn.execute(queries.SELECT_PULL_ONLY_DELIVERIES, {"ids": list(delivery_ids)}).all()
    if rows:
        listed = ", ".join(f"{row.id} ({row.uid})" for row in rows)
        raise EndpointError(
            f"cannot replay {listed}: the endpoint is pull-only and gets no POSTs; its "
            "partner reads the event from its feed, or set --mode both to push again; "
            "nothing was replayed"
        )
