"""The benchmark: every figure of issue 7 from one command, on its own database and receiver.

Layout of one run (everything on this host):

    bench process (this one): orchestration, the open-loop producer, relay-alone
        and claim-and-complete measurements, the transport comparison
    receiver process (bench.receiver): raw asyncio HTTP, timestamps arrivals
    worker process(es): `outbox run --processes N`, or bench.pgq_worker for the peer
    PostgreSQL: the embedded server, default (durable) settings, deleted at the end

End to end is open loop: event i is *scheduled* at t0 + i/rate and published by
whichever producer connection is free; latency is taken from the scheduled time to
the receiver's arrival time, so a producer or queue that falls behind shows up in
the latency instead of being hidden by it (no coordinated omission). A step counts
as sustained when the producer kept its schedule, everything published arrived, and
the backlog at the end of the step was at most half a second's worth of deliveries
(at least 50 rows), i.e. the system was not falling behind. Runs of ours and of the
peer alternate, and each is repeated (`Plan.repeat`), because the box is shared.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
from pgqueuer import PsycopgDriver
from pgqueuer.queries import Queries
from sqlalchemy import Engine, create_engine, make_url, text
from sqlalchemy.ext.asyncio import AsyncEngine

from bench.pgq_worker import ENTRYPOINT
from bench.stats import percentiles
from delivery.http import AttemptResult, build_http_client
from delivery.policy import Outcome
from delivery.worker import ClaimedDelivery, Worker, WorkerConfig, render_body
from outbox.clock import SystemClock
from outbox.crypto import SecretBox, generate_key, generate_secret
from outbox.db import libpq_url, make_async_engine, sqlalchemy_url
from outbox.embedded import EmbeddedPostgres
from outbox.endpoints import create_endpoint
from outbox.ids import new_message_id
from outbox.migrate import upgrade
from outbox.publish import publish_async
from outbox.relay import Relay, RelayConfig

REPO = Path(__file__).resolve().parent.parent
# The benchmark's receiver is on loopback, which the SSRF guard refuses unless allowed.
LOOPBACK = "127.0.0.0/8"
EVENT_TYPE = "order.created"
PAYLOAD = {"order_id": 123456, "customer": "cus_8f2a", "total_cents": 4999}


@dataclass(frozen=True, slots=True)
class Plan:
    """What to measure and how hard; `quick()` is the smoke test's tiny version."""

    step_seconds: float = 4.0
    # One ladder for both systems, so that neither ratio side gains from finer steps.
    ours_rates: tuple[int, ...] = (250, 500, 750, 1000, 1250, 1500, 2000, 2500, 3000, 4000, 5000)
    peer_rates: tuple[int, ...] = (250, 500, 750, 1000, 1250, 1500, 2000, 2500, 3000, 4000, 5000)
    fanouts: tuple[int, ...] = (1, 10)
    processes: tuple[int, ...] = (1, 2)
    publish_batch: int = 10
    producer_connections: int = 16
    drain_seconds: float = 8.0
    relay_events: int = 100_000
    claim_deliveries: int = 50_000
    claim_loops: int = 4
    transport_seconds: float = 3.0
    rss_in_flight: int = 1000
    slow_delay: float = 4.0
    worker_max_in_flight: int = 200
    worker_batch_size: int = 100
    peer: bool = True
    repeat: int = 2
    # Backlog drains (bench/drain.py): a partner answering in `drain_latency` s, one at once.
    drain_latency: float = 0.2
    drain_slow_backlog: int = 3000
    drain_backlog: int = 20_000
    # Flat cost (bench/flat.py): a grown database against an empty one.
    flat_backlog: int = 1_000_000
    flat_history: int = 10_000_000
    flat_events: int = 20_000
    flat_rounds: int = 3
    # "core": the issue-7 rows; "drain": bench/drain.py; "flat": bench/flat.py.
    sections: tuple[str, ...] = ("core", "drain", "flat")
    event_loop: str = "auto"  # OUTBOX_EVENT_LOOP of the worker processes
    scale_quick: bool = False  # bench/scale.py at its quick sizes

    @classmethod
    def quick(cls) -> Plan:
        return cls(
            step_seconds=1.0,
            ours_rates=(40, 80),
            peer_rates=(40, 80),
            fanouts=(1, 2),
            processes=(1, 2),
            publish_batch=4,
            producer_connections=4,
            drain_seconds=15.0,
            relay_events=2_000,
            claim_deliveries=2_000,
            claim_loops=2,
            transport_seconds=0.5,
            rss_in_flight=40,
            slow_delay=2.0,
            repeat=1,
            drain_slow_backlog=300,
            drain_backlog=300,
            flat_backlog=500,
            flat_history=2_000,
            flat_events=500,
            flat_rounds=1,
            scale_quick=True,
        )


