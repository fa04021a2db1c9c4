"""End to end, open loop: producers publish on a schedule, latency to the receiver's arrival."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from pgqueuer import PsycopgDriver
from pgqueuer.queries import Queries
from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from bench import cost
from bench.cluster import (
    EVENT_TYPE,
    LOOPBACK,
    PAYLOAD,
    Cluster,
    Plan,
    ReceiverProcess,
    WorkerProcesses,
    ours_commands,
    peer_commands,
)
from bench.pgq_worker import ENTRYPOINT
from bench.stats import percentiles
from delivery.worker import render_body
from outbox.clock import SystemClock
from outbox.crypto import SecretBox, generate_key, generate_secret
from outbox.db import libpq_url, make_async_engine, sqlalchemy_url
from outbox.endpoints import create_endpoint
from outbox.ids import new_message_id
from outbox.publish import publish_async


class Producer:
    """Publishes `n` events in one application transaction; returns their message ids."""

    async def start(self) -> None:
        return None

    async def publish(self, n: int) -> list[str]:
        raise NotImplementedError

    async def close(self) -> None:
        return None

    def backend_pids(self) -> list[int] | None:
        """The application's backends (their CPU is not the service's); None: unknown."""
        return None


class _PsycopgPool:
    """A fixed set of the application's psycopg connections, one per producer task."""

    def __init__(self, url: str, size: int, *, autocommit: bool) -> None:
        self._dsn = libpq_url(url)
        self._size = size
        self._autocommit = autocommit
        self.free: asyncio.Queue[psycopg.AsyncConnection[Any]] = asyncio.Queue()
        self._all: list[psycopg.AsyncConnection[Any]] = []

    async def start(self) -> None:
        for _ in range(self._size):
            conn = await psycopg.AsyncConnection.connect(self._dsn, autocommit=self._autocommit)
            self._all.append(conn)
            self.free.put_nowait(conn)

    async def close(self) -> None:
        for conn in self._all:
            await conn.close()

    def backend_pids(self) -> list[int]:
        return [conn.info.backend_pid for conn in self._all]


class OursProducer(Producer):
    """`publish_async` in the application's own transaction, as users write it: on a psycopg
    connection (the peer's producer uses one too), or through SQLAlchemy's async engine."""

    def __init__(self, url: str, connections: int, application: str = "psycopg") -> None:
        self._engine: AsyncEngine | None = None
        self._pool: _PsycopgPool | None = None
        if application == "sqlalchemy":
            self._engine = make_async_engine(
                url, pool_size=connections, max_overflow=0, pool_pre_ping=False
            )
        else:
            self._pool = _PsycopgPool(url, connections, autocommit=False)

    async def start(self) -> None:
        if self._pool is not None:
            await self._pool.start()

    async def publish(self, n: int) -> list[str]:
        if self._engine is not None:
            async with self._engine.begin() as conn:
                return [await publish_async(conn, EVENT_TYPE, PAYLOAD) for _ in range(n)]
        assert self._pool is not None
        pg = await self._pool.free.get()
        try:
            async with pg.transaction():
                return [await publish_async(pg, EVENT_TYPE, PAYLOAD) for _ in range(n)]
        finally:
            self._pool.free.put_nowait(pg)

    async def close(self) -> None:
        if self._engine is not None:
            await self._engine.dispose()
        if self._pool is not None:
            await self._pool.close()

    def backend_pids(self) -> list[int] | None:
        return self._pool.backend_pids() if self._pool is not None else None


