"""Endpoint health end to end: real PostgreSQL, real receivers on 127.0.0.1, a manual clock.

The breaker, the ramp, the 429 pause and the rate limit run on the injected clock,
so these tests advance it instead of sleeping. Where two "worker processes" are
needed they are two Worker instances with separate engines (separate connection
pools) in one event loop: they share nothing but the database, as processes would.
"""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import json
import socket
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.health import EndpointLimits, HealthConfig, set_endpoint_limits
from delivery.http import build_http_client
from delivery.receiver import Behaviour, ReceivedRequest, Receiver
from delivery.worker import Worker
from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.db import make_async_engine
from outbox.deliveries import discard, replay
from outbox.endpoints import set_enabled
from outbox.priorities import set_event_type_priority
from tests.delivery.workers import breaker, relay_all, worker
from tests.helpers import LOOPBACK, add_endpoint, rows, scalar, until


def limit(engine: Engine, uid: str, **limits: Any) -> None:
    with engine.begin() as conn:
        set_endpoint_limits(conn, uid, EndpointLimits(**limits), actor="test")


def attempts_spent(engine: Engine, uid: str) -> int:
    return int(
        scalar(
            engine,
            "SELECT COALESCE(sum(d.attempts), 0) FROM deliveries d"
            " JOIN endpoints e ON e.id = d.endpoint_id WHERE e.uid = :uid",
            uid=uid,
        )
    )


