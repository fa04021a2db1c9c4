"""Outcome writes are fenced by the claim itself (issue 15).

The sequence that used to lose data: worker W sends and gets 200; its lease expires;
the reaper reschedules the delivery; the delivery is claimed again (by W itself or by
another worker) and that attempt gets 503; then W's first result arrives. Only the
newest claim may decide the delivery's state; the late result is history, with its
own attempt number.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.http import build_http_client
from delivery.reaper import Reaper
from delivery.receiver import Receiver
from delivery.worker import Worker, WorkerConfig
from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.db import make_engine
from outbox.endpoints import delete_endpoint
from outbox.migrate import upgrade
from outbox.relay import Relay
from tests.helpers import LOOPBACK, add_endpoint, rows, scalar


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    """The production wire only: fencing is decided in the database after the response,
    the same whichever transport carried it (tests/delivery/test_rules.py runs the
    response rules on both)."""
    async with build_http_client(
        max_connections=10, timeout=5, allowed_networks=LOOPBACK, transport="wire"
    ) as c:
        yield c


def worker(
    async_engine: AsyncEngine,
    http: httpx.AsyncClient,
    box: SecretBox,
    clock: ManualClock,
    name: str,
) -> Worker:
    config = WorkerConfig(worker_id=name, lease_seconds=60, retry_schedule=(10.0,))
    return Worker(async_engine, http, box, clock, config)


async def one_delivery(
    engine: Engine, async_engine: AsyncEngine, box: SecretBox, clock: ManualClock, url: str
) -> None:
    add_endpoint(engine, box, url)
    with engine.begin() as conn:
        publish(conn, "order.created", {"id": 1})
    await Relay(async_engine, clock).run_until_idle()


def delivery(engine: Engine) -> dict[str, Any]:
    return dict(rows(engine, "SELECT * FROM deliveries")[0])


def history(engine: Engine) -> list[tuple[int, int, str]]:
    return [
        (a["attempt_number"], a["status_code"], a["worker_id"])
        for a in rows(engine, "SELECT * FROM delivery_attempts ORDER BY attempt_number")
    ]


@pytest.mark.parametrize(
    ("second_name", "order"),
    [
        ("W", "stale-first"),
        ("W", "fresh-first"),
        ("W", "one-batch"),
        ("W2", "stale-first"),
        ("W2", "fresh-first"),
    ],
)
async def test_a_late_result_never_overrides_the_newest_claim(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
    second_name: str,
    order: str,
) -> None:
    url = receiver.route("/hook", status=200)
    await one_delivery(engine, async_engine, box, clock, url)
    first = worker(async_engine, http, box, clock, "W")
    (claim_1,) = await first.claim(10)
    result_1 = await first.attempt(claim_1)  # 200, but W stalls before recording it
    assert result_1.status_code == 200
    clock.advance(61)
    assert await Reaper(async_engine, clock).run_once() == [1]

    second = first if second_name == "W" else worker(async_engine, http, box, clock, "W2")
    receiver.route("/hook", status=503)
    (claim_2,) = await second.claim(10)
    assert claim_2.claim == claim_1.claim + 1
    result_2 = await second.attempt(claim_2)
    assert result_2.status_code == 503

    if order == "stale-first":  # the exact order: the first result arrives last-but-one
        stale = await first.record([(claim_1, result_1)])
        fresh = await second.record([(claim_2, result_2)])
        assert (stale.lost_lease, stale.succeeded) == (1, 0)
        assert (fresh.lost_lease, fresh.scheduled) == (0, 1)
    elif order == "fresh-first":
        fresh = await second.record([(claim_2, result_2)])
        stale = await first.record([(claim_1, result_1)])
        assert (fresh.lost_lease, fresh.scheduled) == (0, 1)
        assert (stale.lost_lease, stale.succeeded) == (1, 0)
    else:  # one worker: both outcomes buffered into one write
        both = await first.record([(claim_1, result_1), (claim_2, result_2)])
        assert (both.lost_lease, both.scheduled, both.succeeded) == (1, 1, 0)

    row = delivery(engine)
    assert (row["state"], row["attempts"], row["last_status_code"]) == ("scheduled", 1, 503)
    assert (row["locked_by"], row["lease_expires_at"]) == (None, None)
    assert row["next_attempt_at"] > clock.now()
    # Both requests are history, each with its own number: the claim that made it.
    assert history(engine) == [(1, 200, "W"), (2, 503, second_name)]


async def test_a_release_with_a_stale_claim_leaves_the_newer_claim_alone(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    await one_delivery(engine, async_engine, box, clock, receiver.route("/hook"))
    w = worker(async_engine, http, box, clock, "W")
    (old,) = await w.claim(10)
    clock.advance(61)
    assert await Reaper(async_engine, clock).run_once() == [1]
    (new,) = await w.claim(10)  # same worker, same delivery, a new claim
    assert await w.release([old]) == 0
    row = delivery(engine)
    assert (row["state"], row["locked_by"], row["claims"]) == ("in_flight", "W", new.claim)
    assert await w.release([new]) == 1
    assert delivery(engine)["state"] == "scheduled"


async def test_a_release_after_the_outcome_was_recorded_changes_nothing(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    await one_delivery(engine, async_engine, box, clock, receiver.route("/hook"))
    w = worker(async_engine, http, box, clock, "W")
    (claimed,) = await w.claim(10)
    assert (await w.record([(claimed, await w.attempt(claimed))])).succeeded == 1
    assert await w.release([claimed]) == 0  # a shutdown racing the write: too late
    row = delivery(engine)
    assert (row["state"], row["attempts"], row["locked_by"]) == ("succeeded", 1, None)


async def test_the_reaper_leaves_a_claim_taken_again_by_the_same_worker_alone(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    await one_delivery(engine, async_engine, box, clock, receiver.route("/hook"))
    w = worker(async_engine, http, box, clock, "W")
    reaper = Reaper(async_engine, clock)
    await w.claim(10)
    clock.advance(61)
    assert await reaper.run_once() == [1]
    (again,) = await w.claim(10)
    clock.advance(30)  # the new lease still holds
    assert await reaper.run_once() == []
    assert (await w.record([(again, await w.attempt(again))])).succeeded == 1
    assert delivery(engine)["state"] == "succeeded"


async def test_a_lease_holds_up_to_its_expiry_instant(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    await one_delivery(engine, async_engine, box, clock, receiver.route("/hook"))
    await worker(async_engine, http, box, clock, "W").claim(10)
    reaper = Reaper(async_engine, clock)
    clock.advance(60)  # exactly the lease: still held
    assert await reaper.run_once() == []
    clock.advance(0.001)
    assert await reaper.run_once() == [1]


async def test_writing_the_same_outcome_twice_adds_one_attempt(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    """A retried write (its first commit's acknowledgement lost) neither fails nor repeats."""
    await one_delivery(engine, async_engine, box, clock, receiver.route("/hook", status=500))
    w = worker(async_engine, http, box, clock, "W")
    (claimed,) = await w.claim(10)
    result = await w.attempt(claimed)
    assert (await w.record([(claimed, result)])).scheduled == 1
    again = await w.record([(claimed, result)])
    assert (again.lost_lease, again.scheduled) == (1, 0)
    assert history(engine) == [(1, 500, "W")]
    assert delivery(engine)["attempts"] == 1


def test_attempt_numbers_are_unique_per_delivery(engine: Engine, box: SecretBox) -> None:
    add_endpoint(engine, box, "http://127.0.0.1:9/x")
    with engine.begin() as conn:
        publish(conn, "order.created", {"id": 1})
    # Written through SQL on purpose: the index, not the code, is what is tested here.
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO deliveries (event_id, endpoint_id, tenant_id, max_attempts,"
                " next_attempt_at) SELECT o.id, e.id, e.tenant_id, 5, now()"
                " FROM outbox_events o, endpoints e;"
                "INSERT INTO delivery_attempts (delivery_id, attempt_number, started_at,"
                " duration_ms, outcome, worker_id) VALUES (1, 1, now(), 1, 'retryable', 'w')"
            )
        )
    with (
        pytest.raises(IntegrityError, match="uq_delivery_attempts_delivery_id_attempt_number"),
        engine.begin() as conn,
    ):
        conn.execute(
            text(
                "INSERT INTO delivery_attempts (delivery_id, attempt_number, started_at,"
                " duration_ms, outcome, worker_id) VALUES (1, 1, now(), 1, 'succeeded', 'w')"
            )
        )