class PeerProducer(Producer):
    """One pgqueuer job per (event, endpoint), enqueued in the application's transaction."""

    def __init__(self, url: str, connections: int, endpoint_urls: list[str]) -> None:
        self._pool = _PsycopgPool(url, connections, autocommit=True)
        self._urls = endpoint_urls
        self._queries: dict[int, Queries] = {}

    async def start(self) -> None:
        await self._pool.start()

    async def publish(self, n: int) -> list[str]:
        conn = await self._pool.free.get()
        try:
            queries = self._queries.get(id(conn))
            if queries is None:
                queries = self._queries[id(conn)] = Queries(PsycopgDriver(conn))
            ids = [new_message_id() for _ in range(n)]
            now = SystemClock().now()
            payload_json = json.dumps(PAYLOAD, separators=(",", ":"))
            body = render_body(EVENT_TYPE, now, payload_json).decode()
            jobs = [
                json.dumps({"id": message_id, "url": url, "body": body}).encode()
                for message_id in ids
                for url in self._urls
            ]
            async with conn.transaction():
                await queries.enqueue([ENTRYPOINT] * len(jobs), list(jobs), [0] * len(jobs))
            return ids
        finally:
            self._pool.free.put_nowait(conn)

    async def close(self) -> None:
        await self._pool.close()


# -- end to end ------------------------------------------------------------------------


@dataclass(slots=True)
class StepResult:
    target_deliveries_per_s: int
    events_per_s: float
    achieved_publish_per_s: float
    delivered_per_s: float
    backlog_at_end: int
    producer_kept_up: bool
    drained: bool
    sustained: bool
    latency_ms: dict[str, float]
    undelivered: int
    # Ours only: the whole cost per delivery of this step alone (bench/cost.py window,
    # from the end of the step before until every outcome of this one is written).
    cost: dict[str, Any] | None = None


async def open_loop(
    publish: Callable[[int], Awaitable[list[str]]],
    *,
    events_per_s: float,
    seconds: float,
    batch: int,
    connections: int,
) -> tuple[dict[str, float], float, float]:
    """Publish on a fixed schedule; returns ({message id: scheduled time}, t0, end)."""
    slots = max(1, round(events_per_s * seconds / batch))
    interval = batch / events_per_s
    t0 = time.time() + 0.02
    scheduled: dict[str, float] = {}
    next_slot = 0

    async def publisher() -> None:
        nonlocal next_slot
        while next_slot < slots:
            slot = next_slot
            next_slot += 1
            when = t0 + slot * interval
            delay = when - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            for message_id in await publish(batch):
                scheduled[message_id] = when

    await asyncio.gather(*(publisher() for _ in range(min(connections, slots))))
    return scheduled, t0, time.time()


async def run_step(
    receiver: ReceiverProcess,
    producer: Producer,
    *,
    deliveries_per_s: int,
    fanout: int,
    batch: int,
    plan: Plan,
) -> StepResult:
    events_per_s = deliveries_per_s / fanout
    before = await receiver.count()
    scheduled, t0, ended = await open_loop(
        producer.publish,
        events_per_s=events_per_s,
        seconds=plan.step_seconds,
        batch=batch,
        connections=plan.producer_connections,
    )
    expected = len(scheduled) * fanout
    received_at_end = await receiver.count() - before
    backlog = max(0, expected - received_at_end)
    planned = len(scheduled) / events_per_s
    kept_up = ended - t0 <= planned * 1.05 + 0.25
    drain_deadline = time.time() + plan.drain_seconds
    received = received_at_end
    while received < expected and time.time() < drain_deadline:
        await asyncio.sleep(0.05)
        received = await receiver.count() - before
    finished = time.time()
    latencies = [
        (arrived - scheduled[message_id]) * 1000
        for message_id, arrived in await receiver.arrivals()
        if message_id in scheduled
    ]
    sustained = kept_up and received >= expected and backlog <= max(50, deliveries_per_s * 0.5)
    return StepResult(
        target_deliveries_per_s=deliveries_per_s,
        events_per_s=round(events_per_s, 1),
        achieved_publish_per_s=round(len(scheduled) / max(ended - t0, 1e-9), 1),
        delivered_per_s=round(received / max(finished - t0, 1e-9), 1),
        backlog_at_end=backlog,
        producer_kept_up=kept_up,
        drained=received >= expected,
        sustained=sustained,
        latency_ms=percentiles(latencies),
        undelivered=max(0, expected - received),
    )