# -- the PostgreSQL cluster --------------------------------------------------------------


class Cluster:
    """The embedded server, a migrated template database, and one fresh database per run."""

    def __init__(self, root: Path) -> None:
        self._server = EmbeddedPostgres(root, delete_on_stop=True)
        self.url = ""
        self._admin: Engine | None = None
        self._template = "bench_template"

    def start(self) -> None:
        self.url = self._server.start()
        self._admin = create_engine(sqlalchemy_url(self.url), isolation_level="AUTOCOMMIT")
        with self._admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{self._template}"'))
        template_url = self.database_url(self._template)
        engine = create_engine(sqlalchemy_url(template_url))
        upgrade(engine)
        engine.dispose()
        asyncio.run(_install_pgqueuer(template_url))

    def stop(self) -> None:
        if self._admin is not None:
            self._admin.dispose()
        self._server.stop()

    def database_url(self, name: str) -> str:
        return make_url(sqlalchemy_url(self.url)).set(database=name).render_as_string(False)

    def new_database(self, label: str) -> str:
        assert self._admin is not None
        name = f"bench_{label}_{uuid.uuid4().hex[:6]}"
        with self._admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}" TEMPLATE "{self._template}"'))
        return name

    def counters(self, database: str) -> tuple[int, int]:
        """(commits in `database`, WAL position in bytes) as of now."""
        assert self._admin is not None
        with self._admin.connect() as conn:
            conn.execute(text("SELECT pg_stat_clear_snapshot()"))
            commits = conn.execute(
                text("SELECT xact_commit FROM pg_stat_database WHERE datname = :d"),
                {"d": database},
            ).scalar_one()
            lsn = conn.execute(
                text("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint")
            ).scalar_one()
        return int(commits), int(lsn)

    def settings(self) -> dict[str, str]:
        assert self._admin is not None
        names = ["server_version", "synchronous_commit", "fsync", "shared_buffers", "wal_level"]
        with self._admin.connect() as conn:
            return {name: str(conn.execute(text(f"SHOW {name}")).scalar_one()) for name in names}


async def _install_pgqueuer(url: str) -> None:
    async with await psycopg.AsyncConnection.connect(libpq_url(url), autocommit=True) as conn:
        await Queries(PsycopgDriver(conn)).install()


# -- processes -------------------------------------------------------------------------