def test_upgrade_renumbers_repeated_attempt_numbers_and_starts_claims_after_them(
    empty_database_url: str,
) -> None:
    """Before 0007 a late write could repeat an attempt number; the upgrade renumbers such
    rows in recorded order and each delivery's claim counter continues after them."""
    engine = make_engine(empty_database_url)
    try:
        upgrade(engine, "0006")
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO endpoints (uid, url, event_types, signing_secret, tenant_id)"
                    " SELECT 'ep', 'http://127.0.0.1:9/x', ARRAY['*'], 'enc', id FROM tenants;"
                    "INSERT INTO outbox_events (message_id, event_type, payload, tenant_id)"
                    " SELECT m, 't', '{}', t.id FROM tenants t, unnest(ARRAY['m1', 'm2']) m;"
                    "INSERT INTO deliveries (event_id, endpoint_id, tenant_id, max_attempts,"
                    " next_attempt_at, attempts) SELECT o.id, e.id, e.tenant_id, 5, now(), 1"
                    " FROM outbox_events o, endpoints e ORDER BY o.id;"
                    "INSERT INTO delivery_attempts (delivery_id, attempt_number, started_at,"
                    " duration_ms, status_code, outcome, worker_id) VALUES"
                    " (1, 1, now(), 1, 503, 'retryable', 'fresh'),"
                    " (1, 1, now(), 1, 200, 'succeeded', 'late'),"
                    " (2, 1, now(), 1, 500, 'retryable', 'w')"
                )
            )
        upgrade(engine)
        numbered = rows(
            engine,
            "SELECT delivery_id, attempt_number, worker_id FROM delivery_attempts ORDER BY id",
        )
        assert [(r["delivery_id"], r["attempt_number"], r["worker_id"]) for r in numbered] == [
            (1, 1, "fresh"),
            (1, 2, "late"),
            (2, 1, "w"),
        ]
        assert [r["claims"] for r in rows(engine, "SELECT claims FROM deliveries ORDER BY id")] == [
            2,
            1,
        ]
        assert scalar(engine, "SELECT count(*) FROM deliveries WHERE state = 'scheduled'") == 2
    finally:
        engine.dispose()