@dataclass(slots=True)
class EndToEnd:
    name: str
    system: str
    fanout: int
    processes: int
    publish_batch: int
    transport: str
    # how the application holds its connection: "psycopg" (both systems) or "sqlalchemy"
    application: str = "psycopg"
    steps: list[StepResult] = field(default_factory=list)
    sustained_deliveries_per_s: int = 0
    deliveries: int = 0
    commits_per_delivery: float = 0.0
    wal_bytes_per_delivery: float = 0.0
    worker_peak_rss_mb: float = 0.0
    # CPU per delivery of the worker processes over the whole run (idle polling and
    # start-up included), and of this process per published event during the steps
    # (almost all of it is the producer): contention-proof measures of efficiency.
    worker_cpu_ms_per_delivery: float = 0.0
    producer_cpu_ms_per_event: float = 0.0
    unsigned_requests: int = 0
    seconds: float = 0.0
    # Issue 26 (bench/cost.py): the whole cost per delivery over the steps (after the
    # warm-up, until every outcome of the last step is written), ours only, psycopg
    # application only (its backends are known and taken out); `deliveries`' indexes
    # and HOT ratio after the run.
    cost: dict[str, Any] | None = None
    table: dict[str, Any] | None = None


async def end_to_end(
    cluster: Cluster,
    receiver: ReceiverProcess,
    plan: Plan,
    logs: Path,
    *,
    system: str,
    fanout: int,
    processes: int,
    publish_batch: int = 1,
    transport: str = "wire",
    application: str = "psycopg",
) -> EndToEnd:
    began = time.perf_counter()
    name = f"{system} fan-out {fanout}, {processes} proc, {publish_batch}/tx"
    if transport != "wire":
        name += f", {transport}"
    if application != "psycopg":
        name += f", {application} app"
    result = EndToEnd(name, system, fanout, processes, publish_batch, transport, application)
    database = cluster.new_database(system)
    url = cluster.database_url(database)
    paths = [f"/{system}/{database}/e{i}" for i in range(fanout)]
    secret = generate_secret()
    key_setting = generate_key("bench")
    producer: Producer
    if system == "ours":
        box = SecretBox.from_setting(key_setting)
        engine = create_engine(sqlalchemy_url(url))
        with engine.begin() as conn:
            for path in paths:
                create_endpoint(
                    conn,
                    box,
                    url=receiver.url(path),
                    event_types="*",
                    secret=secret,
                    concurrency="fixed",
                )
        engine.dispose()
        workers = WorkerProcesses(
            ours_commands(processes),
            {
                "OUTBOX_DATABASE_URL": url,
                "OUTBOX_SECRET_KEYS": key_setting,
                "OUTBOX_WORKER_MAX_IN_FLIGHT": str(plan.worker_max_in_flight),
                "OUTBOX_WORKER_BATCH_SIZE": str(plan.worker_batch_size),
                "OUTBOX_HTTP_TRANSPORT": transport,
                "OUTBOX_ALLOWED_NETWORKS": LOOPBACK,
                "OUTBOX_LOG_LEVEL": "WARNING",
                "OUTBOX_EVENT_LOOP": plan.event_loop,
            },
            logs / f"{database}.log",
        )
        producer = OursProducer(url, plan.producer_connections, application)
        rates = plan.ours_rates
    else:
        workers = WorkerProcesses(
            peer_commands(url, secret, processes, plan), {}, logs / f"{database}.log"
        )
        producer = PeerProducer(url, plan.producer_connections, [receiver.url(p) for p in paths])
        rates = plan.peer_rates
    commits_before, wal_before = cluster.counters(database)
    received_before = await receiver.count()
    unsigned_before = await receiver.unsigned()
    workers.start()
    await producer.start()
    app_backends = producer.backend_pids() if system == "ours" else None
    whole_from: cost.Snapshot | None = None
    delivered_from = 0

    async def settled_snapshot() -> tuple[cost.Snapshot, int]:
        """Every outcome so far written; the counters then, and deliveries so far."""
        assert app_backends is not None
        await _settled(url)
        found = cost.snapshot(
            url, cluster.postmaster_pid(), workers.cpu_seconds(), app_backends, receiver.pid
        )
        return found, await receiver.count()

    def transactions(steps: list[StepResult]) -> int:
        """The application's publishing transactions in these steps."""
        return sum(
            max(1, round(step.events_per_s * plan.step_seconds / publish_batch)) for step in steps
        )

    try:
        await _warm_up(receiver, producer, fanout)
        if app_backends is not None:
            whole_from, delivered_from = await settled_snapshot()
        step_from, step_delivered_from = whole_from, delivered_from
        producer_cpu = time.process_time()
        for rate in rates:
            step = await run_step(
                receiver,
                producer,
                deliveries_per_s=rate,
                fanout=fanout,
                batch=publish_batch,
                plan=plan,
            )
            if step_from is not None:
                step_to, step_delivered_to = await settled_snapshot()
                step.cost = cost.window(
                    step_from,
                    step_to,
                    step_delivered_to - step_delivered_from,
                    commits_not_ours=transactions([step]),
                )
                step_from, step_delivered_from = step_to, step_delivered_to
            result.steps.append(step)
            if not step.sustained:
                break
            result.sustained_deliveries_per_s = rate
        published = sum(round(step.events_per_s * plan.step_seconds) for step in result.steps)
        result.producer_cpu_ms_per_event = round(
            (time.process_time() - producer_cpu) * 1000 / max(published, 1), 3
        )
        if whole_from is not None and step_from is not None:
            result.cost = cost.window(
                whole_from,
                step_from,
                step_delivered_from - delivered_from,
                commits_not_ours=transactions(result.steps),
            )
    finally:
        result.worker_peak_rss_mb = workers.peak_rss_mb()
        worker_cpu = workers.cpu_seconds()
        workers.stop()
        await producer.close()
    result.deliveries = await receiver.count() - received_before
    result.unsigned_requests = await receiver.unsigned() - unsigned_before
    await receiver.arrivals()
    commits_after, wal_after = cluster.counters(database)
    if system == "ours":
        result.table = cost.table_stats(url)
    if result.deliveries:
        result.worker_cpu_ms_per_delivery = round(worker_cpu * 1000 / result.deliveries, 3)
        result.commits_per_delivery = round((commits_after - commits_before) / result.deliveries, 3)
        result.wal_bytes_per_delivery = round((wal_after - wal_before) / result.deliveries)
    result.seconds = round(time.perf_counter() - began, 1)
    return result


async def _settled(url: str, seconds: float = 30.0) -> None:
    """Wait until nothing is scheduled or in flight: every outcome so far is written."""
    engine = create_engine(sqlalchemy_url(url))
    deadline = time.time() + seconds
    try:
        while time.time() < deadline:
            with engine.connect() as conn:
                pending = conn.execute(
                    text(
                        "SELECT (SELECT count(*) FROM deliveries"
                        " WHERE state IN ('scheduled', 'in_flight'))"
                        " + (SELECT count(*) FROM outbox_events WHERE relayed_at IS NULL)"
                    )
                ).scalar_one()
            if not pending:
                return
            await asyncio.sleep(0.02)
    finally:
        engine.dispose()


async def _warm_up(receiver: ReceiverProcess, producer: Producer, fanout: int) -> None:
    """One event through the whole path, so start-up is not measured as latency."""
    before = await receiver.count()
    await producer.publish(1)
    deadline = time.time() + 60
    while await receiver.wait_for(before + fanout) - before < fanout:
        if time.time() > deadline:
            raise RuntimeError("the worker delivered nothing within 60 s; see the worker log")
    await receiver.arrivals()


# -- relay alone, claim and complete, transports, RSS ----------------------------------------
