"""The admin API's concurrency route: an endpoint's fixed or adaptive in-flight limit,
read and changed through PATCH, audited, refusing hostile values with a clear 400."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.health import EndpointLimits, set_endpoint_limits
from delivery.operator.api import create_app
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from tests.helpers import add_endpoint, rows
from tests.operator_helpers import token


@pytest.fixture
async def http(
    engine: Engine, async_engine: AsyncEngine, box: SecretBox, clock: ManualClock
) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(async_engine, box, clock=clock)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://admin",
        headers=token(engine, "operator"),
    ) as client:
        yield client


async def test_switch_to_adaptive_read_the_limit_and_back(
    http: httpx.AsyncClient, engine: Engine, box: SecretBox
) -> None:
    uid = add_endpoint(engine, box, "http://127.0.0.1:9/hook").endpoint.uid
    with engine.begin() as conn:
        set_endpoint_limits(conn, uid, EndpointLimits(max_per_second=5.0), actor="test")
    url = f"/v1/endpoints/{uid}/concurrency"
    shown = await http.get(url)
    assert shown.json() == {
        "endpoint": uid,
        "mode": "fixed",
        "max_in_flight": None,
        "limit": None,
        "in_flight": 0,
        "latency_baseline_ms": None,
    }
    changed = await http.patch(
        url,
        json={"mode": "adaptive", "max_in_flight": 16, "reason": "partner slows under load"},
        headers={"x-request-id": "req-7"},
    )
    assert changed.status_code == 200, changed.text
    assert changed.json()["mode"] == "adaptive"
    assert (changed.json()["max_in_flight"], changed.json()["limit"]) == (16, 4)  # starts low
    with engine.begin() as conn:  # the workers moved the limiter
        moved = "UPDATE endpoint_health SET adaptive_limit = 11, latency_baseline_ms = 80"
        conn.execute(text(moved))
    now = (await http.get(url)).json()
    assert (now["limit"], now["latency_baseline_ms"]) == (11, 80.0)
    # the ceiling alone: still adaptive, the limiter starts afresh; the rate limit stays
    raised = (await http.patch(url, json={"max_in_flight": 32})).json()
    assert (raised["mode"], raised["max_in_flight"], raised["limit"]) == ("adaptive", 32, 4)
    fixed = (await http.patch(url, json={"mode": "fixed"})).json()
    assert (fixed["mode"], fixed["max_in_flight"], fixed["limit"]) == ("fixed", 32, 32)
    cleared = (await http.patch(url, json={"max_in_flight": None})).json()
    assert (cleared["max_in_flight"], cleared["limit"]) == (None, None)
    assert rows(engine, "SELECT max_per_second FROM endpoint_health") == [{"max_per_second": 5.0}]
    audit = rows(
        engine,
        "SELECT actor, reason, request_id, details FROM audit_log "
        "WHERE action = 'endpoint.limits' AND actor <> 'test' ORDER BY id",
    )
    assert len(audit) == 4
    assert audit[0]["reason"] == "partner slows under load"
    assert audit[0]["request_id"] == "req-7"
    assert audit[0]["details"]["adaptive"] is True and audit[0]["details"]["max_in_flight"] == 16
    assert audit[0]["details"]["max_per_second"] == 5.0


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"mode": "adaptive", "max_in_flight": 0}, "max_in_flight"),
        ({"max_in_flight": 0}, "max_in_flight"),
        ({"max_in_flight": -3}, "max_in_flight"),
        ({"max_in_flight": 10**12}, "max_in_flight"),
        ({"max_in_flight": 2**63}, "max_in_flight"),
        ({"max_in_flight": 1.5}, "whole number"),
        ({"max_in_flight": "1e3"}, "whole number"),
        ({"max_in_flight": True}, "true/false"),
        ({"mode": "ADAPTIVE"}, "mode"),
        ({"mode": None, "max_in_flight": 4, "adaptiv": True}, "adaptiv"),
        ({"reason": "x" * 100_000}, "reason"),
    ],
)
async def test_hostile_values_are_refused_and_change_nothing(
    http: httpx.AsyncClient, engine: Engine, box: SecretBox, body: dict[str, object], says: str
) -> None:
    uid = add_endpoint(engine, box, "http://127.0.0.1:9/hook").endpoint.uid
    answer = await http.patch(f"/v1/endpoints/{uid}/concurrency", json=body)
    assert answer.status_code == 400, answer.text
    assert says in answer.json()["error"]
    assert rows(engine, "SELECT * FROM endpoint_health") == []
    assert rows(engine, "SELECT * FROM audit_log WHERE action = 'endpoint.limits'") == []


async def test_unknown_endpoints_and_viewers(
    http: httpx.AsyncClient, engine: Engine, box: SecretBox
) -> None:
    for uid in ("ep_missing", "ep_" + "x" * 5000, "../tenants"):
        assert (await http.get(f"/v1/endpoints/{uid}/concurrency")).status_code in (400, 404)
    uid = add_endpoint(engine, box, "http://127.0.0.1:9/hook").endpoint.uid
    viewer = token(engine, "viewer", name="viewer-2")
    url = f"/v1/endpoints/{uid}/concurrency"
    assert (await http.get(url, headers=viewer)).status_code == 200
    refused = await http.patch(url, json={"max_in_flight": 4}, headers=viewer)
    assert refused.status_code == 403
    assert rows(engine, "SELECT * FROM endpoint_health") == []
