"""What an operator does to deliveries: search, inspect, replay, discard.

Every function runs in the caller's transaction and writes its audit rows in that
same transaction, so an action and its record commit (or vanish) together.

Replay never rewrites history: it inserts a NEW delivery for the same event and
endpoint (so the receiver sees the same `webhook-id` and can deduplicate) with
`replay_of` pointing at the old row. The old row and its attempts are only read.
Who replayed it, when and why is the audit row, which `show` joins back in.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from sqlalchemy import Connection

from outbox.audit import record_audit_many, require_reason
from outbox.errors import NotFoundError, OperationError, SupersededError
from outbox.feeds import refuse_pushes_to_pull_endpoints
from outbox.schema import DELIVERY_STATES
from outbox.sql import deliveries as queries
from outbox.tenants import scope_params

REPLAYABLE_STATES = ("dead", "discarded")
DISCARDABLE_STATES = ("scheduled", "dead", "held")
# What an operator does to a held delivery (besides discard): the state it goes to.
HELD_ACTIONS = {"confirm": "succeeded", "retry": "scheduled"}
MAX_PAGE = 1000
DEFAULT_BULK_LIMIT = 1000
SAMPLE_SIZE = 5


def _iso(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value else None


@dataclass(frozen=True, slots=True)
class DeliveryFilter:
    """Which deliveries to list or bulk-replay; every field is optional and they combine.

    `tenant` keeps one tenant's deliveries (those of its endpoints) only. It is both the
    operator's filter and a tenant-scoped caller's scope: the queries enforce it.
    """

    states: tuple[str, ...] = ()
    endpoint: str | None = None
    event_type: str | None = None
    error: str | None = None
    message_id: str | None = None  # the event's webhook-id: every delivery and replay of it
    subject: str | None = None  # the document the event is about, from publish(subject=...)
    since: dt.datetime | None = None
    until: dt.datetime | None = None
    unreplayed: bool = False
    before_id: int | None = None
    limit: int = 50
    tenant: str | None = None
    owner: str | None = None  # the endpoint's owner, else the event type's

    def __post_init__(self) -> None:
        unknown = sorted(set(self.states) - set(DELIVERY_STATES))
        if unknown:
            raise OperationError(
                f"unknown state {', '.join(unknown)}: use one of {', '.join(DELIVERY_STATES)}"
            )
        if not 0 < self.limit <= MAX_PAGE:
            raise OperationError(f"limit must be between 1 and {MAX_PAGE}")

    def params(self) -> dict[str, Any]:
        return {
            "states": list(self.states) or None,
            "endpoint": self.endpoint,
            "event_type": self.event_type,
            "error": self.error or None,
            "message_id": self.message_id,
            "subject": self.subject,
            "since": self.since,
            "until": self.until,
            "unreplayed": self.unreplayed,
            "before_id": self.before_id,
            "limit": self.limit,
            "owner": self.owner,
        }

    def describe(self) -> dict[str, Any]:
        data = {key: value for key, value in asdict(self).items() if value not in (None, ())}
        data.pop("limit", None)
        return {k: (v.isoformat() if isinstance(v, dt.datetime) else v) for k, v in data.items()}


@dataclass(frozen=True, slots=True)
class DeliverySummary:
    id: int
    state: str
    attempts: int
    max_attempts: int
    next_attempt_at: dt.datetime
    last_status_code: int | None
    last_error: str | None
    final_reason: str | None
    replay_of: int | None
    created_at: dt.datetime
    updated_at: dt.datetime
    completed_at: dt.datetime | None
    endpoint_uid: str
    endpoint_url: str
    message_id: str
    event_type: str
    tenant: str
    subject: str | None
    owner: str | None

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "tenant": self.tenant,
            "owner": self.owner,
            "state": self.state,
            "attempts": self.attempts,
            "max_attempts": self.max_attempts,
            "next_attempt_at": _iso(self.next_attempt_at),
            "last_status_code": self.last_status_code,
            "last_error": self.last_error,
            "final_reason": self.final_reason,
            "replay_of": self.replay_of,
            "created_at": _iso(self.created_at),
            "updated_at": _iso(self.updated_at),
            "completed_at": _iso(self.completed_at),
            "endpoint": self.endpoint_uid,
            "endpoint_url": self.endpoint_url,
            "message_id": self.message_id,
            "event_type": self.event_type,
            "subject": self.subject,
        }


_SUMMARY_FIELDS = tuple(DeliverySummary.__dataclass_fields__)


def _summary(row: Any) -> DeliverySummary:
    return DeliverySummary(**{name: row[name] for name in _SUMMARY_FIELDS})


@dataclass(frozen=True, slots=True)
class DeliveryDetail:
    delivery: DeliverySummary
    payload: Any
    event_created_at: dt.datetime
    event_relayed_at: dt.datetime | None
    locked_by: str | None
    lease_expires_at: dt.datetime | None
    attempts: list[dict[str, Any]]
    replays: list[dict[str, Any]]

    def as_json(self) -> dict[str, Any]:
        return {
            **self.delivery.as_json(),
            "locked_by": self.locked_by,
            "lease_expires_at": _iso(self.lease_expires_at),
            "event": {
                "message_id": self.delivery.message_id,
                "event_type": self.delivery.event_type,
                "payload": self.payload,
                "created_at": _iso(self.event_created_at),
                "relayed_at": _iso(self.event_relayed_at),
            },
            "attempt_history": self.attempts,
            "replays": self.replays,
        }


def search_deliveries(conn: Connection, flt: DeliveryFilter) -> list[DeliverySummary]:
    """Newest first; for the next page pass `before_id` = the last id of this one."""
    params = {**flt.params(), **scope_params(conn, flt.tenant)}
    rows = conn.execute(queries.SEARCH_DELIVERIES, params).mappings()
    return [_summary(row) for row in rows]


def count_deliveries(conn: Connection, flt: DeliveryFilter) -> int:
    params = {**flt.params(), **scope_params(conn, flt.tenant)}
    return int(conn.execute(queries.COUNT_DELIVERIES, params).scalar_one())


def get_delivery(conn: Connection, delivery_id: int, *, scope: str | None = None) -> DeliveryDetail:
    """One delivery; with `scope` (a tenant uid) only if it is that tenant's, else not found."""
    row = (
        conn.execute(queries.SELECT_DELIVERY, {"id": delivery_id, **scope_params(conn, scope)})
        .mappings()
        .first()
    )
    if row is None:
        raise NotFoundError(f"no delivery {delivery_id}; `outbox deliveries list` shows the ids")
    attempts = [
        {**dict(a), "started_at": _iso(a["started_at"])}
        for a in conn.execute(queries.SELECT_ATTEMPTS, {"id": delivery_id}).mappings()
    ]
    replays = [
        {**dict(r), "created_at": _iso(r["created_at"])}
        for r in conn.execute(queries.SELECT_REPLAYS, {"id": delivery_id}).mappings()
    ]
    return DeliveryDetail(
        delivery=_summary(row),
        payload=row["payload"],
        event_created_at=row["event_created_at"],
        event_relayed_at=row["event_relayed_at"],
        locked_by=row["locked_by"],
        lease_expires_at=row["lease_expires_at"],
        attempts=attempts,
        replays=replays,
    )


