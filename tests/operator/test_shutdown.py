"""`outbox run` as a real process: SIGTERM during delivery loses nothing and exits 0."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest
from sqlalchemy import Engine

from delivery.receiver import Receiver
from outbox import publish
from outbox.crypto import SecretBox, generate_key
from tests.helpers import add_endpoint, rows, scalar, until

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


async def test_sigterm_during_delivery_loses_nothing(
    engine: Engine, database_url: str, receiver: Receiver
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

    states = {
        r["state"]: r["n"]
        for r in rows(engine, "SELECT state, count(*) AS n FROM deliveries GROUP BY state")
    }
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

    second = await _start(database_url, key)
    await until(
        lambda: (
            scalar(engine, "SELECT count(*) FROM deliveries WHERE state = 'succeeded'") == events
        ),
        "every delivery to succeed",
        seconds=60,
    )
    second.send_signal(signal.SIGTERM)
    _, stderr = await asyncio.wait_for(second.communicate(), timeout=30)
    assert second.returncode == 0, stderr.decode()
    assert {r.headers["webhook-id"] for r in receiver.requests} == published
