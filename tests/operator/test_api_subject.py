"""The admin API: the subject filter on GET /v1/deliveries (scoped to a token's tenant,
hostile values refused), and replay's refusal of a superseded delivery unless `force`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.operator.api import create_app
from delivery.receiver import Receiver
from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.tenants import create_tenant
from outbox.tokens import create_token
from tests.helpers import add_endpoint, scalar
from tests.operator_helpers import deliver

A, B = "seller-a", "seller-b"


def _token(engine: Engine, name: str, tenant: str | None) -> dict[str, str]:
    with engine.begin() as conn:
        _, secret = create_token(conn, name=name, role="operator", actor="test", tenant=tenant)
    return {"authorization": f"Bearer {secret}"}


@pytest.fixture
async def api(
    engine: Engine, async_engine: AsyncEngine, box: SecretBox, clock: ManualClock
) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(async_engine, box, clock=clock)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://admin"
    ) as http:
        yield http


async def test_the_subject_filter_keeps_to_the_tokens_tenant(
    engine: Engine,
    async_engine: AsyncEngine,
    box: SecretBox,
    clock: ManualClock,
    receiver: Receiver,
    api: httpx.AsyncClient,
) -> None:
    with engine.begin() as conn:
        create_tenant(conn, A)
        create_tenant(conn, B)
    for tenant in (A, B):
        add_endpoint(engine, box, receiver.route(f"/{tenant}"), "order.*", tenant=tenant)
    with engine.begin() as conn:
        for tenant in (A, B):
            publish(conn, "order.created", {"n": 1}, tenant=tenant, subject="order/1")
            publish(conn, "order.created", {"n": 2}, tenant=tenant, subject="order/2")
    await deliver(async_engine, box, clock)
    scoped = _token(engine, "a-ops", A)
    found = (await api.get("/v1/deliveries", params={"subject": "order/1"}, headers=scoped)).json()
    assert [(d["tenant"], d["subject"]) for d in found["items"]] == [(A, "order/1")]
    every = _token(engine, "root", None)
    found = (await api.get("/v1/deliveries", params={"subject": "order/1"}, headers=every)).json()
    assert sorted(d["tenant"] for d in found["items"]) == [A, B]
    b_delivery = scalar(
        engine,
        "SELECT d.id FROM deliveries d JOIN tenants t ON t.id = d.tenant_id WHERE t.uid = :b",
        b=B,
    )
    answer = await api.get(f"/v1/deliveries/{b_delivery}", headers=scoped)
    assert answer.status_code == 404
    for hostile in ("x" * 256, "a\x00b", "a\nb"):
        refused = await api.get("/v1/deliveries", params={"subject": hostile}, headers=scoped)
        assert refused.status_code == 400, refused.text
        assert "subject" in refused.json()["error"]


async def test_replay_refuses_a_superseded_delivery_unless_forced(
    engine: Engine,
    async_engine: AsyncEngine,
    box: SecretBox,
    clock: ManualClock,
    receiver: Receiver,
    api: httpx.AsyncClient,
) -> None:
    add_endpoint(engine, box, receiver.route("/hook", status=400), "order.*")
    with engine.begin() as conn:
        publish(conn, "order.updated", {"v": 1}, subject="order/1")
    await deliver(async_engine, box, clock)
    receiver.route("/hook", status=204)
    with engine.begin() as conn:
        newer = publish(conn, "order.updated", {"v": 2}, subject="order/1")
    await deliver(async_engine, box, clock)
    dead = scalar(engine, "SELECT id FROM deliveries WHERE state = 'dead'")
    headers = _token(engine, "ops", None)

    async def post(url: str, body: dict[str, Any]) -> httpx.Response:
        return await api.post(url, json=body, headers=headers)

    refused = await post(f"/v1/deliveries/{dead}/replay", {"reason": "x"})
    assert refused.status_code == 400
    assert f"superseded: {dead} by {newer}" in refused.json()["error"]
    dry = (await post("/v1/replays", {"reason": "x", "dry_run": True, "filter": {}})).json()
    assert (dry["matched"], dry["superseded"]) == (1, 1)
    assert dry["superseded_sample"] == [{"delivery": dead, "newer_message_id": newer}]
    bulk = (await post("/v1/replays", {"reason": "x", "filter": {"subject": "order/1"}})).json()
    assert (bulk["replayed"], bulk["superseded"]) == ([], 1)
    assert scalar(engine, "SELECT count(*) FROM deliveries WHERE replay_of IS NOT NULL") == 0
    forced = await post(f"/v1/deliveries/{dead}/replay", {"reason": "x", "force": True})
    assert forced.status_code == 200, forced.text
    with engine.connect() as conn:
        replayed = conn.execute(
            text("SELECT count(*) FROM deliveries WHERE replay_of = :id"), {"id": dead}
        ).scalar()
    assert replayed == 1