@dataclass(slots=True)
class ReplayResult:
    """What a replay did (or, with dry_run, would do)."""

    dry_run: bool
    matched: int
    replayed: list[tuple[int, int]] = field(default_factory=list)  # (old id, new id)
    sample: list[DeliverySummary] = field(default_factory=list)
    first_due: dt.datetime | None = None
    last_due: dt.datetime | None = None
    skipped: int = 0  # bulk: replayed by someone else between the count and the lock
    # bulk: left out (or, in a dry run, would be) because a newer event superseded them;
    # delivery id -> the newer event's message id. Empty when forced.
    superseded: dict[int, str] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "matched": self.matched,
            "skipped": self.skipped,
            "superseded": len(self.superseded),
            "superseded_sample": [
                {"delivery": old, "newer_message_id": newer}
                for old, newer in list(self.superseded.items())[:SAMPLE_SIZE]
            ],
            "replayed": [{"delivery": old, "replay": new} for old, new in self.replayed],
            "sample": [item.as_json() for item in self.sample],
            "first_due": _iso(self.first_due),
            "last_due": _iso(self.last_due),
        }


def _states(conn: Connection, ids: list[int], scope: str | None) -> dict[int, str]:
    """States of the deliveries in scope: another tenant's id is simply missing (not found)."""
    rows = conn.execute(
        queries.SELECT_DELIVERY_STATES, {"ids": ids, **scope_params(conn, scope)}
    ).all()
    return {int(row.id): str(row.state) for row in rows}