class ReceiverProcess:
    """bench.receiver in its own process, and a small client for its control paths."""

    def __init__(self, slow_delay: float) -> None:
        self._slow_delay = slow_delay
        self._process: subprocess.Popen[str] | None = None
        self.port = 0
        self._client: httpx.AsyncClient | None = None

    def start(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "bench.receiver", "--slow-delay", str(self._slow_delay)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
            env=_child_env({}),
        )
        assert self._process.stdout is not None
        self.port = int(self._process.stdout.readline())

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(10)
            if self._process.stdout is not None:
                self._process.stdout.close()
            self._process = None

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    @contextlib.asynccontextmanager
    async def client(self) -> AsyncIterator[None]:
        async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
            self._client = client
            try:
                yield
            finally:
                self._client = None

    async def count(self) -> int:
        assert self._client is not None
        return int((await self._client.get(self.url("/_count"))).json()["count"])

    async def unsigned(self) -> int:
        assert self._client is not None
        return int((await self._client.get(self.url("/_count"))).json()["unsigned"])

    async def arrivals(self) -> list[tuple[str, float]]:
        assert self._client is not None
        return [(m, t) for m, t in (await self._client.get(self.url("/_arrivals"))).json()]


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def peak_rss_mb(pid: int) -> float:
    """The largest VmHWM (peak resident set) among `pid` and its descendants, in MB."""
    peaks = []
    for proc in _tree(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{proc}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peaks.append(int(line.split()[1]) / 1024)
    return round(max(peaks, default=0.0), 1)


def cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` and its live descendants (from /proc/<pid>/stat)."""
    ticks = 0
    for proc in _tree(pid):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{proc}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def _tree(pid: int) -> list[int]:
    found = [pid]
    with contextlib.suppress(OSError):
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            found += _tree(int(child))
    return found


class WorkerProcesses:
    """The system under test: our `outbox run`, or N pgqueuer workers."""

    def __init__(self, commands: list[list[str]], env: dict[str, str], log: Path) -> None:
        self._commands = commands
        self._env = env
        self._log = log
        self._processes: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        with self._log.open("ab") as log:
            for command in self._commands:
                self._processes.append(
                    subprocess.Popen(
                        command, cwd=REPO, env=_child_env(self._env), stdout=log, stderr=log
                    )
                )

    def peak_rss_mb(self) -> float:
        return max((peak_rss_mb(p.pid) for p in self._processes), default=0.0)

    def cpu_seconds(self) -> float:
        """User + system CPU used so far by the worker processes and their children."""
        return sum(cpu_seconds(p.pid) for p in self._processes)

    def stop(self) -> None:
        for process in self._processes:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        for process in self._processes:
            try:
                process.wait(40)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._processes = []


def ours_commands(processes: int) -> list[list[str]]:
    run = "from delivery.operator.cli import main; main()"
    return [[sys.executable, "-c", run, "run", "--processes", str(processes)]]


def peer_commands(url: str, secret: str, processes: int, plan: Plan) -> list[list[str]]:
    return [
        [
            sys.executable,
            "-m",
            "bench.pgq_worker",
            url,
            secret,
            "--batch",
            str(plan.worker_batch_size),
            "--concurrency",
            str(plan.worker_max_in_flight),
        ]
        for _ in range(processes)
    ]


# -- producers -------------------------------------------------------------------------


class Producer:
    """Publishes `n` events in one application transaction; returns their message ids."""

    async def start(self) -> None:
        return None

    async def publish(self, n: int) -> list[str]:
        raise NotImplementedError

    async def close(self) -> None:
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
                create_endpoint(conn, box, url=receiver.url(path), event_types="*", secret=secret)
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
    try:
        await _warm_up(receiver, producer, fanout)
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
            result.steps.append(step)
            if not step.sustained:
                break
            result.sustained_deliveries_per_s = rate
        published = sum(round(step.events_per_s * plan.step_seconds) for step in result.steps)
        result.producer_cpu_ms_per_event = round(
            (time.process_time() - producer_cpu) * 1000 / max(published, 1), 3
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
    if result.deliveries:
        result.worker_cpu_ms_per_delivery = round(worker_cpu * 1000 / result.deliveries, 3)
        result.commits_per_delivery = round((commits_after - commits_before) / result.deliveries, 3)
        result.wal_bytes_per_delivery = round((wal_after - wal_before) / result.deliveries)
    result.seconds = round(time.perf_counter() - began, 1)
    return result


async def _warm_up(receiver: ReceiverProcess, producer: Producer, fanout: int) -> None:
    """One event through the whole path, so start-up is not measured as latency."""
    before = await receiver.count()
    await producer.publish(1)
    deadline = time.time() + 60
    while await receiver.count() - before < fanout:
        if time.time() > deadline:
            raise RuntimeError("the worker delivered nothing within 60 s; see the worker log")
        await asyncio.sleep(0.05)
    await receiver.arrivals()


# -- relay alone, claim and complete, transports, RSS ----------------------------------------


def _preload_events(
    url: str, count: int, fanout: int, endpoint_url: str, box: SecretBox | None = None
) -> None:
    box = box or SecretBox.from_setting(generate_key("bench"))
    engine = create_engine(sqlalchemy_url(url))
    with engine.begin() as conn:
        for _ in range(fanout):
            create_endpoint(conn, box, url=endpoint_url, event_types="*")
        conn.execute(
            text(
                """
                INSERT INTO outbox_events (message_id, tenant_id, event_type, payload)
                SELECT 'msg_bench_' || g, (SELECT id FROM tenants WHERE uid = 'default'),
                       :event_type, CAST(:payload AS jsonb)
                FROM generate_series(1, :count) AS g
                """
            ),
            {"event_type": EVENT_TYPE, "payload": json.dumps(PAYLOAD), "count": count},
        )
    _vacuum(url)
    engine.dispose()


def _vacuum(url: str) -> None:
    engine = create_engine(sqlalchemy_url(url), isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text("VACUUM ANALYZE"))
    engine.dispose()


async def relay_alone(cluster: Cluster, plan: Plan, batch_size: int, fanout: int) -> dict[str, Any]:
    database = cluster.new_database("relay")
    url = cluster.database_url(database)
    _preload_events(url, plan.relay_events, fanout, "http://127.0.0.1:9/unused")
    commits_before, wal_before = cluster.counters(database)
    engine = make_async_engine(url, pool_pre_ping=False)
    relay = Relay(engine, SystemClock(), RelayConfig(batch_size=batch_size))
    began = time.perf_counter()
    done = await relay.run_until_idle()
    elapsed = time.perf_counter() - began
    await engine.dispose()
    commits_after, wal_after = cluster.counters(database)
    return {
        "events": done.events,
        "deliveries": done.deliveries,
        "fanout": fanout,
        "batch_size": batch_size,
        "seconds": round(elapsed, 2),
        "events_per_s": round(done.events / elapsed),
        "delivery_rows_per_s": round(done.deliveries / elapsed),
        "commits": commits_after - commits_before,
        "wal_bytes_per_delivery": round((wal_after - wal_before) / max(done.deliveries, 1)),
    }


def _succeeded(claimed: ClaimedDelivery, now: Any) -> AttemptResult:
    return AttemptResult(
        delivery_id=claimed.id,
        started_at=now,
        duration_ms=1,
        outcome=Outcome.SUCCEEDED,
        status_code=200,
        response_excerpt="",
        request_headers={"webhook-id": claimed.request.message_id},
    )


async def claim_and_complete(
    cluster: Cluster, plan: Plan, batch_size: int, processes: int = 1
) -> dict[str, Any]:
    """The worker's own claim and record paths, with the HTTP attempt replaced by success.

    With `processes` > 1 the loops run in that many spawned processes (each with
    `plan.claim_loops` loops), the way `outbox run --processes N` would; the rate is
    taken from the first loop's start to the last loop's end, across processes.
    """
    database = cluster.new_database("claim")
    url = cluster.database_url(database)
    key_setting = generate_key("bench")
    box = SecretBox.from_setting(key_setting)
    _preload_events(url, plan.claim_deliveries, 1, "http://127.0.0.1:9/unused", box)
    engine = make_async_engine(url, pool_pre_ping=False)
    await Relay(engine, SystemClock(), RelayConfig(batch_size=2000)).run_until_idle()
    await engine.dispose()
    _vacuum(url)
    commits_before, wal_before = cluster.counters(database)
    if processes == 1:
        spans = [await claim_loops(url, key_setting, batch_size, plan.claim_loops, "bench.0")]
    else:
        loop = asyncio.get_running_loop()
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(processes, mp_context=context) as pool:
            spans = await asyncio.gather(
                *(
                    loop.run_in_executor(
                        pool,
                        _claim_loops_in_process,
                        url,
                        key_setting,
                        batch_size,
                        plan.claim_loops,
                        f"bench.{index}",
                    )
                    for index in range(processes)
                )
            )
    done = sum(count for count, _, _ in spans)
    elapsed = max(end for _, _, end in spans) - min(start for _, start, _ in spans)
    commits_after, wal_after = cluster.counters(database)
    return {
        "deliveries": done,
        "batch_size": batch_size,
        "processes": processes,
        "concurrent_loops": plan.claim_loops,
        "seconds": round(elapsed, 2),
        "deliveries_per_s": round(done / elapsed),
        "commits_per_delivery": round((commits_after - commits_before) / max(done, 1), 4),
        "wal_bytes_per_delivery": round((wal_after - wal_before) / max(done, 1)),
    }


def _claim_loops_in_process(
    url: str, key_setting: str, batch_size: int, loops: int, worker_id: str
) -> tuple[int, float, float]:
    return asyncio.run(claim_loops(url, key_setting, batch_size, loops, worker_id))


async def claim_loops(
    url: str, key_setting: str, batch_size: int, loops: int, worker_id: str
) -> tuple[int, float, float]:
    """Claim and record until nothing is due; returns (succeeded, start, end) wall times."""
    engine = make_async_engine(url, pool_size=loops + 1, pool_pre_ping=False)
    clock = SystemClock()
    worker = Worker(
        engine,
        httpx.AsyncClient(),  # never used: the attempt is replaced by a success
        SecretBox.from_setting(key_setting),
        clock,
        WorkerConfig(worker_id=worker_id, batch_size=batch_size),
    )
    done = 0

    async def loop() -> None:
        nonlocal done
        while True:
            claimed = await worker.claim(batch_size)
            if not claimed:
                return
            now = clock.now()
            stats = await worker.record([(c, _succeeded(c, now)) for c in claimed])
            done += stats.succeeded

    async with engine.connect():  # open the pool before the clock starts
        pass
    began = time.time()
    await asyncio.gather(*(loop() for _ in range(loops)))
    ended = time.time()
    await engine.dispose()
    return done, began, ended


async def transports(receiver: ReceiverProcess, plan: Plan) -> dict[str, Any]:
    """Requests/s from this process to the receiver through each wire, 10 and 100 concurrent."""
    results: dict[str, Any] = {}
    for concurrency in (10, 100):
        for name in ("httpx", "wire"):
            results[f"{name}_{concurrency}"] = await _requests_per_s(
                receiver.url("/transport"), name, concurrency, plan.transport_seconds
            )
        results[f"wire_over_httpx_{concurrency}"] = round(
            results[f"wire_{concurrency}"] / max(results[f"httpx_{concurrency}"], 1), 1
        )
    return results


async def _requests_per_s(url: str, transport: str, concurrency: int, seconds: float) -> int:
    async with build_http_client(
        max_connections=100, timeout=10, transport=transport, allowed_networks=(LOOPBACK,)
    ) as client:
        await asyncio.gather(*(client.post(url, content=b"{}") for _ in range(concurrency)))
        done = 0
        stop_at = time.perf_counter() + seconds

        async def one() -> None:
            nonlocal done
            while time.perf_counter() < stop_at:
                response = await client.post(url, content=b'{"a":1}')
                response.raise_for_status()
                done += 1

        began = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(concurrency)))
        return round(done / (time.perf_counter() - began))


async def rss_in_flight(
    cluster: Cluster, receiver: ReceiverProcess, plan: Plan, logs: Path
) -> dict[str, Any]:
    """Worker peak RSS with `rss_in_flight` deliveries held open by a slow receiver."""
    database = cluster.new_database("rss")
    url = cluster.database_url(database)
    key_setting = generate_key("bench")
    box = SecretBox.from_setting(key_setting)
    engine = create_engine(sqlalchemy_url(url))
    with engine.begin() as conn:
        create_endpoint(conn, box, url=receiver.url(f"/slow/{database}"), event_types="*")
        conn.execute(
            text(
                """
                INSERT INTO outbox_events (message_id, tenant_id, event_type, payload)
                SELECT 'msg_rss_' || g, (SELECT id FROM tenants WHERE uid = 'default'),
                       :event_type, CAST(:payload AS jsonb)
                FROM generate_series(1, :count) AS g
                """
            ),
            {
                "event_type": EVENT_TYPE,
                "payload": json.dumps(PAYLOAD),
                "count": 2 * plan.rss_in_flight,
            },
        )
    workers = WorkerProcesses(
        ours_commands(1),
        {
            "OUTBOX_DATABASE_URL": url,
            "OUTBOX_SECRET_KEYS": key_setting,
            "OUTBOX_WORKER_MAX_IN_FLIGHT": str(plan.rss_in_flight),
            "OUTBOX_ALLOWED_NETWORKS": LOOPBACK,
            "OUTBOX_WORKER_BATCH_SIZE": str(min(500, plan.rss_in_flight)),
            "OUTBOX_REQUEST_TIMEOUT": str(plan.slow_delay * 3),
            "OUTBOX_LEASE_SECONDS": str(plan.slow_delay * 10),
            # One endpoint here, and by default one endpoint may hold only half the
            # worker's slots (endpoint health): let it hold them all for this figure.
            "OUTBOX_WORKER_ENDPOINT_SHARE": "1",
        },
        logs / f"{database}.log",
    )
    workers.start()
    most = 0
    try:
        deadline = time.time() + plan.slow_delay * 3 + 20
        while time.time() < deadline:
            with engine.connect() as conn:
                in_flight = conn.execute(
                    text("SELECT count(*) FROM deliveries WHERE state = 'in_flight'")
                ).scalar_one()
            most = max(most, int(in_flight))
            if most >= plan.rss_in_flight:
                await asyncio.sleep(plan.slow_delay / 2)
                break
            await asyncio.sleep(0.1)
        peak = workers.peak_rss_mb()
    finally:
        workers.stop()
        engine.dispose()
    return {"in_flight": most, "max_in_flight": plan.rss_in_flight, "worker_peak_rss_mb": peak}


# -- the whole run ----------------------------------------------------------------------


def _as_json(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _as_json(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, list):
        return [_as_json(v) for v in value]
    return value


@contextlib.contextmanager
def _environment(plan: Plan) -> Iterator[tuple[Cluster, ReceiverProcess, Path]]:
    with tempfile.TemporaryDirectory(prefix="outbox-bench-") as root:
        cluster = Cluster(Path(root))
        receiver = ReceiverProcess(plan.slow_delay)
        logs = Path(root) / "logs"
        logs.mkdir()
        try:
            cluster.start()
            receiver.start()
            yield cluster, receiver, logs
        finally:
            receiver.stop()
            cluster.stop()


def run(plan: Plan, progress: Callable[[str], None]) -> dict[str, Any]:
    """Run every measurement of the plan; returns the results as plain JSON data."""
    began = time.perf_counter()
    with _environment(plan) as (cluster, receiver, logs):
        results: dict[str, Any] = asyncio.run(_run(plan, cluster, receiver, logs, progress))
        results["postgres"] = cluster.settings()
    results["machine"] = machine()
    results["plan"] = dataclasses.asdict(plan)
    results["total_seconds"] = round(time.perf_counter() - began, 1)
    return results


async def _run(
    plan: Plan,
    cluster: Cluster,
    receiver: ReceiverProcess,
    logs: Path,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    results: dict[str, Any] = {"end_to_end": []}
    async with receiver.client():
        if "drain" in plan.sections:
            from bench.drain import drains

            progress("backlog drains: slow partner, instant partner, raw ceiling, 2 processes")
            results["drain"] = await drains(cluster, receiver, plan, logs)
        if "flat" in plan.sections:
            from bench.flat import flat_cost

            progress(
                f"flat cost: {plan.flat_backlog} backlog and {plan.flat_history} history "
                "rows against empty tables"
            )
            results["flat"] = await flat_cost(cluster, plan)
        if "core" not in plan.sections:
            if "scale" in plan.sections:  # (core runs it too)
                from bench import scale  # (imports this module)

                scale_plan = scale.ScalePlan.quick() if plan.scale_quick else scale.ScalePlan()
                results["scale"] = await scale.measure(cluster, scale_plan, progress)
            return results
        progress("transports: httpx default pool vs our wire")
        results["transports"] = await transports(receiver, plan)
        progress("relay alone")
        default_batch = RelayConfig().batch_size
        results["relay"] = await relay_alone(cluster, plan, default_batch, fanout=1)
        results["relay_batch_2000"] = await relay_alone(cluster, plan, 2000, fanout=1)
        results["relay_fanout"] = await relay_alone(
            cluster, plan, default_batch, fanout=max(plan.fanouts)
        )
        progress("claim and complete without HTTP")
        results["claim_complete"] = await claim_and_complete(cluster, plan, batch_size=500)
        results["claim_complete_2"] = await claim_and_complete(
            cluster, plan, batch_size=500, processes=2
        )
        from bench import scale  # (imports this module)

        scale_plan = scale.ScalePlan.quick() if plan.scale_quick else scale.ScalePlan()
        results["scale"] = await scale.measure(cluster, scale_plan, progress)
        # Ours and the peer alternate so that background noise hits both alike.
        paired: list[dict[str, Any]] = []
        for fanout in plan.fanouts:
            paired.append({"system": "ours", "fanout": fanout, "processes": 1})
            if plan.peer:
                paired.append({"system": "pgqueuer", "fanout": fanout, "processes": 1})
        scaling = [
            {"system": "ours", "fanout": f, "processes": p}
            for f in plan.fanouts
            for p in plan.processes
            if p > 1
        ]
        batched = [
            {"system": "ours", "fanout": 1, "processes": 1, "publish_batch": plan.publish_batch},
            {"system": "ours", "fanout": 1, "processes": 1, "application": "sqlalchemy"},
        ]
        runs = (paired + scaling) * plan.repeat + batched
        for spec in runs:
            progress(f"end to end: {spec}")
            outcome = await end_to_end(cluster, receiver, plan, logs, **spec)
            results["end_to_end"].append(_as_json(outcome))
        progress("worker RSS with deliveries in flight")
        results["rss"] = await rss_in_flight(cluster, receiver, plan, logs)
    results["ratios"] = ratios(results["end_to_end"])
    return results


def sustained_median(runs: list[dict[str, Any]], **match: Any) -> float | None:
    """The median sustained rate of the repetitions of one configuration (by default one
    event per transaction on a psycopg connection; runs from before the application was
    recorded match either)."""
    match.setdefault("publish_batch", 1)
    match.setdefault("application", "psycopg")
    found = [
        r["sustained_deliveries_per_s"]
        for r in runs
        if all(r.get(key, value) == value for key, value in match.items())
    ]
    return statistics.median(found) if found else None


def ratios(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    """Ours over pgqueuer's median sustained rate, same fan-out, both with one process."""
    found: dict[str, float | None] = {}
    for fanout in sorted({r["fanout"] for r in runs if r["system"] == "pgqueuer"}):
        ours = sustained_median(runs, system="ours", fanout=fanout, processes=1)
        theirs = sustained_median(runs, system="pgqueuer", fanout=fanout, processes=1)
        found[f"fanout_{fanout}"] = round(ours / theirs, 2) if ours and theirs else None
    return found


def machine() -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"cpus": os.cpu_count(), "cpu": cpu, "python": sys.version.split()[0]}
