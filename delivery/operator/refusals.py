"""Refused admin API calls: audited, but never a way to fill the disk.

Anyone who can reach the admin port can send requests without a token, so what a
refusal costs must be bounded:

- **Aggregated rows.** Refusals with the same actor, client, status and reason
  within one interval (OUTBOX_ADMIN_REFUSED_INTERVAL_SECONDS) share one audit row
  whose `details.count` grows; the row keeps the first request's path and the
  latest request id.
- **Bounded fields.** The path and the user agent are truncated and stripped of
  control characters before they are stored.
- **A rate limit for clients without a valid token.** Each client address gets a
  token bucket (OUTBOX_ADMIN_UNAUTHENTICATED_PER_MINUTE, the burst too); past it
  the answer is 429 with Retry-After and nothing is written at all. Those 429s
  are counted in memory and added to the client's `rate limited` row with its next
  written refusal, so the counts add up without a write per request.

The buckets live in the serving process (each replica limits on its own) and are
capped in number, oldest dropped first, so a spray of addresses cannot grow memory.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import unicodedata
from collections import OrderedDict
from dataclasses import dataclass

from sqlalchemy import Connection
from starlette.requests import Request

from outbox.sql import audit as queries

MAX_PATH = 200
MAX_USER_AGENT = 120
MAX_CLIENT = 64  # an IPv6 address with a zone fits
MAX_CLIENTS = 10_000
RATE_LIMITED = "rate limited: too many calls without a valid token"


def bounded(text: str, limit: int) -> str:
    """`text` without control characters, at most `limit` characters (marked when cut)."""
    clean = "".join("?" if unicodedata.category(ch) in ("Cc", "Cs") else ch for ch in text)
    return clean if len(clean) <= limit else clean[: limit - 1] + "…"


def client_address(request: Request) -> str | None:
    """The caller's address for limits and the audit log: the TCP peer.

    Only when that peer is one of OUTBOX_TRUSTED_PROXIES has the server (uvicorn, set
    up by delivery.operator.api.serve) replaced it with the address the proxy forwarded
    in X-Forwarded-For; any other peer's X-Forwarded-For is ignored, so a client cannot
    pick the address it is limited and audited under. Bounded: a forwarded value is text.
    """
    return bounded(request.client.host, MAX_CLIENT) if request.client else None


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: dt.datetime
    limited: int = 0  # 429s answered since the last written refusal


class UnauthenticatedLimiter:
    """A token bucket per client address for calls without a valid token."""

    def __init__(self, per_minute: float, *, max_clients: int = MAX_CLIENTS) -> None:
        self.per_second = per_minute / 60.0
        self.capacity = max(1.0, per_minute)
        self.max_clients = max_clients
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def _bucket(self, client: str, now: dt.datetime) -> _Bucket:
        bucket = self._buckets.get(client)
        if bucket is None:
            bucket = self._buckets[client] = _Bucket(self.capacity, now)
            while len(self._buckets) > self.max_clients:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(client)
            elapsed = max(0.0, (now - bucket.at).total_seconds())
            bucket.tokens = min(self.capacity, bucket.tokens + elapsed * self.per_second)
            bucket.at = now
        return bucket

    def take(self, client: str, now: dt.datetime) -> float | None:
        """None if the call may be answered (401, audited); else the seconds to wait."""
        bucket = self._bucket(client, now)
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return None
        bucket.limited += 1
        return max(1.0, math.ceil((1.0 - bucket.tokens) / self.per_second))

    def limited_since_written(self, client: str) -> int:
        """The 429s not yet in the audit log; reading resets the count."""
        bucket = self._buckets.get(client)
        if bucket is None:
            return 0
        count, bucket.limited = bucket.limited, 0
        return count


def record_refusal(
    conn: Connection,
    *,
    now: dt.datetime,
    interval: dt.timedelta,
    actor: str,
    client: str | None,
    status: int,
    reason: str,
    method: str,
    path: str,
    user_agent: str | None,
    request_id: str,
    count: int = 1,
    tenant: str | None = None,
) -> None:
    """Add `count` refusals to this interval's row for (actor, client, status, reason).

    `tenant`: the scoped token's tenant when the refusal was a 403 (so that tenant's
    own audit view shows it), else None.
    """
    seconds = interval.total_seconds()
    since = dt.datetime.fromtimestamp(now.timestamp() // seconds * seconds, dt.UTC)
    params = {
        "now": now,
        "since": since,
        "actor": actor,
        "client": client,
        "status": str(status),
        "reason": reason,
        "request_id": request_id,
        "count": count,
        "last_at": now.isoformat(),
        "tenant": tenant,
    }
    if conn.execute(queries.BUMP_REFUSAL, params).first() is not None:
        return
    details = {
        "status": status,
        "client": client,
        "count": count,
        "last_at": now.isoformat(),
        "user_agent": bounded(user_agent, MAX_USER_AGENT) if user_agent else None,
    }
    conn.execute(
        queries.INSERT_REFUSAL,
        {
            **params,
            "target_id": bounded(f"{method} {path}", MAX_PATH),
            "details": json.dumps(details),
        },
    )