def _allowed_replay_states(force: bool) -> tuple[str, ...]:
    return (*REPLAYABLE_STATES, "succeeded") if force else REPLAYABLE_STATES


def _spread(now: dt.datetime, count: int, rate_per_minute: float | None) -> list[dt.datetime]:
    """Start times at most `rate_per_minute` apart, so a bulk replay cannot flood a partner."""
    if not rate_per_minute:
        return [now] * count
    step = dt.timedelta(seconds=60.0 / rate_per_minute)
    return [now + step * index for index in range(count)]


PENDING_STATES = ("scheduled", "in_flight")


def superseded_by(conn: Connection, ids: Sequence[int]) -> dict[int, str]:
    """Which of these deliveries a newer event supersedes: delivery id -> that event's
    message id. Newer means: same tenant and event type, same subject or same ordering
    key, published later, and delivered (succeeded) to the same endpoint. The caller
    passes ids already in its scope. Index lookups only (see SELECT_SUPERSEDING_EVENTS)."""
    if not ids:
        return {}
    rows = conn.execute(queries.SELECT_SUPERSEDING_EVENTS, {"ids": list(ids)}).all()
    return {int(row.id): str(row.message_id) for row in rows}


def replay(
    conn: Connection,
    ids: Sequence[int],
    *,
    actor: str,
    reason: str | None,
    now: dt.datetime,
    force: bool = False,
    again: bool = False,
    rate_per_minute: float | None = None,
    request_id: str | None = None,
    details: dict[str, Any] | None = None,
    skip_replayed: bool = False,
    scope: str | None = None,
    skip_superseded: bool = False,
) -> ReplayResult:
    """Replay each delivery as a new row; all or nothing, with one audit row per delivery.

    Dead and discarded deliveries can be replayed; a succeeded one only with `force`
    (the partner already has it). Scheduled and in-flight ones are still being
    delivered, so replaying them would only send the same message twice.

    Exactly once per request: the rows are locked first, so a concurrent replay of the
    same delivery (another shell, the API) waits and then sees this one's replay. A
    delivery whose replay is still pending is never replayed again (a unique index
    holds that even against other code); one replayed before needs `again`.
    `skip_replayed` (bulk replay) leaves those out instead of refusing.

    A delivery whose event a newer one superseded (same type and subject or ordering
    key, delivered to the same endpoint since) is refused with that event's message id:
    the replay would hand the receiver an older state after the newer one. `force` sends
    it anyway; `skip_superseded` (bulk replay) leaves it out.
    """
    why = require_reason(reason, "a replay")
    wanted = list(dict.fromkeys(int(i) for i in ids))
    if not wanted:
        raise OperationError("give at least one delivery id to replay")
    # Locked and scoped: another tenant's id is simply missing (not found).
    states = {
        int(row.id): str(row.state)
        for row in conn.execute(
            queries.LOCK_DELIVERIES_FOR_REPLAY, {"ids": wanted, **scope_params(conn, scope)}
        )
    }
    missing = [i for i in wanted if i not in states]
    if missing:
        raise NotFoundError(f"no delivery {', '.join(map(str, missing))}; nothing was replayed")
    allowed = _allowed_replay_states(force)
    refused = {i: states[i] for i in wanted if states[i] not in allowed}
    if refused:
        listed = ", ".join(f"{i} is {state}" for i, state in refused.items())
        hint = (
            " (replaying a succeeded delivery sends it again: add --force if that is meant)"
            if "succeeded" in refused.values()
            else ""
        )
        raise OperationError(f"cannot replay: {listed}{hint}; nothing was replayed")
    latest = {
        int(row.replay_of): (int(row.id), str(row.state))
        for row in conn.execute(queries.SELECT_LATEST_REPLAYS, {"ids": wanted})
    }
    skipped = [i for i in wanted if i in latest] if skip_replayed else []
    wanted = [i for i in wanted if i not in skipped]
    pending = {i: latest[i] for i in wanted if i in latest and latest[i][1] in PENDING_STATES}
    if pending:
        listed = ", ".join(f"{i} has replay {new} ({state})" for i, (new, state) in pending.items())
        raise OperationError(
            f"already being replayed: {listed}; wait for it to finish (`outbox deliveries show "
            "ID`) or discard that replay first; nothing was replayed"
        )
    done = {i: latest[i] for i in wanted if i in latest}
    if done and not again:
        listed = ", ".join(f"{i} as {new} ({state})" for i, (new, state) in done.items())
        raise OperationError(
            f"already replayed: {listed}; replaying again sends the message again: add "
            '--again (API: "again": true) if that is meant; nothing was replayed'
        )
    superseded = {} if force else superseded_by(conn, wanted)
    if superseded and not skip_superseded:
        listed = ", ".join(f"{i} by {newer}" for i, newer in superseded.items())
        raise SupersededError(
            f"superseded: {listed} (a newer event of the same type and subject or ordering "
            "key was delivered to the same endpoint since); replaying would send the older "
            'state after it: add --force (API: "force": true) if that is meant; nothing was '
            "replayed",
            superseded,
        )
    wanted = [i for i in wanted if i not in superseded]
    if not wanted:
        return ReplayResult(dry_run=False, matched=0, skipped=len(skipped), superseded=superseded)
    refuse_pushes_to_pull_endpoints(conn, wanted)
    due = _spread(now, len(wanted), rate_per_minute)
    rows = conn.execute(
        queries.INSERT_REPLAYS,
        {
            "ids": wanted,
            "due": due,
            "now": now,
            "allowed": list(allowed),
            **scope_params(conn, scope),
        },
    ).all()
    if len(rows) != len(wanted):
        # A row changed state between the check and the insert; the caller rolls back.
        raise OperationError("deliveries changed while replaying; nothing was replayed, try again")
    created = {int(row.replay_of): int(row.id) for row in rows}
    replayed = [(old, created[old]) for old in wanted]
    record_audit_many(
        conn,
        actor=actor,
        action="delivery.replay",
        target_type="delivery",
        targets=[
            (
                str(old),
                {
                    "replay_id": new,
                    "forced": force,
                    **({"again": True} if old in done else {}),
                    **(details or {}),
                },
            )
            for old, new in replayed
        ],
        reason=why,
        request_id=request_id,
    )
    return ReplayResult(
        dry_run=False,
        matched=len(wanted),
        replayed=replayed,
        first_due=due[0],
        last_due=due[-1],
        skipped=len(skipped),
        superseded=superseded,
    )


