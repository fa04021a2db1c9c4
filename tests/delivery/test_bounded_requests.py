"""A hostile or broken receiver cannot hold a worker past its deadline or fill its memory."""

from __future__ import annotations

import gzip
import time
import tracemalloc

from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.http import build_http_client
from delivery.receiver import Behaviour, Receiver
from delivery.worker import Worker, WorkerConfig
from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.relay import Relay
from tests.helpers import LOOPBACK, add_endpoint, rows

TEN_MB = 10 * 1024 * 1024


async def _deliver_once(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    url: str,
    *,
    deadline: float = 5.0,
    events: int = 1,
    transport: str = "httpx",
) -> list[dict[str, object]]:
    add_endpoint(engine, box, url)
    with engine.begin() as conn:
        for index in range(events):
            publish(conn, "order.created", {"i": index})
    config = WorkerConfig(request_timeout=deadline, batch_size=events, max_in_flight=events)
    async with build_http_client(
        max_connections=events, timeout=deadline, allowed_networks=LOOPBACK, transport=transport
    ) as http:
        await Relay(async_engine, clock).run_until_idle()
        await Worker(async_engine, http, box, clock, config).run_once()
    return [
        dict(row)
        for row in rows(
            engine,
            "SELECT d.state, a.outcome, a.status_code, a.error, a.duration_ms,"
            " length(a.response_excerpt) AS excerpt_length"
            " FROM deliveries d JOIN delivery_attempts a ON a.delivery_id = d.id",
        )
    ]


async def test_trickling_receiver_is_cut_at_the_deadline(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    url = receiver.route("/drip", Behaviour(body=b"x" * 1000, trickle_interval=0.05))
    began = time.perf_counter()
    [attempt] = await _deliver_once(engine, async_engine, clock, box, url, deadline=0.5)
    elapsed = time.perf_counter() - began
    assert attempt["outcome"] == "ambiguous"
    assert attempt["state"] == "scheduled"
    assert "deadline" in str(attempt["error"])
    assert elapsed < 3.0  # 1000 bytes at 20/s would take 50 s


async def test_silent_receiver_is_cut_at_the_deadline(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    url = receiver.route("/silent", Behaviour(delay=30))
    began = time.perf_counter()
    [attempt] = await _deliver_once(engine, async_engine, clock, box, url, deadline=0.5)
    assert time.perf_counter() - began < 3.0
    assert attempt["outcome"] == "ambiguous"


async def test_ten_megabyte_body_is_capped_and_memory_stays_flat(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    huge = b"y" * TEN_MB
    url = receiver.route("/huge", Behaviour(status=200, body=huge))
    del huge
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        results = await _deliver_once(engine, async_engine, clock, box, url, events=5)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert {r["outcome"] for r in results} == {"succeeded"}
    assert all(int(str(r["excerpt_length"])) <= 8 * 1024 for r in results)
    # Five concurrent 10 MB answers, read to the cap only: far below one body's size.
    assert peak < 4 * 1024 * 1024


async def test_gzip_bomb_is_never_inflated(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    bomb = gzip.compress(b"\0" * (200 * 1024 * 1024), compresslevel=9)
    url = receiver.route(
        "/bomb", Behaviour(status=500, body=bomb, headers={"Content-Encoding": "gzip"})
    )
    tracemalloc.start()
    try:
        [attempt] = await _deliver_once(engine, async_engine, clock, box, url)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert attempt["status_code"] == 500
    assert peak < 8 * 1024 * 1024


async def test_lying_content_length_is_ambiguous_and_retried(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    transport: str,
) -> None:
    lie = b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\nonly a little"
    url = receiver.route("/lie", Behaviour(raw=lie))
    [attempt] = await _deliver_once(
        engine, async_engine, clock, box, url, deadline=2.0, transport=transport
    )
    # The status arrived but the body was cut short: it may or may not count as
    # delivered by the partner, so it is ambiguous and retried on either transport.
    assert (attempt["outcome"], attempt["state"]) == ("ambiguous", "scheduled")
    assert "may have arrived" in str(attempt["error"])
