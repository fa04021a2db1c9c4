"""`outbox run` as a real process: SIGTERM during delivery loses nothing and exits 0;
Ctrl-C says what it waits for, and Ctrl-C again stops at once, handing the claims back."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import re
import signal
import sys
from pathlib import Path

import pytest
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.receiver import Receiver
from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox, generate_key
from tests.helpers import add_endpoint, rows, scalar, until
from tests.operator_helpers import deliver

# A real `outbox run` process, stopped mid-delivery.
pytestmark = pytest.mark.slow

RUN = [sys.executable, "-c", "from delivery.operator.cli import main; main()", "run"]


async def _start(database_url: str, key: str) -> asyncio.subprocess.Process:
    env = {
        **os.environ,
        "OUTBOX_DATABASE_URL": database_url,
        "OUTBOX_SECRET_KEYS": key,
        "OUTBOX_ALLOWED_NETWORKS": "127.0.0.0/8",
        "OUTBOX_WORKER_MAX_IN_FLIGHT": "4",
        "OUTBOX_WORKER_POLL_INTERVAL": "0.1",
        "OUTBOX_RELAY_POLL_INTERVAL": "0.1",
    }
    return await asyncio.create_subprocess_exec(
        *RUN, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )


def _states(engine: Engine) -> dict[str, int]:
    found = rows(engine, "SELECT state, count(*) AS n FROM deliveries GROUP BY state")
    return {r["state"]: r["n"] for r in found}


async def test_sigterm_during_delivery_loses_nothing(
    engine: Engine, async_engine: AsyncEngine, database_url: str, receiver: Receiver
) -> None:
    key = generate_key("shutdown")
    box = SecretBox.from_setting(key)
    add_endpoint(engine, box, receiver.route("/slow", delay=0.3))
    events = 30
    with engine.begin() as conn:
        published = {publish(conn, "order.created", {"i": i}) for i in range(events)}

    # The deadlines bound a hang: `outbox run` starting on a busy box may take a while.
    first = await _start(database_url, key)
    await until(lambda: len(receiver.requests) >= 3, "3 requests", seconds=60)
    first.send_signal(signal.SIGTERM)
    _, stderr = await asyncio.wait_for(first.communicate(), timeout=30)
    assert first.returncode == 0, stderr.decode()
    assert b"Traceback" not in stderr

    states = _states(engine)
    assert "in_flight" not in states, stderr.decode()  # finished or handed back
    assert sum(states.values()) == events
    assert 0 < states.get("succeeded", 0) < events
    succeeded_ids = {
        r["message_id"]
        for r in rows(
            engine,
            "SELECT ev.message_id FROM deliveries d JOIN outbox_events ev ON ev.id = d.event_id"
            " WHERE d.state = 'succeeded'",
        )
    }
    assert succeeded_ids <= {r.headers["webhook-id"] for r in receiver.requests}

    # What was handed back is claimable as it is: the same worker code `outbox run` runs
    # (in this process: a second `outbox run` would only add its start-up) delivers the
    # rest, each under the webhook-id its event always had.
    await deliver(async_engine, box, ManualClock(dt.datetime.now(dt.UTC)))
    assert _states(engine) == {"succeeded": events}
    assert {r.headers["webhook-id"] for r in receiver.requests} == published


@pytest.mark.parametrize(("processes", "to_group"), [("1", True), ("2", True), ("2", False)])
async def test_ctrl_c_says_what_it_waits_for_and_ctrl_c_again_hands_the_claims_back(
    engine: Engine,
    database_url: str,
    receiver: Receiver,
    tmp_path: Path,
    processes: str,
    to_group: bool,
) -> None:
    """One process, and the supervisor with two (the default on a two-core box). A
    terminal's Ctrl-C goes to the whole process group (the children too); `kill -INT`
    to the supervisor alone must work the same."""
    key = generate_key("shutdown")
    add_endpoint(engine, SecretBox.from_setting(key), receiver.route("/hangs", delay=600))
    with engine.begin() as conn:
        for i in range(3):
            publish(conn, "order.created", {"i": i})
    log = tmp_path / "run.log"
    env = {
        **os.environ,
        "OUTBOX_DATABASE_URL": database_url,
        "OUTBOX_SECRET_KEYS": key,
        "OUTBOX_ALLOWED_NETWORKS": "127.0.0.0/8",
        "OUTBOX_PROCESSES": processes,
        "OUTBOX_REQUEST_TIMEOUT": "120",  # the deadline a plain stop would wait out
        "OUTBOX_LEASE_SECONDS": "300",
        "OUTBOX_WORKER_POLL_INTERVAL": "0.1",
        "OUTBOX_RELAY_POLL_INTERVAL": "0.1",
    }
    with log.open("wb") as out:
        run = await asyncio.create_subprocess_exec(
            *RUN, env=env, stderr=out, start_new_session=True
        )

    def ctrl_c() -> None:
        if to_group:
            os.killpg(run.pid, signal.SIGINT)
        else:
            run.send_signal(signal.SIGINT)

    try:
        in_flight = "SELECT count(*) FROM deliveries WHERE state = 'in_flight'"
        await until(
            # The receiver first: it costs nothing, the query runs once it holds three.
            lambda: len(receiver.requests) == 3 and scalar(engine, in_flight) == 3,
            "3 attempts in flight",
            seconds=60,
        )

        ctrl_c()
        waiting = re.compile(
            r"waiting for (\d+) attempts? in flight \(deadline 30s\); Ctrl-C again to stop now"
        )
        # One line per process that has attempts in flight; together they wait for three.
        await until(
            lambda: sum(map(int, waiting.findall(log.read_text()))) == 3,
            "the waiting lines for 3 attempts",
            seconds=60,
        )
        assert run.returncode is None  # still waiting: the receiver has not answered
        assert scalar(engine, in_flight) == 3

        ctrl_c()
        async with asyncio.timeout(20):  # at once, not after the 30 s grace or the lease
            assert await run.wait() == 0, log.read_text()
    finally:
        if run.returncode is None:
            run.kill()
            await run.wait()
    output = log.read_text()
    assert "Traceback" not in output and "outbox stopped" in output, output
    assert "1 attempts" not in output
    handed_back = rows(
        engine,
        "SELECT state, attempts, locked_by, lease_expires_at, next_attempt_at <= now() AS due"
        " FROM deliveries",
    )
    assert handed_back == [
        {"state": "scheduled", "attempts": 0, "locked_by": None, "lease_expires_at": None,
         "due": True}
    ] * 3, output  # fmt: skip