def bulk_replay(
    conn: Connection,
    flt: DeliveryFilter,
    *,
    actor: str,
    reason: str | None,
    now: dt.datetime,
    dry_run: bool = False,
    force: bool = False,
    max_count: int = DEFAULT_BULK_LIMIT,
    rate_per_minute: float | None = None,
    request_id: str | None = None,
) -> ReplayResult:
    """Replay what a filter matches: dead ones by default, each at most once.

    Deliveries a newer event superseded (see `replay`) are left out unless `force`; the
    result lists them (a dry run too). Deliveries that already have a replay are skipped,
    so running the same bulk replay twice does not send anything twice, even at the same
    moment: `replay` locks the rows and leaves out those another run replayed meanwhile. A dry run
    counts and samples and writes nothing (not even an audit row: nothing happened).
    """
    why = require_reason(reason, "a replay")
    allowed = _allowed_replay_states(force)
    states = flt.states or ("dead",)
    refused = sorted(set(states) - set(allowed))
    if refused:
        raise OperationError(
            f"cannot bulk-replay {', '.join(refused)} deliveries"
            + (": add --force to replay succeeded ones" if refused == ["succeeded"] else "")
        )
    if not 0 < max_count <= 100_000:
        raise OperationError("the bulk replay limit must be between 1 and 100000")
    matching = DeliveryFilter(
        states=states,
        endpoint=flt.endpoint,
        event_type=flt.event_type,
        error=flt.error,
        message_id=flt.message_id,
        subject=flt.subject,
        since=flt.since,
        until=flt.until,
        unreplayed=True,
        limit=SAMPLE_SIZE,
        tenant=flt.tenant,
    )
    matched = count_deliveries(conn, matching)
    sample = search_deliveries(conn, matching)
    ids: list[int] = []
    before: int | None = None
    while matched and len(ids) < max_count:
        page = replace(matching, limit=min(MAX_PAGE, max_count - len(ids)), before_id=before)
        batch = search_deliveries(conn, page)
        ids.extend(item.id for item in batch)
        if len(batch) < page.limit:
            break
        before = batch[-1].id
    if dry_run or not ids:
        # A dry run counts what a newer event superseded: those would be left out.
        superseded = {} if force else superseded_by(conn, ids)
        due = _spread(now, len(ids) - len(superseded), rate_per_minute)
        return ReplayResult(
            dry_run=dry_run,
            matched=matched,
            sample=sample,
            first_due=due[0] if due else None,
            last_due=due[-1] if due else None,
            # none left: all replayed by someone else since the count
            skipped=0 if dry_run else matched,
            superseded=superseded,
        )
    result = replay(
        conn,
        ids,
        actor=actor,
        reason=why,
        now=now,
        force=force,
        rate_per_minute=rate_per_minute,
        request_id=request_id,
        details={"bulk": True, "filter": flt.describe()},
        skip_replayed=True,
        scope=flt.tenant,
        skip_superseded=True,
    )
    result.matched = matched
    result.sample = sample
    return result


