"""End to end against a real PostgreSQL and a real receiver on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json

from sqlalchemy import Engine, create_engine, text
from sqlalchemy.ext.asyncio import AsyncEngine
from standardwebhooks import Webhook

from delivery.http import build_http_client
from delivery.receiver import Behaviour, ReceivedRequest, Receiver
from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.relay import Relay, RelayConfig
from tests.delivery.workers import make_worker
from tests.helpers import LOOPBACK, WIRE_ONLY, add_endpoint, disable, rows, scalar


async def test_committed_event_reaches_each_subscriber_once_signed_per_spec(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    transport: str,
) -> None:
    orders = add_endpoint(engine, box, receiver.route("/orders"), "order.*")
    add_endpoint(engine, box, receiver.route("/invoices"), "invoice.*")
    off = add_endpoint(engine, box, receiver.route("/off"), "*")
    disable(engine, off.endpoint.uid)
    with engine.begin() as conn:
        message_id = publish(conn, "order.created", {"order_id": 42, "note": "ünïcode"})
    with engine.connect() as conn, conn.begin() as transaction:
        publish(conn, "order.created", {"order_id": 43})
        transaction.rollback()

    async with build_http_client(
        max_connections=10, timeout=5, allowed_networks=LOOPBACK, transport=transport
    ) as http:
        await Relay(async_engine, clock).run_until_idle()
        stats = await make_worker(async_engine, http, box, clock).run_once()

    assert stats.succeeded == 1
    assert [r.path for r in receiver.requests] == ["/orders"]
    request = receiver.requests[0]
    assert request.headers["webhook-id"] == message_id
    assert request.headers["webhook-timestamp"] == str(int(clock.now().timestamp()))
    assert request.headers["content-type"] == "application/json"
    # Any Standard Webhooks library verifies it with the endpoint's secret.
    verified = Webhook(orders.secret).verify(request.body, request.headers)
    assert verified["type"] == "order.created"
    assert verified["data"] == {"order_id": 42, "note": "ünïcode"}
    assert verified["timestamp"].endswith("Z")

    delivery = rows(engine, "SELECT * FROM deliveries")[0]
    assert (delivery["state"], delivery["attempts"], delivery["last_status_code"]) == (
        "succeeded",
        1,
        200,
    )
    assert delivery["locked_by"] is None
    attempt = rows(engine, "SELECT * FROM delivery_attempts")[0]
    assert attempt["outcome"] == "succeeded"
    assert attempt["request_headers"]["webhook-id"] == message_id


async def test_server_error_is_scheduled_again_with_the_same_webhook_id(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    transport: str,
) -> None:
    url = receiver.route("/flaky", status=500, body=b"database down")
    add_endpoint(engine, box, url)
    with engine.begin() as conn:
        publish(conn, "order.created", {"id": 1})
    async with build_http_client(
        max_connections=10, timeout=5, allowed_networks=LOOPBACK, transport=transport
    ) as http:
        worker = make_worker(async_engine, http, box, clock, retry_schedule=(10.0,))
        await Relay(async_engine, clock).run_until_idle()
        first = await worker.run_once()
        assert first.scheduled == 1
        delivery = rows(engine, "SELECT * FROM deliveries")[0]
        assert delivery["state"] == "scheduled"
        assert delivery["attempts"] == 1
        assert delivery["last_error"] == "HTTP 500 Internal Server Error"
        delay = (delivery["next_attempt_at"] - clock.now()).total_seconds()
        assert 8.0 <= delay <= 12.0  # 10 s with +-20% jitter

        assert (await worker.run_once()).claimed == 0  # not due yet
        clock.advance(13)
        receiver.route("/flaky", status=204)
        second = await worker.run_once()
    assert second.succeeded == 1
    ids = {r.headers["webhook-id"] for r in receiver.requests}
    assert len(receiver.requests) == 2 and len(ids) == 1
    attempts = rows(engine, "SELECT * FROM delivery_attempts ORDER BY attempt_number")
    assert [(a["attempt_number"], a["status_code"], a["outcome"]) for a in attempts] == [
        (1, 500, "retryable"),
        (2, 204, "succeeded"),
    ]
    assert attempts[0]["response_excerpt"] == "database down"


@WIRE_ONLY
async def test_no_lock_or_connection_is_held_while_a_request_is_in_flight(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    transport: str,
) -> None:
    observed: list[tuple[int, int, int]] = []
    inspector = create_engine(
        engine.url, isolation_level="AUTOCOMMIT", connect_args={"application_name": "inspector"}
    )

    def inspect_database(_: ReceivedRequest) -> Behaviour:
        # Everything but the inspectors themselves: the worker's and the test's connections.
        others = "a.application_name <> 'inspector' AND a.datname = current_database()"
        with inspector.connect() as conn:
            idle_in_transaction = conn.execute(
                text(
                    f"SELECT count(*) FROM pg_stat_activity a WHERE {others}"
                    " AND a.state LIKE 'idle in transaction%'"
                )
            ).scalar_one()
            locks = conn.execute(
                text(
                    "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
                    f" WHERE {others} AND l.locktype IN ('relation', 'tuple', 'transactionid')"
                )
            ).scalar_one()
        observed.append((idle_in_transaction, locks, async_engine.pool.checkedout()))  # type: ignore[attr-defined]
        return Behaviour(status=200)

    # Inspect from a thread so the event loop can serve other requests meanwhile.
    url = receiver.route("/inspect", lambda r: asyncio.to_thread(inspect_database, r))
    add_endpoint(engine, box, url)
    with engine.begin() as conn:
        for index in range(5):
            publish(conn, "order.created", {"i": index})
    async with build_http_client(
        max_connections=10, timeout=5, allowed_networks=LOOPBACK, transport=transport
    ) as http:
        await Relay(async_engine, clock).run_until_idle()
        stats = await make_worker(async_engine, http, box, clock).run_once()
    assert stats.succeeded == 5
    inspector.dispose()
    assert observed == [(0, 0, 0)] * 5


@WIRE_ONLY
async def test_two_relays_and_two_workers_neither_duplicate_nor_lose(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    transport: str,
) -> None:
    for name in ("a", "b"):
        add_endpoint(engine, box, receiver.route(f"/{name}"), "*")
    events = 300
    with engine.begin() as conn:
        published = {publish(conn, "order.created", {"i": i}) for i in range(events)}

    stop = asyncio.Event()
    async with build_http_client(
        max_connections=50, timeout=5, allowed_networks=LOOPBACK, transport=transport
    ) as http:
        relay_config = RelayConfig(batch_size=20, poll_interval=0.05)
        worker_config = {"batch_size": 15, "max_in_flight": 30, "poll_interval": 0.05}
        relays = [Relay(async_engine, clock, relay_config) for _ in range(2)]
        workers = [make_worker(async_engine, http, box, clock, **worker_config) for _ in range(2)]
        tasks = [asyncio.create_task(r.run(stop)) for r in relays]
        tasks += [asyncio.create_task(w.run(stop)) for w in workers]
        for _ in range(400):
            if len(receiver.requests) >= 2 * events:
                done = scalar(engine, "SELECT count(*) FROM deliveries WHERE state = 'succeeded'")
                if done == 2 * events:
                    break
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.gather(*tasks)

    received = [(r.path, r.headers["webhook-id"]) for r in receiver.requests]
    assert len(received) == 2 * events
    assert len(set(received)) == 2 * events
    assert {message_id for _, message_id in received} == published
    assert scalar(engine, "SELECT count(*) FROM deliveries WHERE state = 'succeeded'") == 2 * events
    assert sum(w.stats.succeeded for w in workers) == 2 * events
    assert all(w.stats.succeeded > 0 for w in workers)


async def test_body_is_the_standard_envelope(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    transport: str,
) -> None:
    add_endpoint(engine, box, receiver.route("/x"))
    with engine.begin() as conn:
        publish(conn, "customer.updated", {"nested": {"list": [1, 2.5, None, True]}})
    async with build_http_client(
        max_connections=10, timeout=5, allowed_networks=LOOPBACK, transport=transport
    ) as http:
        await Relay(async_engine, clock).run_until_idle()
        await make_worker(async_engine, http, box, clock).run_once()
    body = json.loads(receiver.requests[0].body)
    assert set(body) == {"type", "timestamp", "data"}
    assert body["type"] == "customer.updated"
    assert body["data"] == {"nested": {"list": [1, 2.5, None, True]}}


async def test_address_refused_by_the_ssrf_guard_is_dead_at_once(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    transport: str,
) -> None:
    add_endpoint(engine, box, receiver.route("/internal"))
    with engine.begin() as conn:
        publish(conn, "order.created", {"id": 1})
    # No allowed networks: loopback is refused like any private address.
    async with build_http_client(max_connections=10, timeout=5, transport=transport) as http:
        await Relay(async_engine, clock).run_until_idle()
        stats = await make_worker(async_engine, http, box, clock).run_once()
    assert stats.dead == 1
    assert receiver.requests == []
    delivery = rows(engine, "SELECT state, attempts, last_error FROM deliveries")[0]
    assert delivery["state"] == "dead"
    assert delivery["attempts"] == 1
    assert "127.0.0.1" in delivery["last_error"]
