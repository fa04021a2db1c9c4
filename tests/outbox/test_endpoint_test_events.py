"""`outbox endpoints test ID` and POST /v1/endpoints/{uid}/test: one event, through the real
worker, to one endpoint, and the outcome printed."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import httpx
import pytest
from click.testing import CliRunner
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.http import build_http_client
from delivery.operator.api import create_app
from delivery.operator.cli import main
from delivery.receiver import Receiver
from delivery.verify import verify
from delivery.worker import Worker, WorkerConfig
from outbox.catalogue import add_event_type
from outbox.clock import Clock, ManualClock, SystemClock
from outbox.crypto import SecretBox, generate_key
from outbox.tokens import create_token
from tests.helpers import LOOPBACK, add_endpoint, scalar


@contextlib.asynccontextmanager
async def worker_running(
    async_engine: AsyncEngine, box: SecretBox, clock: Clock
) -> AsyncIterator[None]:
    """A worker polling in the background, as `outbox run` would."""
    stop = asyncio.Event()

    async def loop() -> None:
        async with build_http_client(
            max_connections=5, timeout=5, allowed_networks=LOOPBACK
        ) as http:
            worker = Worker(async_engine, http, box, clock, WorkerConfig(lease_seconds=30))
            while not stop.is_set():
                if not (await worker.run_once()).claimed:
                    await asyncio.sleep(0.02)  # the idle loop's poll interval

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        stop.set()
        await task


async def test_cli_sends_a_ping_and_a_catalogued_example_to_one_endpoint_only(
    engine: Engine,
    async_engine: AsyncEngine,
    receiver: Receiver,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    key = generate_key("t")
    box = SecretBox.from_setting(key)
    target = add_endpoint(engine, box, receiver.route("/target"), "order.*")
    add_endpoint(engine, box, receiver.route("/sibling"), "*")
    broken = add_endpoint(engine, box, receiver.route("/broken", status=500), "*")
    with engine.begin() as conn:
        add_event_type(
            conn,
            "order.created",
            schema={"type": "object"},
            example={"id": "ord_example"},
            actor="t",
        )
        add_event_type(conn, "order.paid", schema={"type": "object"}, actor="t")
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    monkeypatch.setenv("OUTBOX_SECRET_KEYS", key)
    cli = CliRunner()

    def run(*args: str) -> tuple[int, str]:
        result = cli.invoke(main, ["endpoints", "test", *args], catch_exceptions=False)
        return result.exit_code, result.output

    # The CLI stamps its test delivery with the system clock, so the worker reads it too.
    async with worker_running(async_engine, box, SystemClock()):
        code, out = await asyncio.to_thread(run, target.endpoint.uid)
        assert code == 0, out
        assert f"webhook.test to {target.endpoint.uid} succeeded (HTTP 200" in out
        code, out = await asyncio.to_thread(
            run, target.endpoint.uid, "--event-type", "order.created", "--json"
        )
        assert code == 0, out
        answer = json.loads(out)
        assert answer["outcome"]["state"] == "succeeded"
        code, out = await asyncio.to_thread(run, broken.endpoint.uid)
        assert code == 1 and "failed (HTTP 500" in out

    ping, example = receiver.received("/target")
    assert verify(target.secret, ping.headers, ping.body)["type"] == "webhook.test"
    assert json.loads(example.body)["data"] == {"id": "ord_example"}
    assert example.headers["webhook-id"] == answer["message_id"]
    assert receiver.received("/sibling") == []  # nobody else gets a test event
    # One attempt only, whatever the answer: a test is not retried.
    assert scalar(
        engine,
        "SELECT count(*) FROM deliveries d JOIN endpoints e ON e.id = d.endpoint_id"
        " WHERE e.uid = :uid AND d.state = 'dead'",
        uid=broken.endpoint.uid,
    ) == 1  # fmt: skip

    no_example = cli.invoke(
        main, ["endpoints", "test", target.endpoint.uid, "--event-type", "order.paid"]
    )
    assert no_example.exit_code == 1 and "has no example" in no_example.output
    queued = cli.invoke(main, ["endpoints", "test", target.endpoint.uid, "--wait", "0"])
    assert "no worker sent it within 0s" in queued.output


async def test_api_test_route(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    target = add_endpoint(engine, box, receiver.route("/api-target"), "*")
    with engine.begin() as conn:
        _, secret = create_token(conn, name="op", role="operator", actor="test")
    app = create_app(async_engine, box, clock=clock)
    transport = httpx.ASGITransport(app=app)
    async with (
        httpx.AsyncClient(transport=transport, base_url="http://admin") as api,
        worker_running(async_engine, box, clock),
    ):
        answer = await api.post(
            f"/v1/endpoints/{target.endpoint.uid}/test",
            json={"wait_seconds": 20},
            headers={"authorization": f"Bearer {secret}"},
        )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["finished"] is True and body["outcome"]["status_code"] == 200
    assert len(receiver.received("/api-target")) == 1
    assert scalar(engine, "SELECT count(*) FROM audit_log WHERE action = 'endpoint.test'") == 1