def discard(
    conn: Connection,
    ids: Sequence[int],
    *,
    actor: str,
    reason: str | None,
    now: dt.datetime,
    request_id: str | None = None,
    scope: str | None = None,
) -> list[int]:
    """Give up on scheduled, dead or held deliveries for good; all or nothing, audited."""
    why = require_reason(reason, "a discard")
    wanted = list(dict.fromkeys(int(i) for i in ids))
    if not wanted:
        raise OperationError("give at least one delivery id to discard")
    states = _states(conn, wanted, scope)
    missing = [i for i in wanted if i not in states]
    if missing:
        raise NotFoundError(f"no delivery {', '.join(map(str, missing))}; nothing was discarded")
    refused = {i: states[i] for i in wanted if states[i] not in DISCARDABLE_STATES}
    if refused:
        listed = ", ".join(f"{i} is {state}" for i, state in refused.items())
        raise OperationError(
            f"cannot discard: {listed} (only scheduled, dead or held deliveries can be); "
            "nothing was discarded"
        )
    done = conn.execute(
        queries.DISCARD_DELIVERIES,
        {"ids": wanted, "reason": why, "now": now, **scope_params(conn, scope)},
    ).scalars()
    discarded = sorted(int(i) for i in done)
    if len(discarded) != len(wanted):
        raise OperationError(
            "deliveries changed while discarding; nothing was discarded, try again"
        )
    record_audit_many(
        conn,
        actor=actor,
        action="delivery.discard",
        target_type="delivery",
        targets=[(str(i), {"previous_state": states[i]}) for i in discarded],
        reason=why,
        request_id=request_id,
    )
    return discarded


def resolve_held(
    conn: Connection,
    ids: Sequence[int],
    *,
    action: str,
    actor: str,
    reason: str | None,
    now: dt.datetime,
    request_id: str | None = None,
    scope: str | None = None,
) -> list[int]:
    """Settle held deliveries: `confirm` (a person checked it arrived: succeeded, with the
    reason) or `retry` (the same delivery is sent again now, attempts kept, same
    webhook-id). All or nothing, audited with who, when and why. Discard is `discard`."""
    if action not in HELD_ACTIONS:
        raise OperationError(
            f"unknown action {action!r} for a held delivery: use confirm, retry or discard"
        )
    why = require_reason(reason, f"a held delivery's {action}")
    wanted = list(dict.fromkeys(int(i) for i in ids))
    if not wanted:
        raise OperationError(f"give at least one held delivery id to {action}")
    states = _states(conn, wanted, scope)
    missing = [i for i in wanted if i not in states]
    if missing:
        raise NotFoundError(f"no delivery {', '.join(map(str, missing))}; nothing was changed")
    refused = {i: states[i] for i in wanted if states[i] != "held"}
    if refused:
        listed = ", ".join(f"{i} is {state}" for i, state in refused.items())
        raise OperationError(
            f"cannot {action}: {listed} (only held deliveries can be); nothing was changed"
        )
    done = conn.execute(
        queries.RESOLVE_HELD,
        {
            "ids": wanted,
            "to_state": HELD_ACTIONS[action],
            "reason": why,
            "now": now,
            **scope_params(conn, scope),
        },
    ).scalars()
    settled = sorted(int(i) for i in done)
    if len(settled) != len(wanted):
        raise OperationError("deliveries changed meanwhile; nothing was changed, try again")
    record_audit_many(
        conn,
        actor=actor,
        action=f"delivery.{action}_held",
        target_type="delivery",
        targets=[
            (str(i), {"previous_state": "held", "state": HELD_ACTIONS[action]}) for i in settled
        ],
        reason=why,
        request_id=request_id,
    )
    return settled
