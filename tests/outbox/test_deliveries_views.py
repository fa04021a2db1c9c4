"""What `deliveries list/show` and the admin API print: every JSON key and value, exactly.

Automation reads these documents, so a renamed key or a dropped value is a breaking
change; the filter's own refusals and its description (kept in bulk-replay audit rows)
are pinned too.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import deliveries as delivery_ops
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.errors import NotFoundError, OperationError
from tests.helpers import add_endpoint, rows
from tests.outbox.deliveries_helpers import deliveries_in, refused

URL = "https://partner.example/hooks"


async def test_a_delivery_shows_every_field_under_its_documented_key(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    endpoint = add_endpoint(engine, box, URL, "order.*").endpoint
    [dead, flying] = await deliveries_in(engine, async_engine, clock, endpoint.uid,
                                         ["dead", "in_flight"])  # fmt: skip
    now = clock.now()
    second = dt.timedelta(seconds=1)
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE deliveries SET next_attempt_at = :t1, created_at = :t2, updated_at = :t3,"
                " completed_at = :t4, last_status_code = 500, last_error = 'HTTP 500',"
                " max_attempts = 7 WHERE id = :id"
            ),
            {"t1": now, "t2": now + second, "t3": now + 2 * second, "t4": now + 3 * second,
             "id": dead},
        )  # fmt: skip
        conn.execute(
            text(
                "INSERT INTO delivery_attempts (delivery_id, attempt_number, started_at,"
                " duration_ms, status_code, outcome, error, response_excerpt, worker_id)"
                " VALUES (:id, 1, :at, 12, 500, 'retryable', 'HTTP 500', 'oops', 'w1')"
            ),
            {"id": dead, "at": now - second},
        )
        conn.execute(
            text(
                "UPDATE outbox_events SET created_at = :c, relayed_at = :r"
                " WHERE id = (SELECT event_id FROM deliveries WHERE id = :id)"
            ),
            {"c": now - 5 * second, "r": now - 4 * second, "id": dead},
        )
    event = rows(
        engine,
        "SELECT ev.message_id, ev.event_type, ev.payload FROM deliveries d"
        " JOIN outbox_events ev ON ev.id = d.event_id WHERE d.id = :id",
        id=dead,
    )[0]
    with engine.begin() as conn:
        [(_, replay_id)] = delivery_ops.replay(
            conn, [dead], actor="al", reason="why", now=now
        ).replayed
    replay_created = rows(engine, "SELECT created_at FROM deliveries WHERE id = :id", id=replay_id)

    summary = {
        "id": dead,
        "tenant": "default",
        "state": "dead",
        "attempts": 1,
        "max_attempts": 7,
        "next_attempt_at": now.isoformat(),
        "last_status_code": 500,
        "last_error": "HTTP 500",
        "final_reason": "500 Internal Server Error",
        "replay_of": None,
        "created_at": (now + second).isoformat(),
        "updated_at": (now + 2 * second).isoformat(),
        "completed_at": (now + 3 * second).isoformat(),
        "endpoint": endpoint.uid,
        "endpoint_url": URL,
        "message_id": event["message_id"],
        "event_type": "order.created",
        "subject": None,
        "owner": None,
    }
    with engine.connect() as conn:
        listed = delivery_ops.search_deliveries(conn, delivery_ops.DeliveryFilter(states=("dead",)))
        shown = delivery_ops.get_delivery(conn, dead).as_json()
        leased = delivery_ops.get_delivery(conn, flying).as_json()
        with refused(NotFoundError, "no delivery 999; `outbox deliveries list` shows the ids"):
            delivery_ops.get_delivery(conn, 999)
    assert [item.as_json() for item in listed] == [summary]
    assert shown == {
        **summary,
        "locked_by": None,
        "lease_expires_at": None,
        "event": {
            "message_id": event["message_id"],
            "event_type": "order.created",
            "payload": event["payload"],
            "created_at": (now - 5 * second).isoformat(),
            "relayed_at": (now - 4 * second).isoformat(),
        },
        "attempt_history": [
            {
                "attempt_number": 1,
                "started_at": (now - second).isoformat(),
                "duration_ms": 12,
                "status_code": 500,
                "outcome": "retryable",
                "error": "HTTP 500",
                "response_excerpt": "oops",
                "request_headers": {},
                "worker_id": "w1",
            }
        ],
        "replays": [
            {
                "id": replay_id,
                "state": "scheduled",
                "created_at": replay_created[0]["created_at"].isoformat(),
                "actor": "al",
                "reason": "why",
            }
        ],
    }
    lease = rows(engine, "SELECT lease_expires_at FROM deliveries WHERE id = :id", id=flying)
    assert (leased["locked_by"], leased["lease_expires_at"]) == (
        "w1",
        lease[0]["lease_expires_at"].isoformat(),
    )
    assert leased["completed_at"] is None and leased["event"]["payload"] == {"n": 1}

    with engine.begin() as conn:
        dry = delivery_ops.bulk_replay(
            conn, delivery_ops.DeliveryFilter(states=("dead",)), actor="a", reason="r", now=now,
            dry_run=True,
        )  # fmt: skip
    # The original has a replay now, so nothing is left to bulk-replay.
    assert dry.as_json() == {
        "dry_run": True,
        "matched": 0,
        "skipped": 0,
        "superseded": 0,
        "superseded_sample": [],
        "replayed": [],
        "sample": [],
        "first_due": None,
        "last_due": None,
    }


def test_a_filter_refuses_unknown_states_and_bad_limits_and_describes_itself() -> None:
    with refused(
        OperationError,
        "unknown state lost, zzz: use one of scheduled, in_flight, succeeded, dead, discarded,"
        " held",
    ):
        delivery_ops.DeliveryFilter(states=("dead", "zzz", "lost"))
    for wrong in (0, delivery_ops.MAX_PAGE + 1):
        with refused(OperationError, "limit must be between 1 and 1000"):
            delivery_ops.DeliveryFilter(limit=wrong)
    assert delivery_ops.DeliveryFilter(limit=1).limit == 1
    assert delivery_ops.DeliveryFilter(limit=delivery_ops.MAX_PAGE).limit == delivery_ops.MAX_PAGE
    since = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    described = delivery_ops.DeliveryFilter(
        states=("dead",), event_type="a.b", since=since, limit=7, tenant="acme"
    ).describe()
    # Empty values and the page size are left out; times are ISO 8601.
    assert described == {
        "states": ("dead",),
        "event_type": "a.b",
        "since": "2026-01-02T03:04:05+00:00",
        "unreplayed": False,
        "tenant": "acme",
    }
