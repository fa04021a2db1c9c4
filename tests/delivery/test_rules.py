"""Delivery rules end to end: a real PostgreSQL, real receivers on 127.0.0.1, a manual clock.

Retries never sleep: the test moves the clock to each delivery's `next_attempt_at`.
Only the HTTP deadline runs in real time, with short per-endpoint timeouts.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import email.utils
import itertools
import re
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine
from standardwebhooks import Webhook

from delivery.http import build_http_client
from delivery.policy import format_duration
from delivery.reaper import Reaper, ReaperConfig
from delivery.receiver import Receiver
from delivery.worker import Worker, WorkerConfig
from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.endpoint_rules import DeliveryRules, set_delivery_rules
from outbox.endpoints import set_enabled
from outbox.relay import Relay, RelayConfig
from tests.helpers import LOOPBACK, WIRE_ONLY, add_endpoint, rows, scalar

FAST = DeliveryRules(max_attempts=3, retry_schedule=(10.0,))


@pytest.fixture
async def http(transport: str) -> AsyncIterator[httpx.AsyncClient]:
    # The one place these tests build a client (a later SSRF guard needs loopback allowed).
    async with build_http_client(
        max_connections=100, timeout=5, allowed_networks=LOOPBACK, transport=transport
    ) as client:
        yield client


def make_worker(
    async_engine: AsyncEngine,
    http: httpx.AsyncClient,
    box: SecretBox,
    clock: ManualClock,
    **config: Any,
) -> Worker:
    return Worker(async_engine, http, box, clock, WorkerConfig(**config))


def endpoint_with_rules(
    engine: Engine, box: SecretBox, url: str, rules: DeliveryRules, events: str = "*"
) -> str:
    uid = add_endpoint(engine, box, url, events).endpoint.uid
    with engine.begin() as conn:
        set_delivery_rules(conn, uid, rules, actor="test")
    return uid


def publish_one(engine: Engine, event_type: str = "order.created", **payload: Any) -> str:
    with engine.begin() as conn:
        return publish(conn, event_type, payload or {"id": 1})


async def drive(
    worker: Worker, engine: Engine, clock: ManualClock, delivery_id: int, limit: int = 20
) -> dict[str, Any]:
    """Attempt a delivery until it is final, moving the clock to each retry (no sleeping)."""
    for _ in range(limit):
        await worker.run_once()
        delivery = rows(engine, "SELECT * FROM deliveries WHERE id = :id", id=delivery_id)[0]
        if delivery["state"] != "scheduled":
            return delivery
        clock.set(max(clock.now(), delivery["next_attempt_at"]))
    raise AssertionError(f"delivery {delivery_id} still scheduled after {limit} passes")


def attempts_of(engine: Engine, delivery_id: int) -> list[dict[str, Any]]:
    return [
        dict(row)
        for row in rows(
            engine,
            "SELECT * FROM delivery_attempts WHERE delivery_id = :id ORDER BY attempt_number",
            id=delivery_id,
        )
    ]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def span(attempts: list[dict[str, Any]]) -> str:
    return format_duration((attempts[-1]["started_at"] - attempts[0]["started_at"]).total_seconds())


# -- one test per row of the status-code table -------------------------------------


@pytest.mark.parametrize("status", [200, 201, 204])
async def test_2xx_succeeds_on_the_first_attempt(
    status: int,
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    endpoint_with_rules(engine, box, receiver.route("/ok", status=status), FAST)
    publish_one(engine)
    await Relay(async_engine, clock).run_until_idle()
    delivery = await drive(make_worker(async_engine, http, box, clock), engine, clock, 1)
    assert (delivery["state"], delivery["attempts"], delivery["final_reason"]) == (
        "succeeded",
        1,
        None,
    )
    assert delivery["last_status_code"] == status
    assert [a["outcome"] for a in attempts_of(engine, 1)] == ["succeeded"]


@pytest.mark.parametrize("status", [301, 302, 307, 308])
async def test_3xx_is_not_followed_and_its_location_is_recorded(
    status: int,
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    target = receiver.route("/new-home")
    url = receiver.route("/moved", status=status, headers={"Location": target})
    endpoint_with_rules(engine, box, url, FAST)
    publish_one(engine)
    await Relay(async_engine, clock).run_until_idle()
    delivery = await drive(make_worker(async_engine, http, box, clock), engine, clock, 1)

    assert (delivery["state"], delivery["attempts"]) == ("dead", 1)
    assert receiver.received("/new-home") == []  # never followed
    assert f"redirect to {target} not followed" in delivery["last_error"]
    assert delivery["final_reason"].startswith(f"{status} ")
    assert delivery["final_reason"].endswith(
        f"redirect to {target} not followed: permanent failure, not retried"
    )
    assert attempts_of(engine, 1)[0]["outcome"] == "permanent"


@pytest.mark.parametrize(
    ("status", "phrase"),
    [(400, "Bad Request"), (401, "Status"), (404, "Not Found"), (422, "Status")],
)
async def test_other_4xx_is_dead_at_once_with_the_reason(
    status: int,
    phrase: str,
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    endpoint_with_rules(engine, box, receiver.route("/no", status=status), FAST)
    publish_one(engine)
    await Relay(async_engine, clock).run_until_idle()
    delivery = await drive(make_worker(async_engine, http, box, clock), engine, clock, 1)
    assert (delivery["state"], delivery["attempts"], delivery["last_status_code"]) == (
        "dead",
        1,
        status,
    )
    assert delivery["final_reason"] == f"{status} {phrase}: permanent failure, not retried"
    assert delivery["completed_at"] == clock.now()
    assert len(receiver.requests) == 1


@pytest.mark.parametrize("status", [408, 425, 429, 500, 502, 503])
async def test_retryable_statuses_use_every_attempt_then_die_with_a_summary(
    status: int,
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    endpoint_with_rules(engine, box, receiver.route("/busy", status=status), FAST)
    publish_one(engine)
    await Relay(async_engine, clock).run_until_idle()
    delivery = await drive(make_worker(async_engine, http, box, clock), engine, clock, 1)

    attempts = attempts_of(engine, 1)
    assert (delivery["state"], delivery["attempts"], len(attempts)) == ("dead", 3, 3)
    assert [a["outcome"] for a in attempts] == ["retryable"] * 3
    gaps = [
        (b["started_at"] - a["started_at"]).total_seconds() for a, b in itertools.pairwise(attempts)
    ]
    assert all(8 <= gap <= 12 for gap in gaps), gaps  # 10 s +-20%
    assert delivery["final_reason"] == f"3 attempts over {span(attempts)}, last: {status}"
    assert len(receiver.requests) == 3


async def test_410_kills_the_delivery_and_disables_the_endpoint_its_others_wait(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    gone = endpoint_with_rules(engine, box, receiver.route("/gone", status=410), FAST, "order.*")
    add_endpoint(engine, box, receiver.route("/fine"), "order.*")
    for index in range(3):
        publish_one(engine, i=index)
    await Relay(async_engine, clock).run_until_idle()
    worker = make_worker(async_engine, http, box, clock, batch_size=1)
    first = await drive(worker, engine, clock, 1)

    assert (first["state"], first["attempts"], first["final_reason"]) == (
        "dead",
        1,
        "410 Gone: endpoint disabled",
    )
    endpoint = rows(engine, "SELECT * FROM endpoints WHERE uid = :uid", uid=gone)[0]
    assert endpoint["enabled"] is False
    assert endpoint["disabled_reason"].startswith(f"410 Gone from {receiver.url('/gone')} at ")
    assert "enable it to deliver what is waiting" in endpoint["disabled_reason"]
    audit = rows(engine, "SELECT * FROM audit_log WHERE target_id = :uid", uid=gone)
    assert [(a["action"], a["actor"]) for a in audit][-1] == (
        "endpoint.disable",
        f"worker:{worker.config.worker_id}",
    )

    # The other endpoint gets everything; the disabled one's deliveries wait, untouched.
    for _ in range(6):
        await worker.run_once()
    waiting = rows(
        engine,
        "SELECT d.state, d.attempts FROM deliveries d JOIN endpoints e ON e.id = d.endpoint_id"
        " WHERE e.uid = :uid AND d.id <> 1 ORDER BY d.id",
        uid=gone,
    )
    assert waiting == [{"state": "scheduled", "attempts": 0}] * 2
    assert len(receiver.received("/fine")) == 3
    assert len(receiver.received("/gone")) == 1

    # Fixed and re-enabled: what waited is delivered; nothing was dropped.
    receiver.route("/gone", status=200)
    with engine.begin() as conn:
        set_enabled(conn, gone, enabled=True, actor="test")
    for _ in range(3):
        await worker.run_once()
    assert len(receiver.received("/gone")) == 3
    assert scalar(engine, "SELECT count(*) FROM deliveries WHERE state = 'succeeded'") == 5


async def test_connection_refused_is_retried_then_dead(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    http: httpx.AsyncClient,
) -> None:
    endpoint_with_rules(engine, box, f"http://127.0.0.1:{closed_port()}/hook", FAST)
    publish_one(engine)
    await Relay(async_engine, clock).run_until_idle()
    delivery = await drive(make_worker(async_engine, http, box, clock), engine, clock, 1)
    attempts = attempts_of(engine, 1)
    assert (delivery["state"], delivery["attempts"]) == ("dead", 3)
    assert [a["outcome"] for a in attempts] == ["retryable"] * 3
    assert delivery["last_status_code"] is None
    assert re.fullmatch(
        rf"3 attempts over {span(attempts)}, last: connect failed: ConnectError: .+",
        delivery["final_reason"],
    ), delivery["final_reason"]


async def test_reset_after_sending_is_ambiguous_and_retried(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    endpoint_with_rules(engine, box, receiver.route("/reset", reset=True), FAST)
    publish_one(engine)
    await Relay(async_engine, clock).run_until_idle()
    delivery = await drive(make_worker(async_engine, http, box, clock), engine, clock, 1)
    attempts = attempts_of(engine, 1)
    assert (delivery["state"], delivery["attempts"]) == ("dead", 3)
    assert [a["outcome"] for a in attempts] == ["ambiguous"] * 3
    assert all("may have arrived" in a["error"] for a in attempts)
    assert len(receiver.requests) == 3  # it did arrive, every time
    assert delivery["final_reason"].startswith(
        f"3 attempts over {span(attempts)}, last: failed after sending, may have arrived"
    )


# -- deadlines ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("behaviour", "expected_error"),
    [
        # Headers at once, then one byte every 50 ms for 10 s: httpx's per-read timeout
        # would never fire; the attempt deadline does.
        (
            {"status": 200, "body": b"x" * 200, "trickle_interval": 0.05},
            "deadline of 0.5s passed reading the response body after status 200; "
            "the request may have arrived",
        ),
        # Reads the request and never answers.
        (
            {"status": 200, "delay": 30.0},
            "deadline of 0.5s passed waiting for the response; the request may have arrived",
        ),
    ],
    ids=["trickling", "silent"],
)
async def test_the_deadline_cuts_trickling_and_silent_receivers(
    behaviour: dict[str, Any],
    expected_error: str,
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    url = receiver.route("/slow", **behaviour)
    endpoint_with_rules(
        engine, box, url, DeliveryRules(timeout_seconds=0.5, max_attempts=2, retry_schedule=(5,))
    )
    publish_one(engine)
    await Relay(async_engine, clock).run_until_idle()
    began = time.perf_counter()
    delivery = await drive(make_worker(async_engine, http, box, clock), engine, clock, 1)
    elapsed = time.perf_counter() - began

    assert elapsed < 3.0  # two attempts of 0.5 s each, not 10 s or 30 s
    attempts = attempts_of(engine, 1)
    assert [(a["outcome"], a["error"]) for a in attempts] == [("ambiguous", expected_error)] * 2
    assert all(450 <= a["duration_ms"] < 1500 for a in attempts)
    assert (delivery["state"], delivery["attempts"]) == ("dead", 2)
    assert delivery["final_reason"] == f"2 attempts over {span(attempts)}, last: {expected_error}"


async def test_response_body_read_is_capped_and_a_short_excerpt_is_kept(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    endpoint_with_rules(
        engine, box, receiver.route("/big", status=500, body=b"e" * 1_000_000), FAST
    )
    publish_one(engine)
    await Relay(async_engine, clock).run_until_idle()
    await make_worker(async_engine, http, box, clock).run_once()
    attempt = attempts_of(engine, 1)[0]
    assert attempt["response_excerpt"] == "e" * 2048
    assert receiver.requests[0].headers["accept-encoding"] == "identity"


# -- Retry-After --------------------------------------------------------------------


async def _first_retry_delay(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
    status: int,
    retry_after: str,
) -> float:
    url = receiver.route("/later", status=status, headers={"Retry-After": retry_after})
    endpoint_with_rules(engine, box, url, FAST)
    publish_one(engine)
    await Relay(async_engine, clock).run_until_idle()
    stats = await make_worker(async_engine, http, box, clock).run_once()
    assert stats.scheduled == 1
    due = scalar(engine, "SELECT next_attempt_at FROM deliveries WHERE id = 1")
    return float((due - clock.now()).total_seconds())


@WIRE_ONLY
async def test_retry_after_in_seconds_on_429_is_honoured(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    delay = await _first_retry_delay(engine, async_engine, clock, box, receiver, http, 429, "120")
    assert 120 <= delay <= 144  # never earlier than asked; jitter only upwards


@WIRE_ONLY
async def test_retry_after_as_an_http_date_on_503_is_honoured(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    when = email.utils.format_datetime(clock.now() + dt.timedelta(minutes=5), usegmt=True)
    delay = await _first_retry_delay(engine, async_engine, clock, box, receiver, http, 503, when)
    assert 300 <= delay <= 360


@WIRE_ONLY
async def test_retry_after_beyond_the_clamp_is_cut_to_the_maximum(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    delay = await _first_retry_delay(
        engine, async_engine, clock, box, receiver, http, 503, "9999999"
    )
    assert 3600 <= delay <= 3600 * 1.2


@WIRE_ONLY
async def test_garbage_retry_after_falls_back_to_the_schedule(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    delay = await _first_retry_delay(
        engine, async_engine, clock, box, receiver, http, 429, "after lunch"
    )
    assert 8 <= delay <= 12  # the endpoint's 10 s schedule, +-20%


# -- overrides and policies -----------------------------------------------------------


@WIRE_ONLY
async def test_endpoint_can_declare_404_transient_and_410_not_fatal(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    rules = DeliveryRules(
        max_attempts=2, retry_schedule=(10.0,), status_overrides={404: "retryable"}
    )
    endpoint_with_rules(engine, box, receiver.route("/late", status=404), rules, "order.*")
    soft = DeliveryRules(max_attempts=2, status_overrides={410: "retryable"})
    soft_uid = endpoint_with_rules(
        engine, box, receiver.route("/soft", status=410), soft, "invoice.*"
    )
    publish_one(engine, "order.created")
    publish_one(engine, "invoice.paid")
    await Relay(async_engine, clock).run_until_idle()
    worker = make_worker(async_engine, http, box, clock)
    late = await drive(worker, engine, clock, 1)
    assert (late["state"], late["attempts"]) == ("dead", 2)
    assert late["final_reason"] == f"2 attempts over {span(attempts_of(engine, 1))}, last: 404"
    other = await drive(worker, engine, clock, 2)
    assert (other["state"], other["attempts"]) == ("dead", 2)
    assert scalar(engine, "SELECT enabled FROM endpoints WHERE uid = :u", u=soft_uid) is True


def scheduled_retries(engine: Engine, now: dt.datetime) -> dict[tuple[str, str], tuple[int, float]]:
    """(endpoint path, event type) -> (max attempts, seconds until the next attempt)."""
    return {
        (r["path"], r["event_type"]): (r["max_attempts"], r["delay"])
        for r in rows(
            engine,
            "SELECT substring(e.url from '/[a-z]+$') AS path, ev.event_type, d.max_attempts,"
            " extract(epoch FROM d.next_attempt_at - :now)::float AS delay"
            " FROM deliveries d JOIN endpoints e ON e.id = d.endpoint_id"
            " JOIN outbox_events ev ON ev.id = d.event_id",
            now=now,
        )
    }


async def first_retries(
    engine: Engine,
    async_engine: AsyncEngine,
    http: httpx.AsyncClient,
    box: SecretBox,
    clock: ManualClock,
    relay_config: RelayConfig,
) -> dict[tuple[str, str], tuple[int, float]]:
    """Publish an invoice.paid and an order.created, relay them, fail each first attempt
    with a worker whose invoice.* retries wait 100 s; `scheduled_retries` after that."""
    publish_one(engine, "invoice.paid")
    publish_one(engine, "order.created")
    await Relay(async_engine, clock, relay_config).run_until_idle()
    worker = make_worker(
        async_engine, http, box, clock, retry_schedule_by_event_type={"invoice.*": (100.0,)}
    )
    await worker.run_once()
    return scheduled_retries(engine, clock.now())


@WIRE_ONLY
async def test_retry_policy_per_event_type_and_per_endpoint(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    add_endpoint(engine, box, receiver.route("/plain", status=500), "*")
    endpoint_with_rules(
        engine,
        box,
        receiver.route("/own", status=500),
        DeliveryRules(max_attempts=5, retry_schedule=(30.0,)),
    )
    relay_config = RelayConfig(max_attempts_by_event_type={"invoice.*": 2})
    found = await first_retries(engine, async_engine, http, box, clock, relay_config)
    assert found[("/plain", "invoice.paid")][0] == 2  # event type rule
    assert 80 <= found[("/plain", "invoice.paid")][1] <= 120
    assert found[("/plain", "order.created")][0] == 8  # global default
    assert 4 <= found[("/plain", "order.created")][1] <= 6  # first global delay: 5 s
    assert found[("/own", "invoice.paid")][0] == 5  # the endpoint's own rules win
    assert 24 <= found[("/own", "invoice.paid")][1] <= 36
    assert found[("/own", "order.created")][0] == 5


@WIRE_ONLY
async def test_event_types_with_the_same_attempts_keep_their_own_retry_schedules(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    """The worker builds each retry policy once; two event types with the same maximum
    attempts but different schedules must still get their own."""
    add_endpoint(engine, box, receiver.route("/plain", status=500), "*")
    found = await first_retries(engine, async_engine, http, box, clock, RelayConfig())
    assert found[("/plain", "order.created")][0] == found[("/plain", "invoice.paid")][0] == 8
    assert 4 <= found[("/plain", "order.created")][1] <= 6  # the global first delay: 5 s
    assert 80 <= found[("/plain", "invoice.paid")][1] <= 120  # the event type's own schedule


# -- identity -------------------------------------------------------------------------


@WIRE_ONLY
async def test_webhook_id_is_stable_while_timestamp_and_signature_are_fresh(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    statuses = iter([503, 500, 200])
    url = receiver.route("/id", lambda _: _behaviour(next(statuses)))
    created = add_endpoint(engine, box, url)
    with engine.begin() as conn:
        set_delivery_rules(conn, created.endpoint.uid, FAST, actor="test")
    message_id = publish_one(engine)
    await Relay(async_engine, clock).run_until_idle()
    delivery = await drive(make_worker(async_engine, http, box, clock), engine, clock, 1)
    assert (delivery["state"], delivery["attempts"]) == ("succeeded", 3)
    seen = receiver.requests
    assert {r.headers["webhook-id"] for r in seen} == {message_id}
    assert len({r.headers["webhook-timestamp"] for r in seen}) == 3
    assert len({r.headers["webhook-signature"] for r in seen}) == 3
    assert len({r.body for r in seen}) == 1
    for request in seen:  # each signature is valid for its own timestamp
        Webhook(created.secret).verify(request.body, request.headers)


def _behaviour(status: int) -> Any:
    from delivery.receiver import Behaviour

    return Behaviour(status=status)


# -- leases, rescue and shutdown ---------------------------------------------------------


@WIRE_ONLY
async def test_an_abandoned_claim_is_redelivered_exactly_once_after_the_lease(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    add_endpoint(engine, box, receiver.route("/hook"))
    publish_one(engine)
    await Relay(async_engine, clock).run_until_idle()
    dying = make_worker(async_engine, http, box, clock, worker_id="dies", lease_seconds=60)
    survivor = make_worker(async_engine, http, box, clock, worker_id="lives")
    reaper = Reaper(async_engine, clock)

    assert len(await dying.claim(10)) == 1  # ...and the process dies here
    clock.advance(59)
    assert await reaper.run_once() == []  # the lease still holds
    assert (await survivor.run_once()).claimed == 0
    clock.advance(2)
    assert await reaper.run_once() == [1]
    delivery = rows(engine, "SELECT * FROM deliveries")[0]
    assert (delivery["state"], delivery["attempts"], delivery["rescues"]) == ("scheduled", 0, 1)
    assert delivery["last_error"] == (
        "lease of worker dies expired: it stopped before recording an outcome"
    )
    assert (await survivor.run_once()).succeeded == 1
    for _ in range(3):
        clock.advance(3600)
        assert await reaper.run_once() == []
        assert (await survivor.run_once()).claimed == 0
    assert len(receiver.requests) == 1
    delivery = rows(engine, "SELECT * FROM deliveries")[0]
    assert (delivery["state"], delivery["attempts"], delivery["rescues"]) == ("succeeded", 1, 1)


@WIRE_ONLY
async def test_a_worker_that_sent_then_died_causes_one_duplicate_and_cannot_overwrite(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    add_endpoint(engine, box, receiver.route("/hook"))
    message_id = publish_one(engine)
    await Relay(async_engine, clock).run_until_idle()
    late = make_worker(async_engine, http, box, clock, worker_id="late")
    claimed = await late.claim(10)
    result = await late.attempt(claimed[0])  # sent; the worker stalls before recording
    clock.advance(61)
    assert await Reaper(async_engine, clock).run_once() == [1]
    survivor = make_worker(async_engine, http, box, clock, worker_id="lives")
    assert (await survivor.run_once()).succeeded == 1

    stats = await late.record([(claimed[0], result)])  # wakes up and tries to record
    assert (stats.lost_lease, stats.succeeded) == (1, 0)
    assert [r.headers["webhook-id"] for r in receiver.requests] == [message_id] * 2
    delivery = rows(engine, "SELECT * FROM deliveries")[0]
    assert (delivery["state"], delivery["locked_by"]) == ("succeeded", None)
    # Both are history, numbered by their claims: the late request was the first one.
    assert [(a["attempt_number"], a["worker_id"]) for a in attempts_of(engine, 1)] == [
        (1, "late"),
        (2, "lives"),
    ]


@WIRE_ONLY
async def test_a_delivery_that_finishes_while_the_reaper_runs_stays_succeeded(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    add_endpoint(engine, box, receiver.route("/hook"))
    with engine.begin() as conn:
        for index in range(100):
            publish(conn, "order.created", {"i": index})
    await Relay(async_engine, clock).run_until_idle()
    worker = make_worker(async_engine, http, box, clock, batch_size=100, max_in_flight=100)
    claimed = await worker.claim(100)
    results = await asyncio.gather(*(worker.attempt(item) for item in claimed))
    clock.advance(61)  # every lease expired while the outcomes were being written

    # The worker's write and the reaper race for the same rows, for real.
    stats, rescued = await asyncio.gather(
        worker.record(list(zip(claimed, results, strict=True))),
        Reaper(async_engine, clock).run_once(),
    )
    states = {r["id"]: r["state"] for r in rows(engine, "SELECT id, state FROM deliveries")}
    assert stats.succeeded + stats.lost_lease == 100
    assert stats.lost_lease == len(rescued)
    assert all(states[i] == "scheduled" for i in rescued)
    finished = [i for i in states if i not in set(rescued)]
    assert len(finished) == stats.succeeded
    assert all(states[i] == "succeeded" for i in finished)

    # Whatever the reaper does afterwards, a finished delivery stays finished.
    clock.advance(3600)
    assert await Reaper(async_engine, clock).run_once() == []
    assert scalar(engine, "SELECT count(*) FROM deliveries WHERE state = 'succeeded'") == len(
        finished
    )


@WIRE_ONLY
async def test_the_reaper_skips_a_row_whose_outcome_is_being_written(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    add_endpoint(engine, box, receiver.route("/hook"))
    publish_one(engine)
    await Relay(async_engine, clock).run_until_idle()
    worker = make_worker(async_engine, http, box, clock)
    claimed = await worker.claim(1)
    result = await worker.attempt(claimed[0])
    clock.advance(61)
    # A writer holds the row (as the worker's outcome statement does while it runs).
    with engine.connect() as writer:
        writer.execute(text("SELECT 1 FROM deliveries WHERE id = 1 FOR UPDATE"))
        assert await Reaper(async_engine, clock).run_once() == []
        writer.rollback()
    assert (await worker.record([(claimed[0], result)])).succeeded == 1
    assert await Reaper(async_engine, clock).run_once() == []
    assert scalar(engine, "SELECT state FROM deliveries WHERE id = 1") == "succeeded"


@WIRE_ONLY
async def test_a_poison_delivery_is_not_rescued_forever(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    add_endpoint(engine, box, receiver.route("/hook"))
    publish_one(engine)
    await Relay(async_engine, clock).run_until_idle()
    reaper = Reaper(async_engine, clock, ReaperConfig(max_rescues=3))
    for crash in range(1, 4):
        victim = make_worker(async_engine, http, box, clock, worker_id=f"victim-{crash}")
        assert len(await victim.claim(10)) == 1  # each worker dies holding it
        clock.advance(61)
        assert await reaper.run_once() == [1]
    delivery = rows(engine, "SELECT * FROM deliveries")[0]
    assert (delivery["state"], delivery["attempts"], delivery["rescues"]) == ("dead", 0, 3)
    assert delivery["final_reason"] == (
        "rescued 3 times after its worker stopped mid-attempt (0 attempts recorded): it may "
        "be crashing workers; inspect it before replaying"
    )
    assert delivery["completed_at"] == clock.now()
    assert (await make_worker(async_engine, http, box, clock).run_once()).claimed == 0


@WIRE_ONLY
async def test_a_lease_that_moved_on_is_not_rescued(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    add_endpoint(engine, box, receiver.route("/hook"))
    publish_one(engine)
    await Relay(async_engine, clock).run_until_idle()
    reaper = Reaper(async_engine, clock)
    assert len(await make_worker(async_engine, http, box, clock, worker_id="a").claim(1)) == 1
    clock.advance(61)
    assert await reaper.run_once() == [1]
    second = make_worker(async_engine, http, box, clock, worker_id="b")
    assert len(await second.claim(1)) == 1  # a fresh lease for worker b
    clock.advance(30)
    assert await reaper.run_once() == []
    assert scalar(engine, "SELECT locked_by FROM deliveries WHERE id = 1") == "b"


async def test_shutdown_hands_back_queued_claims_at_once(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    add_endpoint(engine, box, receiver.route("/slow", delay=1.5))
    with engine.begin() as conn:
        for index in range(5):
            publish(conn, "order.created", {"i": index})
    await Relay(async_engine, clock).run_until_idle()
    stop = asyncio.Event()
    # One connection: one request runs, four claims queue for the pool.
    async with build_http_client(max_connections=1, timeout=5, allowed_networks=LOOPBACK) as narrow:
        worker = make_worker(
            async_engine, narrow, box, clock, batch_size=5, max_in_flight=5, poll_interval=0.05
        )
        running = asyncio.create_task(worker.run(stop))
        for _ in range(100):
            if receiver.requests:
                break
            await asyncio.sleep(0.02)
        assert len(receiver.requests) == 1
        stop.set()
        released_within = None
        began = time.perf_counter()
        while time.perf_counter() - began < 1.0:
            waiting = scalar(
                engine,
                "SELECT count(*) FROM deliveries WHERE state = 'scheduled' AND locked_by IS NULL"
                " AND attempts = 0",
            )
            if waiting == 4:
                released_within = time.perf_counter() - began
                break
            await asyncio.sleep(0.02)
        # Handed back while the one started request is still running.
        assert released_within is not None and released_within < 1.0
        assert scalar(engine, "SELECT count(*) FROM deliveries WHERE state = 'in_flight'") == 1
        await running
    assert len(receiver.requests) == 1
    assert scalar(engine, "SELECT count(*) FROM deliveries WHERE state = 'succeeded'") == 1
    assert scalar(engine, "SELECT count(*) FROM delivery_attempts") == 1
    assert (
        scalar(
            engine, "SELECT count(*) FROM deliveries WHERE next_attempt_at <= :now", now=clock.now()
        )
        == 5
    )


# -- jitter at scale ----------------------------------------------------------------------


async def test_a_thousand_retries_due_in_the_same_second_spread_over_the_jitter_window(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
) -> None:
    # The partner is an in-process 503 (httpx.MockTransport): a thousand loopback
    # connections would only measure the HTTP stack; the spread is the worker's doing.
    answered: list[str] = []

    def down(request: httpx.Request) -> httpx.Response:
        answered.append(request.headers["webhook-id"])
        return httpx.Response(503, stream=httpx.ByteStream(b"busy"))

    endpoint_with_rules(
        engine, box, "http://partner.test/hook", DeliveryRules(retry_schedule=(60.0,))
    )
    with engine.begin() as conn:
        for index in range(1000):
            publish(conn, "order.created", {"i": index})
    await Relay(async_engine, clock).run_until_idle()
    async with httpx.AsyncClient(transport=httpx.MockTransport(down)) as mock:
        worker = make_worker(async_engine, mock, box, clock, batch_size=1000, max_in_flight=1000)
        assert (await worker.run_once()).scheduled == 1000  # all failed at the same instant
    assert len(set(answered)) == 1000

    delays = [
        float(r["delay"])
        for r in rows(
            engine,
            "SELECT extract(epoch FROM next_attempt_at - :now) AS delay FROM deliveries",
            now=clock.now(),
        )
    ]
    assert len(delays) == 1000
    assert 48 <= min(delays) < 49 and 71 < max(delays) <= 72
    per_second = [0] * 24
    for delay in delays:
        per_second[min(int(delay - 48), 23)] += 1
    assert all(count > 0 for count in per_second), per_second
    assert max(per_second) < 100, per_second  # about 42 a second, no spike
    assert len({round(d, 3) for d in delays}) > 950  # not a few shared instants


async def test_an_endpoint_timeout_never_outlives_the_lease(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    endpoint_with_rules(engine, box, receiver.route("/a"), DeliveryRules(timeout_seconds=300))
    endpoint_with_rules(engine, box, receiver.route("/b"), DeliveryRules(timeout_seconds=2))
    publish_one(engine)
    await Relay(async_engine, clock).run_until_idle()
    worker = make_worker(async_engine, http, box, clock, lease_seconds=20)
    timeouts = sorted(item.request.timeout for item in await worker.claim(10))
    assert timeouts == [2, 15]  # 300 s cut to the lease minus its 5 s margin


async def test_a_deadline_that_passes_before_sending_is_retryable_not_ambiguous(
    clock: ManualClock, receiver: Receiver
) -> None:
    from delivery.http import OutgoingRequest, send_attempt

    url = receiver.route("/slow", delay=1.0)

    def request(delivery_id: int, timeout: float) -> OutgoingRequest:
        return OutgoingRequest(delivery_id, url, "msg_1", b"{}", [b"k" * 32], timeout)

    # One connection: the second request waits in the pool and never goes out.
    async with build_http_client(max_connections=1, timeout=5, allowed_networks=LOOPBACK) as narrow:
        first, second = await asyncio.gather(
            send_attempt(narrow, request(1, 3.0), clock),
            send_attempt(narrow, request(2, 0.3), clock),
        )
    assert (first.outcome, first.status_code) == ("succeeded", 200)
    assert (second.outcome, second.error) == (
        "retryable",
        "deadline of 0.3s passed before the request was sent",
    )
    assert len(receiver.requests) == 1


async def test_a_delivery_that_crashes_its_attempt_ends_dead_through_the_rescue_count(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def crash(request: httpx.Request) -> httpx.Response:
        raise RuntimeError("a bug somewhere below the worker")

    add_endpoint(engine, box, "http://partner.test/hook")
    publish_one(engine)
    await Relay(async_engine, clock).run_until_idle()
    reaper = Reaper(async_engine, clock, ReaperConfig(max_rescues=2))
    async with httpx.AsyncClient(transport=httpx.MockTransport(crash)) as broken:
        for _ in range(2):
            stop = asyncio.Event()
            worker = make_worker(async_engine, broken, box, clock, poll_interval=0.05)
            running = asyncio.create_task(worker.run(stop))
            for _ in range(100):
                if "failed unexpectedly" in caplog.text:
                    break
                await asyncio.sleep(0.02)
            stop.set()
            await running
            assert "attempt of delivery 1 failed unexpectedly; left to the reaper" in caplog.text
            caplog.clear()
            assert scalar(engine, "SELECT state FROM deliveries") == "in_flight"
            clock.advance(61)
            assert await reaper.run_once() == [1]
    delivery = rows(engine, "SELECT * FROM deliveries")[0]
    assert (delivery["state"], delivery["attempts"], delivery["rescues"]) == ("dead", 0, 2)
    assert delivery["final_reason"].startswith("rescued 2 times after its worker stopped")