async def test_an_endpoint_deleted_while_its_request_is_out_spoils_no_other_outcome(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`outbox endpoints delete --force` while a request is out: the deleted delivery's
    outcome has nowhere to go (its history went with it), and the batch it shares with
    other endpoints' outcomes is written all the same, the first time."""
    gone = add_endpoint(engine, box, receiver.route("/gone"), "gone.*")
    add_endpoint(engine, box, receiver.route("/kept"), "kept.*")
    with engine.begin() as conn:
        publish(conn, "gone.created", {"id": 1})
        publish(conn, "kept.created", {"id": 2})
    await Relay(async_engine, clock).run_until_idle()
    w = worker(async_engine, http, box, clock, "W")
    claimed = await w.claim(10)
    results = [await w.attempt(item) for item in claimed]
    with engine.begin() as conn:
        delete_endpoint(conn, gone.endpoint.uid, actor="ops", reason="retired", force=True)

    stats = await w.record(list(zip(claimed, results, strict=True)))

    assert (stats.succeeded, stats.lost_lease) == (1, 1)
    assert [d["state"] for d in rows(engine, "SELECT state FROM deliveries")] == ["succeeded"]
    assert history(engine) == [(1, 200, "W")]
    assert "1 outcomes were for deliveries deleted while their request was out" in caplog.text
