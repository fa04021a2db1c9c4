"""Operational events: the service reports its own trouble through its own pipeline.

- `endpoint.disabled`: an endpoint was disabled (by an operator, a 410, or auto-disable).
  Payload: endpoint_id, url, reason, disabled_at.
- `endpoint.breaker_opened`: its circuit breaker tripped. Payload: endpoint_id,
  opened_at, open_until, consecutive_failures, last_failure.
- `endpoint.recovered`: the breaker closed again after a probe. endpoint_id, recovered_at.
- `delivery.dead`: a delivery used up its attempts or failed for good. endpoint_id,
  delivery_id, message_id, event_type, attempts, reason, last_status_code. When many die
  at one endpoint in one minute: the rest in one summary per owner with endpoint_id,
  summary: true, count, owner, window_start, window_end.
- `delivery.held`: an ambiguous attempt was held for review (on_ambiguous = hold).
  endpoint_id, delivery_id, message_id, event_type, attempts, reason, owner. One per
  delivery and hold (holds are rare and each needs a person, so no storm bound).
- `tenant.disabled`: a tenant was disabled. tenant_id, reason, disabled_at.

`owner` (in `delivery.dead`, its summaries and `delivery.held`): the endpoint's owner,
else the event type's, else null (nobody owns it: always present, so "no owner" is said).
An endpoint with an `operational_owner` receives only the operational events whose
owner is that one (outbox/sql/relay.py routes them).

Each is published for the tenant that owns the endpoint (or the tenant itself), so a
tenant's own endpoint subscribed to them receives its own trouble and nobody else's.
`*` does not match them: an endpoint gets them only by naming them (`endpoint.*`,
`delivery.dead`, ...).

They are written in the same transaction as the change they report, so they exist
exactly when the change committed. State changes (disable, breaker) are caught by
triggers installed by migration 0009, whichever code path made them; dead deliveries
are reported by the worker with its outcome batch (`report_dead`), one call per batch.

Storms are bounded: at most one `breaker_opened` per endpoint per cooldown, and per
endpoint and minute the first `DEAD_EVENTS_PER_MINUTE` dead deliveries are reported one
by one, the rest in one summary published after the minute (by the relay, or when the
next one dies). A dead delivery OF an operational event reports nothing, so an
operational endpoint that is itself down cannot feed a loop.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

from delivery import queries
from outbox.direct import Statements

DEAD_EVENTS_PER_MINUTE = 3


async def report_dead(conn: Statements, delivery_ids: Sequence[int], *, now: dt.datetime) -> None:
    """Publish `delivery.dead` for deliveries this transaction made dead (storm-bounded)."""
    if delivery_ids:
        await conn.execute(
            queries.REPORT_DEAD_DELIVERIES,
            {"ids": list(delivery_ids), "now": now, "limit": DEAD_EVENTS_PER_MINUTE},
        )


async def report_held(conn: Statements, delivery_ids: Sequence[int], *, now: dt.datetime) -> None:
    """Publish `delivery.held` for deliveries this transaction held, naming the owner."""
    if delivery_ids:
        await conn.execute(queries.REPORT_HELD_DELIVERIES, {"ids": list(delivery_ids), "now": now})
