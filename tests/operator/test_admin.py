"""The admin HTTP API over httpx's ASGI transport, against the real database."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.operator.api import create_app, openapi_document, serve
from delivery.receiver import Receiver
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from tests.helpers import add_endpoint, rows, scalar
from tests.operator_helpers import deliver, publish_many, snapshot, token


@pytest.fixture
async def client(
    async_engine: AsyncEngine, box: SecretBox, clock: ManualClock
) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(async_engine, box, clock=clock)
    transport = httpx.ASGITransport(app=app, client=("10.1.2.3", 4567))
    async with httpx.AsyncClient(transport=transport, base_url="http://admin") as http:
        yield http


def refusals(engine: Engine) -> list[tuple[str, str, int, str | None]]:
    return [
        (r["actor"], r["target_id"], r["details"]["status"], r["request_id"])
        for r in rows(engine, "SELECT * FROM audit_log WHERE action = 'api.refused' ORDER BY id")
    ]


async def test_no_token_is_401_and_a_viewer_cannot_replay_403_both_audited(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    client: httpx.AsyncClient,
) -> None:
    add_endpoint(engine, box, receiver.route("/x", status=404), "*")
    publish_many(engine, "order.created")
    await deliver(async_engine, box, clock)
    dead = scalar(engine, "SELECT id FROM deliveries")
    before = snapshot(engine, dead)
    viewer = token(engine, "viewer", "grafana")
    bad = {"authorization": "Bearer obx_0123456789abcdef_" + "A" * 43}

    assert (await client.get("/v1/deliveries")).status_code == 401
    answer = await client.get("/v1/deliveries", headers={**bad, "x-request-id": "req-1"})
    assert answer.status_code == 401 and answer.headers["x-request-id"] == "req-1"
    assert "outbox tokens create" in answer.json()["error"]
    refused = await client.post(
        f"/v1/deliveries/{dead}/replay", json={"reason": "try"}, headers=viewer
    )
    assert refused.status_code == 403
    assert "operator" in refused.json()["error"]
    listed = await client.get("/v1/deliveries", headers=viewer)
    assert listed.status_code == 200 and [d["id"] for d in listed.json()["items"]] == [dead]

    assert snapshot(engine, dead) == before
    assert scalar(engine, "SELECT count(*) FROM deliveries") == 1
    found = refusals(engine)
    assert [(a, t, s) for a, t, s, _ in found] == [
        ("anonymous", "GET /v1/deliveries", 401),
        ("anonymous", "GET /v1/deliveries", 401),
        ("token:grafana", f"POST /v1/deliveries/{dead}/replay", 403),
    ]
    assert found[1][3] == "req-1" and found[0][3] and found[2][3]
    assert (
        rows(engine, "SELECT details FROM audit_log WHERE action = 'api.refused'")[0]["details"][
            "client"
        ]
        == "10.1.2.3"
    )
    # A revoked token stops working at once.
    with engine.begin() as conn:
        from outbox.tokens import revoke_token

        revoke_token(conn, "grafana", actor="test", now=clock.now())
    assert (await client.get("/v1/deliveries", headers=viewer)).status_code == 401


async def test_operator_searches_replays_and_discards_over_http(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    client: httpx.AsyncClient,
) -> None:
    # 404, not 410: a 410 would also disable the endpoint, which is not this test's subject.
    add_endpoint(engine, box, receiver.route("/p", status=404), "*")
    [message_id, _, _] = publish_many(engine, "order.created", 3)
    await deliver(async_engine, box, clock)
    operator = token(engine, "operator", "oncall")
    found = (await client.get("/v1/deliveries?error=not+found&state=dead", headers=operator)).json()
    ids = sorted(item["id"] for item in found["items"])
    assert len(ids) == 3
    first = ids[0]
    before = snapshot(engine, first)

    shown = (await client.get(f"/v1/deliveries/{first}", headers=operator)).json()
    assert shown["event"]["message_id"] == message_id
    assert shown["attempt_history"][0]["status_code"] == 404
    assert (await client.get("/v1/deliveries/999999", headers=operator)).status_code == 404

    receiver.route("/p", status=204)
    no_reason = await client.post(f"/v1/deliveries/{first}/replay", json={}, headers=operator)
    assert no_reason.status_code == 400 and "reason" in no_reason.json()["error"]
    replayed = await client.post(
        f"/v1/deliveries/{first}/replay",
        json={"reason": "partner back"},
        headers={**operator, "x-request-id": "incident-7"},
    )
    assert replayed.status_code == 200
    new_id = replayed.json()["replayed"][0]["replay"]
    dry = await client.post(
        "/v1/replays",
        json={"reason": "bulk", "dry_run": True, "filter": {"error": "not found"}},
        headers=operator,
    )
    assert dry.json()["matched"] == 2 and dry.json()["replayed"] == []
    assert scalar(engine, "SELECT count(*) FROM deliveries") == 4
    discarded = await client.post(
        "/v1/discards", json={"ids": ids[1:], "reason": "obsolete"}, headers=operator
    )
    assert discarded.json() == {"discarded": ids[1:]}
    await deliver(async_engine, box, clock)

    assert snapshot(engine, first) == before
    assert scalar(engine, "SELECT state FROM deliveries WHERE id = :id", id=new_id) == "succeeded"
    assert receiver.requests[-1].headers["webhook-id"] == message_id
    audit = rows(engine, "SELECT actor, action, target_id, request_id FROM audit_log ORDER BY id")
    mutations = [(a["actor"], a["action"], a["target_id"]) for a in audit]
    assert mutations == [
        ("test", "token.create", mutations[0][2]),
        ("token:oncall", "delivery.replay", str(first)),
        ("token:oncall", "delivery.discard", str(ids[1])),
        ("token:oncall", "delivery.discard", str(ids[2])),
    ]
    assert audit[1]["request_id"] == "incident-7"
    listed = (await client.get("/v1/audit?action=delivery", headers=operator)).json()["items"]
    assert [e["action"] for e in listed] == ["delivery.discard"] * 2 + ["delivery.replay"]


async def test_endpoint_changes_over_http_each_leave_an_audit_row(
    engine: Engine,
    clock: ManualClock,
    receiver: Receiver,
    client: httpx.AsyncClient,
) -> None:
    operator = token(engine, "operator")
    made = await client.post(
        "/v1/endpoints",
        json={"url": receiver.route("/e"), "event_types": ["order.*"]},
        headers=operator,
    )
    assert made.status_code == 200 and made.json()["secret"].startswith("whsec_")
    uid = made.json()["id"]
    calls = [
        client.patch(f"/v1/endpoints/{uid}", json={"description": "shop"}, headers=operator),
        client.post(f"/v1/endpoints/{uid}/disable", json={"reason": "maint"}, headers=operator),
        client.post(f"/v1/endpoints/{uid}/enable", headers=operator),
        client.post(f"/v1/endpoints/{uid}/rotate-secret", json={"grace_seconds": 60},
                    headers=operator),
        client.delete(f"/v1/endpoints/{uid}?reason=gone", headers=operator),
    ]  # fmt: skip
    for pending in calls:
        answer = await pending
        assert answer.status_code == 200, answer.text
    actions = [r["action"] for r in rows(engine, "SELECT action FROM audit_log ORDER BY id")]
    assert actions == [
        "token.create",
        "endpoint.create",
        "endpoint.update",
        "endpoint.disable",
        "endpoint.enable",
        "endpoint.rotate_secret",
        "endpoint.delete",
    ]
    assert scalar(engine, "SELECT count(*) FROM endpoints") == 0
    # Every change made over HTTP carries the request id of the call that made it.
    assert (
        scalar(
            engine,
            "SELECT count(*) FROM audit_log WHERE action LIKE 'endpoint.%' AND request_id IS NULL",
        )
        == 0
    )
    broken = await client.post(
        "/v1/discards", content=b"{not json", headers={**operator, "content-type": "x"}
    )
    assert broken.status_code == 400 and "not valid JSON" in broken.json()["error"]
    wrong_type = await client.post("/v1/discards", json={"ids": 5, "reason": "r"}, headers=operator)
    assert wrong_type.status_code == 400


async def test_metrics_parse_and_match_the_database(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    client: httpx.AsyncClient,
) -> None:
    add_endpoint(engine, box, receiver.route("/ok"), "*")
    add_endpoint(engine, box, receiver.route("/fail", status=503), "order.*")
    publish_many(engine, "order.created", 3)
    publish_many(engine, "invoice.paid", 2)
    await deliver(async_engine, box, clock)
    publish_many(engine, "order.created", 2)  # published, not relayed yet
    clock.advance(1)
    # Ages under the manual clock: 42 s and 7 s; the lag is the oldest one's age.
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE outbox_events SET created_at = :now - make_interval(secs => CASE"
                " WHEN id = (SELECT min(id) FROM outbox_events WHERE relayed_at IS NULL)"
                " THEN 42 ELSE 7 END) WHERE relayed_at IS NULL"
            ),
            {"now": clock.now()},
        )
    viewer = token(engine, "viewer")
    assert (await client.get("/metrics")).status_code == 401
    answer = await client.get("/metrics", headers=viewer)
    assert answer.status_code == 200

    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(answer.text)
        for s in family.samples
    }

    def sample(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert (
        sample("outbox_events_published_total")
        == scalar(engine, "SELECT count(*) FROM outbox_events")
        == 7
    )
    assert sample("outbox_events_relayed_total") == 5
    for outcome, count in {"succeeded": 5, "retryable": 3, "permanent": 0}.items():
        assert sample("outbox_delivery_attempts_total", outcome=outcome) == count
        assert count == scalar(
            engine, "SELECT count(*) FROM delivery_attempts WHERE outcome = :o", o=outcome
        )
    for state, count in {"succeeded": 5, "scheduled": 3, "dead": 0}.items():
        assert sample("outbox_deliveries", state=state) == count
    assert sample("outbox_delivery_attempt_duration_seconds_count") == 8
    total_ms = scalar(engine, "SELECT sum(duration_ms) FROM delivery_attempts")
    assert sample("outbox_delivery_attempt_duration_seconds_sum") == pytest.approx(total_ms / 1000)
    under_quarter = scalar(
        engine, "SELECT count(*) FROM delivery_attempts WHERE duration_ms <= 250"
    )
    assert sample("outbox_delivery_attempt_duration_seconds_bucket", le="0.25") == under_quarter
    assert sample("outbox_delivery_attempt_duration_seconds_bucket", le="+Inf") == 8
    assert sample("outbox_unrelayed_events") == 2
    assert sample("outbox_relay_lag_seconds") == 42.0
    assert sample("outbox_alert_firing", alert="relay_lag") == 0


async def test_health_readiness_and_openapi_need_no_token(client: httpx.AsyncClient) -> None:
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    ready = await client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    document = (await client.get("/openapi.json")).json()
    assert document == openapi_document()
    replay = document["paths"]["/v1/deliveries/{id}/replay"]["post"]
    assert replay["x-required-role"] == "operator" and "403" in replay["responses"]
    assert "security" not in document["paths"]["/healthz"]["get"]


async def test_served_by_uvicorn_on_loopback(
    async_engine: AsyncEngine, box: SecretBox, clock: ManualClock
) -> None:
    stop, started = asyncio.Event(), asyncio.Event()
    port: list[int] = []

    def on_started(bound: int) -> None:
        port.append(bound)
        started.set()

    task = asyncio.create_task(
        serve(
            create_app(async_engine, box, clock=clock),
            host="127.0.0.1",
            port=0,
            stop=stop,
            on_started=on_started,
        )
    )
    try:
        await asyncio.wait_for(started.wait(), timeout=10)
        async with httpx.AsyncClient(trust_env=False) as http:
            answer = await http.get(f"http://127.0.0.1:{port[0]}/healthz")
        assert answer.json() == {"status": "ok"}
    finally:
        stop.set()
        await task