def refused_port() -> int:
    """A loopback port nobody listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def payload_index(request: ReceivedRequest) -> int:
    return int(json.loads(request.body)["data"]["i"])


async def arrived(receiver: Receiver, count: int, seconds: float = 15.0) -> None:
    """Wait until the receiver has seen `count` requests (however slow the machine is)."""
    for _ in range(int(seconds / 0.02)):
        if len(receiver.requests) >= count:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{len(receiver.requests)} requests arrived, expected {count}")


async def run_until(workers: list[Worker], done: Callable[[], bool], seconds: float = 30) -> None:
    """Run the workers' loops until `done()`, then stop them (failing after `seconds`)."""
    stop = asyncio.Event()
    tasks = [asyncio.create_task(w.run(stop)) for w in workers]
    try:
        for _ in range(int(seconds / 0.02)):
            if done():
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError(f"not done after {seconds} s")
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def test_breakers_open_at_threshold_and_down_endpoints_get_only_probes(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    healthy = add_endpoint(engine, box, receiver.route("/healthy"), "order.*").endpoint.uid
    down = add_endpoint(engine, box, receiver.route("/down", status=503), "order.*").endpoint.uid
    refused_url = f"http://127.0.0.1:{refused_port()}/gone"  # nothing listens: refused
    refused = add_endpoint(engine, box, refused_url, "order.*").endpoint.uid
    hang_url = receiver.route("/hang", delay=3.0)
    hanging = add_endpoint(engine, box, hang_url, "order.*").endpoint.uid
    throttled_url = receiver.route("/throttled", status=429, headers={"Retry-After": "30"})
    add_endpoint(engine, box, throttled_url, "throttle.*")

    def count(path: str) -> int:
        return len(receiver.received(path))

    async with build_http_client(max_connections=20, timeout=5, allowed_networks=LOOPBACK) as http:
        with engine.begin() as conn:
            for i in range(2):
                publish(conn, "throttle.ping", {"i": i})
        await relay_all(async_engine, clock)
        await worker(async_engine, http, box, clock, batch_size=1).run_once()
        assert count("/throttled") == 1  # answered 429 with Retry-After: 30
        started = clock.now()

        with engine.begin() as conn:
            for i in range(6):
                publish(conn, "order.created", {"i": i})
        await relay_all(async_engine, clock)
        # Batches of 4 and round-robin claiming: one delivery per active endpoint per round
        # (the throttled endpoint is paused, so it takes no slot).
        w = worker(async_engine, http, box, clock, batch_size=4, request_timeout=0.3)
        for _ in range(2):
            await w.run_once()
            clock.advance(1.5)
        assert (breaker(engine, down), breaker(engine, hanging)) == ("closed", "closed")
        assert (count("/down"), count("/hang"), count("/throttled")) == (2, 2, 1)
        await w.run_once()  # third failure in a row: the threshold
        opened_at = clock.now()
        assert (breaker(engine, down), breaker(engine, hanging)) == ("open", "open")
        assert (count("/down"), count("/hang")) == (3, 3)
        assert (breaker(engine, refused), attempts_spent(engine, refused)) == ("open", 3)

        # While open: nothing is claimed, no attempt is spent; the healthy one carries on.
        for _ in range(5):
            clock.advance(1.5)
            await w.run_once()
        assert (count("/down"), count("/hang")) == (3, 3)
        assert (attempts_spent(engine, down), attempts_spent(engine, hanging)) == (3, 3)
        assert attempts_spent(engine, refused) == 3
        assert count("/healthy") == 6
        assert scalar(engine, "SELECT count(*) FROM deliveries WHERE state = 'succeeded'") == 6

        # Cooldown over: exactly one probe each, although three more are due for each.
        clock.set(opened_at + dt.timedelta(seconds=10))
        await w.run_once()
        assert (count("/down"), count("/hang"), attempts_spent(engine, refused)) == (4, 4, 4)
        assert (breaker(engine, down), breaker(engine, hanging)) == ("open", "open")
        assert count("/throttled") == 1  # still inside its Retry-After pause
        # The probe failed: the cooldown doubles (20 s), then one probe again.
        clock.advance(19)
        await w.run_once()
        assert (count("/down"), count("/hang")) == (4, 4)
        assert clock.now() - started > dt.timedelta(seconds=30)
        # Past Retry-After the endpoint is tried again: its second delivery at least (the
        # first is also due unless the retry policy's upward jitter on Retry-After, up to
        # +20%, still holds it), as the ramp from the pause's end allows 3/s by now.
        assert count("/throttled") in (2, 3)
        clock.advance(1)
        receiver.route("/down", status=200)
        await w.run_once()
        assert (count("/down"), count("/hang"), attempts_spent(engine, refused)) == (5, 5, 5)
        assert (breaker(engine, down), breaker(engine, hanging)) == ("closed", "open")
    assert breaker(engine, healthy) == "closed"
    attempts = rows(
        engine,
        "SELECT a.outcome, count(*) AS n FROM delivery_attempts a"
        " JOIN deliveries d ON d.id = a.delivery_id JOIN endpoints e ON e.id = d.endpoint_id"
        " WHERE e.uid = :uid GROUP BY a.outcome",
        uid=hanging,
    )
    assert attempts == [{"outcome": "ambiguous", "n": 5}]


async def test_after_recovery_the_backlog_drains_at_the_ramp_rate(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    add_endpoint(engine, box, receiver.route("/p", status=500))
    with engine.begin() as conn:
        for i in range(40):
            publish(conn, "order.created", {"i": i})
    await relay_all(async_engine, clock)
    async with build_http_client(max_connections=50, timeout=5, allowed_networks=LOOPBACK) as http:
        w = worker(async_engine, http, box, clock, batch_size=100)
        assert (await w.run_once()).scheduled == 40  # all failed: the breaker opens
        receiver.route("/p", status=200)
        clock.advance(10)
        claimed = [(await w.run_once()).claimed]  # the probe closes it
        for _ in range(5):
            claimed.append((await w.run_once()).claimed)
            clock.advance(1)
        claimed.append((await w.run_once()).claimed)
    # Probe, then 1 + t per second during the 5 s ramp, then the rest at once.
    assert claimed == [1, 1, 2, 3, 4, 5, 24]
    # Healthy through the whole ramp: the trip is forgiven (the next cooldown starts short).
    assert scalar(engine, "SELECT trips FROM endpoint_health") == 0
    assert scalar(engine, "SELECT count(*) FROM deliveries WHERE state = 'succeeded'") == 40


async def test_concurrency_limit_holds_across_two_worker_processes(
    engine: Engine,
    database_url: str,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    current, peak = 0, 0

    async def slow(_: ReceivedRequest) -> Behaviour:
        nonlocal current, peak
        current += 1
        peak = max(peak, current)
        await asyncio.sleep(0.1)  # long enough that the limit is reached, slow machine or not
        current -= 1
        return Behaviour(status=200)

    limited = add_endpoint(engine, box, receiver.route("/limited", slow), "order.*").endpoint
    add_endpoint(engine, box, receiver.route("/free"), "order.*")
    limit(engine, limited.uid, max_in_flight=3)
    with engine.begin() as conn:
        for i in range(40):
            publish(conn, "order.created", {"i": i})
    engines = [make_async_engine(database_url) for _ in range(2)]
    try:
        await relay_all(engines[0], clock)
        async with build_http_client(
            max_connections=50, timeout=5, allowed_networks=LOOPBACK
        ) as http:
            workers = [
                worker(e, http, box, clock, batch_size=10, max_in_flight=20, poll_interval=0.01)
                for e in engines
            ]
            await run_until(
                workers,
                lambda: sum(w.stats.succeeded for w in workers) == 80,
            )
    finally:
        for e in engines:
            await e.dispose()
    assert len(receiver.received("/limited")) == 40
    assert peak == 3
    assert all(w.stats.succeeded > 0 for w in workers)


async def test_rate_limit_holds_across_two_worker_processes(
    engine: Engine,
    database_url: str,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    limited = add_endpoint(engine, box, receiver.route("/limited")).endpoint
    limit(engine, limited.uid, max_per_second=5)
    with engine.begin() as conn:
        for i in range(30):
            publish(conn, "order.created", {"i": i})
    engines = [make_async_engine(database_url) for _ in range(2)]
    stop = asyncio.Event()
    try:
        await relay_all(engines[0], clock)
        async with build_http_client(
            max_connections=50, timeout=5, allowed_networks=LOOPBACK
        ) as http:
            workers = [
                worker(e, http, box, clock, batch_size=10, poll_interval=0.01) for e in engines
            ]
            tasks = [asyncio.create_task(w.run(stop)) for w in workers]

            def looked_again(marks: list[int]) -> bool:
                claimed = all(w.claims >= m + 5 for w, m in zip(workers, marks, strict=True))
                return claimed and not scalar(
                    engine, "SELECT count(*) FROM deliveries WHERE state = 'in_flight'"
                )

            seen = []
            for step, expected in ((0.0, 5), (1.0, 10), (1.0, 15), (0.5, 17), (2.0, 22)):
                clock.advance(step)
                await arrived(receiver, expected)
                # An overrun shows once each worker has claimed again (five times) and no
                # claimed delivery is still on its way to the receiver.
                marks = [w.claims for w in workers]
                await until(partial(looked_again, marks), "both workers to claim again, idle")
                seen.append(len(receiver.requests))
            stop.set()
            await asyncio.gather(*tasks)
    finally:
        stop.set()
        for e in engines:
            await e.dispose()
    # A one-second bucket of 5: 5 at once, 5 per second after, 2 for half a second,
    # and never more than one second's worth after a pause.
    assert seen == [5, 10, 15, 17, 22]


async def test_per_key_order_holds_under_retries_with_two_workers(
    engine: Engine,
    database_url: str,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    keys, per_key = 4, 8
    failed_once: set[int] = set()
    in_flight: collections.Counter[str] = collections.Counter()
    overlaps: list[str] = []

    async def flaky(request: ReceivedRequest) -> Behaviour:
        data = json.loads(request.body)["data"]
        key, index = data["key"], data["i"]
        in_flight[key] += 1
        if in_flight[key] > 1:
            overlaps.append(key)
        await asyncio.sleep(0.005)  # a request that takes a while, so overlaps would show
        in_flight[key] -= 1
        if index % 3 == 0 and index not in failed_once:
            failed_once.add(index)
            return Behaviour(status=500)
        return Behaviour(status=200)

    ordered = add_endpoint(engine, box, receiver.route("/ordered", flaky)).endpoint
    limit(engine, ordered.uid, ordered=True)
    with engine.begin() as conn:
        for n in range(per_key):
            for k in range(keys):
                i = n * keys + k
                publish(conn, "order.updated", {"i": i, "key": f"k{k}"}, ordering_key=f"k{k}")
    engines = [make_async_engine(database_url) for _ in range(2)]
    try:
        await relay_all(engines[0], clock)
        async with build_http_client(
            max_connections=50, timeout=5, allowed_networks=LOOPBACK
        ) as http:
            workers = [
                worker(
                    e, http, box, clock, batch_size=10, poll_interval=0.01, retry_schedule=(0.0,)
                )
                for e in engines
            ]
            await run_until(workers, lambda: sum(w.stats.succeeded for w in workers) == 32)
    finally:
        for e in engines:
            await e.dispose()

    assert overlaps == []
    by_key: dict[str, list[int]] = collections.defaultdict(list)
    for request in receiver.requests:
        data = json.loads(request.body)["data"]
        by_key[data["key"]].append(data["i"])
    for k in range(keys):
        expected = [n * keys + k for n in range(per_key)]
        sent = by_key[f"k{k}"]
        # Every failure was retried before anything later of that key was sent.
        assert sorted(sent) == sent
        assert list(dict.fromkeys(sent)) == expected
    assert len(failed_once) == len([i for i in range(32) if i % 3 == 0])
    assert all(w.stats.succeeded > 0 for w in workers)


async def test_a_dead_head_blocks_its_key_until_an_operator_acts_or_is_skipped(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    rejected: set[tuple[str, str]] = set()

    def rejecting(request: ReceivedRequest) -> Behaviour:
        # c0 is always refused; a0 only the first time (a replay of it then succeeds).
        name = json.loads(request.body)["data"]["name"]
        if name == "c0" or (name == "a0" and (request.path, name) not in rejected):
            rejected.add((request.path, name))
            return Behaviour(status=400)
        return Behaviour(status=200)

    blocking = add_endpoint(engine, box, receiver.route("/block", rejecting)).endpoint
    skipping = add_endpoint(engine, box, receiver.route("/skip", rejecting)).endpoint
    limit(engine, blocking.uid, ordered=True, dead_head="block")
    limit(engine, skipping.uid, ordered=True, dead_head="skip")
    with engine.begin() as conn:
        for name in ("a0", "b0", "c0", "a1", "b1", "c1", "a2"):
            publish(conn, "order.updated", {"name": name}, ordering_key=name[0])
    await relay_all(async_engine, clock)

    def per_key(path: str) -> dict[str, list[str]]:
        keys: dict[str, list[str]] = collections.defaultdict(list)
        for request in receiver.received(path):
            name = json.loads(request.body)["data"]["name"]
            keys[name[0]].append(name)
        return dict(keys)

    async with build_http_client(max_connections=20, timeout=5, allowed_networks=LOOPBACK) as http:
        w = worker(async_engine, http, box, clock, batch_size=50)
        for _ in range(4):
            await w.run_once()
        # Keys a and c wait behind their dead heads; key b is not held up.
        assert per_key("/block") == {"a": ["a0"], "b": ["b0", "b1"], "c": ["c0"]}
        assert per_key("/skip") == {"a": ["a0", "a1", "a2"], "b": ["b0", "b1"], "c": ["c0", "c1"]}
        # The operator replays a's dead head (it goes first) and discards c's.
        dead = {
            row["name"]: row["id"]
            for row in rows(
                engine,
                "SELECT d.id, ev.payload->>'name' AS name FROM deliveries d"
                " JOIN outbox_events ev ON ev.id = d.event_id"
                " WHERE d.state = 'dead' AND d.endpoint_id = :endpoint",
                endpoint=blocking.id,
            )
        }
        with engine.begin() as conn:
            replay(conn, [dead["a0"]], actor="test", reason="fixed", now=clock.now())
            discard(conn, [dead["c0"]], actor="test", reason="obsolete", now=clock.now())
        for _ in range(4):
            await w.run_once()
    assert per_key("/block") == {
        "a": ["a0", "a0", "a1", "a2"],
        "b": ["b0", "b1"],
        "c": ["c0", "c1"],
    }


@pytest.mark.slow  # a 10,000-event backlog
async def test_high_priority_events_overtake_a_10000_event_low_priority_backlog(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    add_endpoint(engine, box, receiver.route("/partner"))
    with engine.begin() as conn:
        set_event_type_priority(conn, "export.row", -10, actor="test")
        set_event_type_priority(conn, "password.reset", 50, actor="test")
        for i in range(10_000):
            publish(conn, "export.row", {"i": i})
    await relay_all(async_engine, clock)
    assert scalar(engine, "SELECT max(priority) FROM deliveries") == -10
    async with build_http_client(max_connections=100, timeout=5, allowed_networks=LOOPBACK) as http:
        w = worker(async_engine, http, box, clock, batch_size=100)
        await w.run_once()  # one batch of the backlog is under way
        with engine.begin() as conn:
            urgent = {publish(conn, "password.reset", {"i": -n}) for n in range(10)}
            publish(conn, "export.row", {"i": 10_000}, priority=60)  # a call overrides the type
        await relay_all(async_engine, clock)
        await w.run_once()
    second_batch = receiver.requests[100:]
    assert len(second_batch) == 100
    assert urgent <= {r.headers["webhook-id"] for r in second_batch}
    assert payload_index(second_batch[0]) in {10_000} | {-n for n in range(10)}
    assert scalar(engine, "SELECT count(*) FROM deliveries WHERE state = 'scheduled'") == 9_811


async def test_one_endpoints_backlog_never_starves_the_others(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    add_endpoint(engine, box, receiver.route("/bulk"), "bulk.*")
    add_endpoint(engine, box, receiver.route("/orders"), "order.*")
    with engine.begin() as conn:
        for i in range(300):
            publish(conn, "bulk.row", {"i": i})
        for i in range(5):
            publish(conn, "order.created", {"i": i})
    await relay_all(async_engine, clock)
    async with build_http_client(max_connections=50, timeout=5, allowed_networks=LOOPBACK) as http:
        await worker(async_engine, http, box, clock, batch_size=20).run_once()
    assert len(receiver.received("/orders")) == 5
    assert len(receiver.received("/bulk")) == 15
    # The happy path writes no health state at all.
    assert scalar(engine, "SELECT count(*) FROM endpoint_health") == 0


async def test_an_endpoint_failing_for_five_days_is_disabled_with_a_reason(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    down = add_endpoint(engine, box, receiver.route("/down", status=502)).endpoint
    with engine.begin() as conn:
        for i in range(3):
            publish(conn, "order.created", {"i": i})
    await relay_all(async_engine, clock, max_attempts=100)
    async with build_http_client(max_connections=20, timeout=5, allowed_networks=LOOPBACK) as http:
        w = worker(async_engine, http, box, clock, HealthConfig(), retry_schedule=(3600.0,))
        enabled = []
        for _ in range(7):
            await w.run_once()
            enabled.append(scalar(engine, "SELECT enabled FROM endpoints"))
            clock.advance(days=1)
    # Day 0: 3 failures; day 1: 3 more open the breaker; then one probe a day.
    assert enabled == [True, True, True, True, True, False, False]
    assert len(receiver.requests) == 3 + 3 + 4
    endpoint = rows(engine, "SELECT * FROM endpoints")[0]
    assert endpoint["disabled_reason"].startswith("auto-disabled: every attempt failed for 5 days")
    assert "HTTP 502" in endpoint["disabled_reason"]
    # Nothing pending was dropped.
    assert scalar(engine, "SELECT count(*) FROM deliveries WHERE state = 'scheduled'") == 3
    audit = rows(engine, "SELECT * FROM audit_log WHERE action = 'endpoint.auto_disable'")
    assert [(a["actor"], a["target_id"]) for a in audit] == [("system:breaker", down.uid)]

    # The operator fixes the partner and enables it: one probe first, then the ramp.
    receiver.route("/down", status=200)
    with engine.begin() as conn:
        set_enabled(conn, down.uid, enabled=True, actor="test")
    async with build_http_client(max_connections=20, timeout=5, allowed_networks=LOOPBACK) as http:
        w = worker(async_engine, http, box, clock, HealthConfig(), retry_schedule=(3600.0,))
        assert [(await w.run_once()).succeeded for _ in range(3)] == [1, 1, 0]
        clock.advance(1)
        assert (await w.run_once()).succeeded == 1  # the ramp: 1/s at first
    assert breaker(engine, down.uid) == "closed"


async def test_a_hanging_endpoint_cannot_take_every_worker_slot(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    add_endpoint(engine, box, receiver.route("/hang", delay=5.0))
    add_endpoint(engine, box, receiver.route("/healthy"))
    with engine.begin() as conn:
        for i in range(10):
            publish(conn, "order.created", {"i": i})
    await relay_all(async_engine, clock)
    async with build_http_client(max_connections=20, timeout=5, allowed_networks=LOOPBACK) as http:
        # 4 slots, at most half for one endpoint: the hanging one holds 2, never all 4.
        w = worker(
            async_engine, http, box, clock, max_in_flight=4, poll_interval=0.01, request_timeout=3
        )
        assert w.config.endpoint_slots == 2
        await run_until([w], lambda: len(receiver.received("/healthy")) == 10, seconds=10)
        assert len(receiver.received("/hang")) == 2


async def test_ordering_waits_for_an_earlier_event_the_relay_has_not_fanned_out(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    ordered = add_endpoint(engine, box, receiver.route("/ordered")).endpoint
    limit(engine, ordered.uid, ordered=True)
    with engine.begin() as conn:
        for i in range(2):
            publish(conn, "order.updated", {"i": i}, ordering_key="order-1")
    async with build_http_client(max_connections=10, timeout=5, allowed_networks=LOOPBACK) as http:
        w = worker(async_engine, http, box, clock)
        # Another relay holds the first event (SKIP LOCKED): only the second is fanned out.
        with engine.connect() as holder, holder.begin():
            holder.exec_driver_sql("SELECT id FROM outbox_events ORDER BY id LIMIT 1 FOR UPDATE")
            await relay_all(async_engine, clock)
            assert scalar(engine, "SELECT count(*) FROM deliveries") == 1
            assert (await w.run_once()).claimed == 0
        await relay_all(async_engine, clock)
        await w.run_once()
        await w.run_once()
    assert [payload_index(r) for r in receiver.requests] == [0, 1]
