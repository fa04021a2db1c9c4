"""Tenant-scoped tokens on the admin API: every route, checked against another tenant's rows.

A token scoped to seller-a must never see, count or change seller-b's objects: a lookup
answers 404 exactly as for an id that does not exist, a list leaves them out, numbers are
seller-a's alone. `CASES` holds one check per route; a route added to the API without a
case fails `test_every_route_has_a_scoping_case`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.operator.api import all_routes, create_app
from delivery.receiver import Receiver
from outbox import publish
from outbox.catalogue import add_event_type
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.endpoints import update_endpoint
from outbox.tenants import create_tenant
from outbox.tokens import create_token
from tests.helpers import add_endpoint, rows, scalar
from tests.operator_helpers import deliver

A, B = "seller-a", "seller-b"


@dataclass
class World:
    http: httpx.AsyncClient
    engine: Engine
    a_endpoint: str
    b_endpoint: str
    warehouse: str
    a_dead: list[int]
    b_dead: list[int]
    a_token: dict[str, str]  # operator, scoped to seller-a
    root: dict[str, str]  # operator, unscoped
    clock: ManualClock

    async def get(self, url: str, **kw: Any) -> httpx.Response:
        return await self.http.get(url, headers=self.a_token, **kw)

    async def post(self, url: str, body: Any = None) -> httpx.Response:
        return await self.http.post(url, json=body or {}, headers=self.a_token)

    async def patch(self, url: str, body: Any) -> httpx.Response:
        return await self.http.patch(url, json=body, headers=self.a_token)

    async def delete(self, url: str) -> httpx.Response:
        return await self.http.delete(url, headers=self.a_token)


def _token(engine: Engine, name: str, role: str, tenant: str | None) -> dict[str, str]:
    with engine.begin() as conn:
        _, secret = create_token(conn, name=name, role=role, actor="test", tenant=tenant)
    return {"authorization": f"Bearer {secret}"}


@pytest.fixture
async def world(
    engine: Engine,
    async_engine: AsyncEngine,
    box: SecretBox,
    clock: ManualClock,
    receiver: Receiver,
) -> AsyncIterator[World]:
    with engine.begin() as conn:
        create_tenant(conn, A)
        create_tenant(conn, B)
    gone = receiver.route("/gone", status=404)
    a = add_endpoint(engine, box, gone, "order.*", tenant=A).endpoint.uid
    b = add_endpoint(engine, box, gone, "order.*", tenant=B).endpoint.uid
    warehouse = add_endpoint(engine, box, receiver.route("/wh"), "*", all_tenants=True)
    with engine.begin() as conn:
        for tenant in (A, B, B):
            publish(conn, "order.created", {"for": tenant}, tenant=tenant)
        # Audit rows about each tenant's endpoint, written by an unscoped operator.
        for uid in (a, b):
            update_endpoint(conn, uid, actor="cli:root", description="touched")
    await deliver(async_engine, box, clock)

    def dead(uid: str) -> list[int]:
        return [
            r["id"]
            for r in rows(
                engine,
                "SELECT d.id FROM deliveries d JOIN endpoints e ON e.id = d.endpoint_id "
                "WHERE e.uid = :uid AND d.state = 'dead' ORDER BY d.id",
                uid=uid,
            )
        ]

    _token(engine, "b-bot", "viewer", B)  # seller-b's own token
    app = create_app(async_engine, box, clock=clock)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://admin") as http:
        yield World(
            http=http,
            engine=engine,
            a_endpoint=a,
            b_endpoint=b,
            warehouse=warehouse.endpoint.uid,
            a_dead=dead(a),
            b_dead=dead(b),
            a_token=_token(engine, "a-ops", "operator", A),
            root=_token(engine, "root", "operator", None),
            clock=clock,
        )


def seller_b_state(engine: Engine) -> dict[str, Any]:
    """Everything of seller-b (and the all-tenants endpoint) a leak could change."""

    def query(sql: str) -> list[Any]:
        return [dict(r) for r in rows(engine, sql, b=B)]

    b_id = "(SELECT id FROM tenants WHERE uid = :b)"
    return {
        "tenant": query("SELECT * FROM tenants WHERE uid = :b"),
        "endpoints": query(f"SELECT * FROM endpoints WHERE tenant_id = {b_id} OR all_tenants"),
        "deliveries": query(
            f"SELECT * FROM deliveries WHERE tenant_id <> (SELECT id FROM tenants WHERE uid = "
            f"'{A}') ORDER BY id"
        ),
        "tokens": query("SELECT * FROM admin_tokens WHERE tenant_uid IS DISTINCT FROM 'seller-a'"),
        "health": query("SELECT * FROM endpoint_health ORDER BY endpoint_id"),
    }


def not_found(answer: httpx.Response) -> None:
    assert answer.status_code == 404, answer.text
    assert "\n" not in answer.json()["error"]


def only_a(items: list[dict[str, Any]], key: str = "tenant") -> None:
    assert items, "the scoped list should hold seller-a's rows"
    assert {item[key] for item in items} == {A}


# -- one case per route ------------------------------------------------------------------

Case = Callable[[World], Awaitable[None]]


async def _metrics(w: World) -> None:
    answer = await w.get("/metrics")
    assert answer.status_code == 200
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(answer.text)
        for s in family.samples
    }
    # seller-a published 1, and the service reported its dead delivery (delivery.dead) to
    # it; seller-b published 2.
    assert samples[("outbox_events_published_total", ())] == 2
    assert samples[("outbox_deliveries", (("state", "dead"),))] == len(w.a_dead) == 1
    assert samples[("outbox_deliveries", (("state", "succeeded"),))] == 0  # warehouse's
    endpoints = {dict(labels).get("endpoint") for (_, labels) in samples} - {None}
    assert endpoints == {w.a_endpoint}
    assert not any(name == "outbox_tenants" for name, _ in samples)
    not_found(await w.get("/metrics", params={"tenant": B}))


async def _list_deliveries(w: World) -> None:
    answer = (await w.get("/v1/deliveries")).json()
    only_a(answer["items"])
    assert [d["id"] for d in answer["items"]] == w.a_dead
    assert (await w.get("/v1/deliveries", params={"endpoint": w.b_endpoint})).json()["items"] == []
    not_found(await w.get("/v1/deliveries", params={"tenant": B}))


async def _show_delivery(w: World) -> None:
    not_found(await w.get(f"/v1/deliveries/{w.b_dead[0]}"))
    assert (await w.get(f"/v1/deliveries/{w.a_dead[0]}")).json()["tenant"] == A


async def _replay_one(w: World) -> None:
    not_found(await w.post(f"/v1/deliveries/{w.b_dead[0]}/replay", {"reason": "x"}))


async def _replay_many(w: World) -> None:
    not_found(await w.post("/v1/replays", {"reason": "x", "ids": w.b_dead}))
    not_found(await w.post("/v1/replays", {"reason": "x", "ids": [w.a_dead[0], w.b_dead[0]]}))
    assert scalar(w.engine, "SELECT count(*) FROM deliveries WHERE replay_of IS NOT NULL") == 0
    not_found(await w.post("/v1/replays", {"reason": "x", "filter": {"tenant": B}}))
    by_b = await w.post("/v1/replays", {"reason": "x", "filter": {"endpoint": w.b_endpoint}})
    assert by_b.json()["matched"] == 0
    # An unfiltered bulk replay by a scoped token replays its own tenant's dead ones only.
    done = (await w.post("/v1/replays", {"reason": "x", "filter": {}})).json()
    assert [r["delivery"] for r in done["replayed"]] == w.a_dead


async def _discard_one(w: World) -> None:
    not_found(await w.post(f"/v1/deliveries/{w.b_dead[0]}/discard", {"reason": "x"}))


async def _discard_many(w: World) -> None:
    not_found(await w.post("/v1/discards", {"reason": "x", "ids": w.b_dead}))
    not_found(await w.post("/v1/discards", {"reason": "x", "ids": [w.a_dead[0], w.b_dead[0]]}))
    assert scalar(w.engine, "SELECT count(*) FROM deliveries WHERE state = 'discarded'") == 0


def _hold_one_each(w: World) -> tuple[int, int]:
    """Make one dead delivery of each seller held (as the worker does on a held outcome)."""
    _set_state(w, [w.a_dead[0], w.b_dead[0]], "held")
    return w.a_dead[0], w.b_dead[0]


def _set_state(w: World, ids: list[int], state: str) -> None:
    with w.engine.begin() as conn:
        conn.execute(
            text("UPDATE deliveries SET state = :s WHERE id = ANY(:ids)"), {"ids": ids, "s": state}
        )


def _unhold_b(w: World, theirs: int) -> None:
    """seller-b's row is back as it was: the check after each case compares all of it."""
    assert scalar(w.engine, "SELECT state FROM deliveries WHERE id = :i", i=theirs) == "held"
    _set_state(w, [theirs], "dead")


async def _confirm_held(w: World) -> None:
    mine, theirs = _hold_one_each(w)
    not_found(await w.post(f"/v1/deliveries/{theirs}/confirm", {"reason": "x"}))
    _unhold_b(w, theirs)
    done = await w.post(f"/v1/deliveries/{mine}/confirm", {"reason": "partner saw it"})
    assert done.json() == {"confirmed": [mine]}


async def _retry_held(w: World) -> None:
    mine, theirs = _hold_one_each(w)
    not_found(await w.post(f"/v1/deliveries/{theirs}/retry", {"reason": "x"}))
    _unhold_b(w, theirs)
    done = await w.post(f"/v1/deliveries/{mine}/retry", {"reason": "safe to repeat"})
    assert done.json() == {"retried": [mine]}


async def _set_failure_policy(w: World) -> None:
    for theirs in (w.b_endpoint, w.warehouse):
        not_found(await w.patch(f"/v1/endpoints/{theirs}/failure-policy", {"owner": "ops"}))
    mine = await w.patch(
        f"/v1/endpoints/{w.a_endpoint}/failure-policy", {"owner": "ops", "on_ambiguous": "hold"}
    )
    assert (mine.json()["owner"], mine.json()["on_ambiguous"]) == ("ops", "hold")
    bad = await w.patch(f"/v1/endpoints/{w.a_endpoint}/failure-policy", {"owner": "<b>"})
    assert bad.status_code == 400 and "team name" in bad.text


async def _show_concurrency(w: World) -> None:
    for theirs in (w.b_endpoint, w.warehouse):
        not_found(await w.get(f"/v1/endpoints/{theirs}/concurrency"))
    mine = (await w.get(f"/v1/endpoints/{w.a_endpoint}/concurrency")).json()
    assert (mine["endpoint"], mine["mode"]) == (w.a_endpoint, "fixed")


async def _set_concurrency(w: World) -> None:
    body = {"mode": "adaptive", "max_in_flight": 8}
    for theirs in (w.b_endpoint, w.warehouse):
        not_found(await w.patch(f"/v1/endpoints/{theirs}/concurrency", body))
    # Its own endpoint is reached (the change itself: tests/operator/test_concurrency_api.py);
    # refused here because a ceiling of 0 is no ceiling, so the health rows stay as they
    # were (adaptive without a ceiling is allowed since new endpoints are adaptive).
    mine = await w.patch(
        f"/v1/endpoints/{w.a_endpoint}/concurrency", {"mode": "adaptive", "max_in_flight": 0}
    )
    assert mine.status_code == 400 and "max_in_flight" in mine.text


async def _set_workflow(w: World) -> None:
    await _with_type(w)
    refused = await w.patch("/v1/event-types/order.created/workflow", {"owner": "ops"})
    assert refused.status_code == 403
    assert scalar(w.engine, "SELECT owner FROM event_types") is None


async def _list_endpoints(w: World) -> None:
    answer = (await w.get("/v1/endpoints")).json()
    assert [e["id"] for e in answer["items"]] == [w.a_endpoint]
    assert answer["all_tenants"] == []  # the warehouse is the default tenant's
    not_found(await w.get("/v1/endpoints", params={"tenant": B}))


async def _create_endpoint(w: World) -> None:
    url = "http://127.0.0.1:1/new"
    not_found(await w.post("/v1/endpoints", {"url": url, "event_types": ["*"], "tenant": B}))
    everyone = await w.post(
        "/v1/endpoints", {"url": url, "event_types": ["*"], "all_tenants": True}
    )
    assert everyone.status_code == 403
    # fixed: an adaptive one would get a health row, and this test wants every health
    # row unchanged (tests/operator/test_adaptive_default.py covers the default)
    made = await w.post("/v1/endpoints", {"url": url, "event_types": ["*"], "concurrency": "fixed"})
    assert made.status_code == 200 and made.json()["tenant"] == A
    assert not made.json()["all_tenants"]


async def _update_endpoint(w: World) -> None:
    not_found(await w.patch(f"/v1/endpoints/{w.b_endpoint}", {"description": "mine"}))
    not_found(await w.patch(f"/v1/endpoints/{w.warehouse}", {"description": "mine"}))
    # The feed and filter fields alone go through their own functions: scoped the same.
    for change in ({"delivery_mode": "pull"}, {"payload_filter": "$.a == 1"}):
        not_found(await w.patch(f"/v1/endpoints/{w.b_endpoint}", change))


async def _rotate_feed_token(w: World) -> None:
    not_found(await w.post(f"/v1/endpoints/{w.b_endpoint}/feed-token", {}))


async def _read_feed(w: World) -> None:
    """seller-a's own feed token on seller-b's endpoint: not found, like an unknown id."""
    created = await w.post(
        "/v1/endpoints",
        {
            "url": "https://a.example/hook",
            "event_types": "*",
            "delivery_mode": "pull",
            "concurrency": "fixed",  # no health row: this test wants every one unchanged
        },
    )
    token = {"authorization": f"Bearer {created.json()['feed_token']}"}
    own = await w.http.get(f"/feed/v1/{created.json()['id']}", headers=token)
    assert own.status_code == 200, own.text
    not_found(await w.http.get(f"/feed/v1/{w.b_endpoint}", headers=token))
    not_found(await w.http.get(f"/feed/v1/{w.warehouse}", headers=token))


async def _set_endpoint_auth(w: World) -> None:
    oauth = {
        "oauth": {
            "token_url": "https://auth.example/token",
            "client_id": "mine",
            "client_secret": "s3cret",
        }
    }
    for uid in (w.b_endpoint, w.warehouse):
        not_found(await w.patch(f"/v1/endpoints/{uid}/auth", oauth))
        not_found(await w.patch(f"/v1/endpoints/{uid}/auth", {}))
    shown = await w.patch(f"/v1/endpoints/{w.a_endpoint}/auth", {})
    assert shown.status_code == 200 and shown.json()["oauth"] is None


async def _delete_endpoint(w: World) -> None:
    not_found(await w.delete(f"/v1/endpoints/{w.b_endpoint}?reason=x&force=true"))


async def _enable_endpoint(w: World) -> None:
    not_found(await w.post(f"/v1/endpoints/{w.b_endpoint}/enable"))


async def _disable_endpoint(w: World) -> None:
    not_found(await w.post(f"/v1/endpoints/{w.b_endpoint}/disable", {"reason": "x"}))


async def _rotate_secret(w: World) -> None:
    not_found(await w.post(f"/v1/endpoints/{w.b_endpoint}/rotate-secret", {}))


async def _stats(w: World) -> None:
    # Published events are stamped by the database's clock, a moment after ours (seconds,
    # on a loaded machine); the service's own report carries the injected clock.
    w.clock.advance(60)
    stats = (await w.get("/v1/stats")).json()
    assert stats["tenant"] == A
    assert stats["counts_by_state"]["dead"] == 1 and stats["counts_by_state"]["succeeded"] == 0
    # Published: seller-a's event and the service's delivery.dead report of its death.
    assert stats["window"]["published"] == 2 and stats["window"]["attempts"] == 1
    assert [e["uid"] for e in stats["endpoints"]] == [w.a_endpoint]
    # Whose the dead ones are: seller-a's one, not seller-b's two.
    assert stats["dead_by_owner"] == {"(unowned)": 1} and stats["held_by_owner"] == {}
    not_found(await w.get("/v1/stats", params={"tenant": B}))


async def _audit(w: World) -> None:
    items = (await w.get("/v1/audit")).json()["items"]
    only_a(items)
    assert w.b_endpoint not in {item["target_id"] for item in items}
    assert (await w.get("/v1/audit", params={"target": w.b_endpoint})).json()["items"] == []
    not_found(await w.get("/v1/audit", params={"tenant": B}))


async def _list_tenants(w: World) -> None:
    assert [t["id"] for t in (await w.get("/v1/tenants")).json()["items"]] == [A]


async def _create_tenant(w: World) -> None:
    assert (await w.post("/v1/tenants", {"id": "seller-c"})).status_code == 403
    assert scalar(w.engine, "SELECT count(*) FROM tenants WHERE uid = 'seller-c'") == 0
    refused = rows(w.engine, "SELECT actor, tenant_uid FROM audit_log WHERE action = 'api.refused'")
    assert [(r["actor"], r["tenant_uid"]) for r in refused] == [("token:a-ops", A)]


async def _show_tenant(w: World) -> None:
    not_found(await w.get(f"/v1/tenants/{B}"))
    not_found(await w.get("/v1/tenants/default"))
    own = (await w.get(f"/v1/tenants/{A}")).json()
    assert own["deliveries"]["dead"] == 1
    assert "pending_elsewhere" not in own  # the warehouse's copies are not seller-a's rows


async def _update_tenant(w: World) -> None:
    not_found(await w.patch(f"/v1/tenants/{B}", {"name": "mine"}))
    # Its own tenant it may read, never change (caps, name): that is the platform's call.
    assert (await w.patch(f"/v1/tenants/{A}", {"max_in_flight": 0})).status_code == 403


async def _disable_tenant(w: World) -> None:
    not_found(await w.post(f"/v1/tenants/{B}/disable", {"reason": "x"}))


async def _enable_tenant(w: World) -> None:
    not_found(await w.post(f"/v1/tenants/{B}/enable"))


async def _delete_tenant(w: World) -> None:
    not_found(await w.delete(f"/v1/tenants/{B}?reason=x&force=true"))


async def _portal_link(w: World) -> None:
    not_found(await w.post(f"/v1/tenants/{B}/portal-links"))
    not_found(await w.post("/v1/tenants/default/portal-links"))
    mine = await w.post(f"/v1/tenants/{A}/portal-links", {"ttl_seconds": 60})
    assert mine.status_code == 200 and mine.json()["tenant"] == A
    issued = rows(w.engine, "SELECT tenant_uid FROM portal_links")
    assert [r["tenant_uid"] for r in issued] == [A]


async def _list_tokens(w: World) -> None:
    names = [t["name"] for t in (await w.get("/v1/tokens")).json()["items"]]
    assert names == ["a-ops"]


async def _create_token(w: World) -> None:
    not_found(await w.post("/v1/tokens", {"name": "b-bot", "role": "viewer", "tenant": B}))
    made = (await w.post("/v1/tokens", {"name": "a-bot", "role": "viewer"})).json()
    assert made["tenant"] == A  # a scoped caller's tokens are confined like itself
    # Names are unique per tenant: seller-b's token names cannot be probed by a clash.
    same = await w.post("/v1/tokens", {"name": "b-bot", "role": "viewer"})
    assert same.status_code == 200 and same.json()["tenant"] == A


async def _revoke_token(w: World) -> None:
    b_token_id = scalar(w.engine, "SELECT token_id FROM admin_tokens WHERE name = 'b-bot'")
    not_found(await w.delete(f"/v1/tokens/{b_token_id}"))
    not_found(await w.delete("/v1/tokens/b-bot"))
    not_found(await w.delete("/v1/tokens/root"))  # an unscoped token is no tenant's
    revoked = await w.delete("/v1/tokens/a-ops")
    assert revoked.status_code == 200  # its own: the token just revoked itself
    assert (await w.get("/v1/tokens")).status_code == 401


async def _list_event_types(w: World) -> None:
    # The catalogue is the installation's contract, shared by every tenant: readable.
    assert (await w.get("/v1/event-types")).status_code == 200


async def _add_event_type(w: World) -> None:
    refused = await w.post("/v1/event-types", {"name": "b.thing", "schema": {}})
    assert refused.status_code == 403
    assert scalar(w.engine, "SELECT count(*) FROM event_types") == 0


async def _with_type(w: World) -> None:
    with w.engine.begin() as conn:
        add_event_type(conn, "order.created", schema={}, actor="cli:root")


async def _show_event_type(w: World) -> None:
    await _with_type(w)
    assert (await w.get("/v1/event-types/order.created")).json()["version"] == 1
    not_found(await w.get("/v1/event-types/no.such"))


async def _update_event_type(w: World) -> None:
    await _with_type(w)
    assert (await w.patch("/v1/event-types/order.created", {"schema": {}})).status_code == 403


async def _deprecate_event_type(w: World) -> None:
    await _with_type(w)
    assert (await w.post("/v1/event-types/order.created/deprecate")).status_code == 403


async def _archive_event_type(w: World) -> None:
    await _with_type(w)
    assert (await w.post("/v1/event-types/order.created/archive")).status_code == 403
    assert scalar(w.engine, "SELECT status FROM event_types") == "active"


async def _contract_openapi(w: World) -> None:
    assert "webhooks" in (await w.get("/v1/contract/openapi.json")).json()


def _reject_one_event_each(w: World) -> dict[str, str]:
    """Mark one event of each seller rejected (as the relay does); returns their ids."""
    ids = {}
    for tenant in (A, B):
        ids[tenant] = scalar(
            w.engine,
            "SELECT message_id FROM outbox_events WHERE event_type = 'order.created'"
            " AND tenant_id = (SELECT id FROM tenants WHERE uid = :t) ORDER BY id LIMIT 1",
            t=tenant,
        )
    with w.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE outbox_events SET rejected_at = now(), rejected_reason = 'test'"
                " WHERE message_id = ANY(:ids)"
            ),
            {"ids": list(ids.values())},
        )
    return ids


async def _list_rejected(w: World) -> None:
    ids = _reject_one_event_each(w)
    items = (await w.get("/v1/events/rejected")).json()["items"]
    assert [item["message_id"] for item in items] == [ids[A]]


async def _requeue_rejected(w: World) -> None:
    ids = _reject_one_event_each(w)
    not_found(await w.post(f"/v1/events/{ids[B]}/requeue", {"reason": "mine now"}))
    assert scalar(
        w.engine, "SELECT rejected_at IS NOT NULL FROM outbox_events WHERE message_id = :m",
        m=ids[B],
    )  # fmt: skip
    mine = await w.post(f"/v1/events/{ids[A]}/requeue", {"reason": "fixed"})
    assert mine.status_code == 200, mine.text


async def _test_endpoint(w: World) -> None:
    not_found(await w.post(f"/v1/endpoints/{w.b_endpoint}/test", {"wait_seconds": 0}))
    not_found(await w.post(f"/v1/endpoints/{w.warehouse}/test", {"wait_seconds": 0}))
    mine = await w.post(f"/v1/endpoints/{w.a_endpoint}/test", {"wait_seconds": 0})
    assert mine.status_code == 200 and mine.json()["endpoint_id"] == w.a_endpoint


CASES: dict[tuple[str, str], Case] = {
    ("GET", "/v1/event-types"): _list_event_types,
    ("POST", "/v1/event-types"): _add_event_type,
    ("GET", "/v1/event-types/{name}"): _show_event_type,
    ("PATCH", "/v1/event-types/{name}"): _update_event_type,
    ("POST", "/v1/event-types/{name}/deprecate"): _deprecate_event_type,
    ("POST", "/v1/event-types/{name}/archive"): _archive_event_type,
    ("GET", "/v1/contract/openapi.json"): _contract_openapi,
    ("GET", "/v1/events/rejected"): _list_rejected,
    ("POST", "/v1/events/{message_id}/requeue"): _requeue_rejected,
    ("POST", "/v1/endpoints/{uid}/test"): _test_endpoint,
    ("GET", "/metrics"): _metrics,
    ("GET", "/v1/deliveries"): _list_deliveries,
    ("GET", "/v1/deliveries/{id}"): _show_delivery,
    ("POST", "/v1/deliveries/{id}/replay"): _replay_one,
    ("POST", "/v1/replays"): _replay_many,
    ("POST", "/v1/deliveries/{id}/discard"): _discard_one,
    ("POST", "/v1/discards"): _discard_many,
    ("POST", "/v1/deliveries/{id}/confirm"): _confirm_held,
    ("PATCH", "/v1/endpoints/{uid}/failure-policy"): _set_failure_policy,
    ("PATCH", "/v1/event-types/{name}/workflow"): _set_workflow,
    ("POST", "/v1/deliveries/{id}/retry"): _retry_held,
    ("GET", "/v1/endpoints"): _list_endpoints,
    ("POST", "/v1/endpoints"): _create_endpoint,
    ("PATCH", "/v1/endpoints/{uid}"): _update_endpoint,
    ("PATCH", "/v1/endpoints/{uid}/auth"): _set_endpoint_auth,
    ("GET", "/v1/endpoints/{uid}/concurrency"): _show_concurrency,
    ("PATCH", "/v1/endpoints/{uid}/concurrency"): _set_concurrency,
    ("DELETE", "/v1/endpoints/{uid}"): _delete_endpoint,
    ("POST", "/v1/endpoints/{uid}/enable"): _enable_endpoint,
    ("POST", "/v1/endpoints/{uid}/disable"): _disable_endpoint,
    ("POST", "/v1/endpoints/{uid}/rotate-secret"): _rotate_secret,
    ("POST", "/v1/endpoints/{uid}/feed-token"): _rotate_feed_token,
    ("GET", "/feed/v1/{endpoint}"): _read_feed,
    ("GET", "/v1/stats"): _stats,
    ("GET", "/v1/audit"): _audit,
    ("GET", "/v1/tenants"): _list_tenants,
    ("POST", "/v1/tenants"): _create_tenant,
    ("GET", "/v1/tenants/{tenant}"): _show_tenant,
    ("PATCH", "/v1/tenants/{tenant}"): _update_tenant,
    ("POST", "/v1/tenants/{tenant}/disable"): _disable_tenant,
    ("POST", "/v1/tenants/{tenant}/enable"): _enable_tenant,
    ("DELETE", "/v1/tenants/{tenant}"): _delete_tenant,
    ("POST", "/v1/tenants/{tenant}/portal-links"): _portal_link,
    ("GET", "/v1/tokens"): _list_tokens,
    ("POST", "/v1/tokens"): _create_token,
    ("DELETE", "/v1/tokens/{token}"): _revoke_token,
}

# Routes that need no token and hold no tenant's data.
# No admin token: the feed takes its endpoint's feed token (scoped by it: _read_feed).
PUBLIC = {
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/openapi.json"),
    ("GET", "/feed/v1/{endpoint}"),
}


def test_every_route_has_a_scoping_case() -> None:
    served = {(op.method, op.path) for op in all_routes()}
    assert {(op.method, op.path) for op in all_routes() if op.role is None} == PUBLIC
    missing = served - PUBLIC - set(CASES)
    assert not missing, f"add a tenant-scoping case to CASES for {sorted(missing)}"
    assert set(CASES) <= served


@pytest.mark.parametrize("route", sorted(CASES), ids=lambda r: f"{r[0]} {r[1]}")
async def test_a_scoped_token_cannot_reach_another_tenants_objects(
    world: World, route: tuple[str, str]
) -> None:
    before = seller_b_state(world.engine)
    await CASES[route](world)
    assert seller_b_state(world.engine) == before


async def test_an_unscoped_token_narrows_with_the_tenant_filter(world: World) -> None:
    root = world.root
    listed = await world.http.get("/v1/deliveries", params={"tenant": B}, headers=root)
    assert [d["id"] for d in listed.json()["items"]] == sorted(world.b_dead, reverse=True)
    everything = (await world.http.get("/v1/deliveries", headers=root)).json()["items"]
    assert {d["tenant"] for d in everything} == {A, B, "default"}
    endpoints = (await world.http.get("/v1/endpoints", headers=root)).json()
    assert [e["id"] for e in endpoints["all_tenants"]] == [world.warehouse]
    assert world.warehouse not in [e["id"] for e in endpoints["items"]]
    unknown = await world.http.get("/v1/stats", params={"tenant": "nobody"}, headers=root)
    assert unknown.status_code == 404 and "outbox tenants list" in unknown.json()["error"]
    metrics = (await world.http.get("/metrics", headers=root)).text
    assert 'outbox_tenants{state="enabled"} 3.0' in metrics


async def test_a_token_of_a_deleted_tenant_gets_a_clear_401(world: World) -> None:
    viewer = _token(world.engine, "b-viewer", "viewer", B)
    assert (await world.http.get("/v1/deliveries", headers=viewer)).status_code == 200
    with world.engine.begin() as conn:
        publish(conn, "order.created", {"late": True}, tenant=B)  # not relayed yet
    refused = await world.http.delete(f"/v1/tenants/{B}?reason=churned", headers=world.root)
    # The late event, and the delivery.dead reports of seller-b's two dead deliveries.
    assert refused.status_code == 400 and "3 unrelayed events" in refused.json()["error"]
    assert (await world.http.get("/v1/deliveries", headers=viewer)).status_code == 200
    deleted = await world.http.delete(f"/v1/tenants/{B}?reason=churned&force=1", headers=world.root)
    assert deleted.status_code == 200, deleted.text
    assert deleted.json()["revoked_tokens"]
    answer = await world.http.get("/v1/deliveries", headers=viewer)
    assert answer.status_code == 401
    assert "seller-b" in answer.json()["error"] and "deleted" in answer.json()["error"]
    # Even when the tenant is re-created under the same id, the old token stays refused.
    with world.engine.begin() as conn:
        create_tenant(conn, B)
    assert (await world.http.get("/v1/deliveries", headers=viewer)).status_code == 401


@pytest.mark.parametrize(
    ("bad", "says"),
    [("", "empty"), ("x" * 256, "over the limit"), ("a\x01b", "control character")],
    ids=["empty", "too-long", "control-char"],
)
async def test_bad_tenant_ids_are_one_line_errors_that_write_nothing(
    world: World, bad: str, says: str
) -> None:
    before = rows(world.engine, "SELECT count(*) AS n FROM audit_log")[0]["n"]
    tenants = scalar(world.engine, "SELECT count(*) FROM tenants")
    for answer in (
        await world.http.post("/v1/tenants", json={"id": bad}, headers=world.root),
        await world.http.post(
            "/v1/tokens", json={"name": "t", "role": "viewer", "tenant": bad}, headers=world.root
        ),
        await world.http.post(
            "/v1/endpoints",
            json={"url": "http://127.0.0.1:1/x", "event_types": ["*"], "tenant": bad},
            headers=world.root,
        ),
        *(
            [await world.http.get("/v1/deliveries", params={"tenant": bad}, headers=world.root)]
            if bad  # an empty query parameter is no filter at all
            else []
        ),
    ):
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert says in error and "\n" not in error
    assert scalar(world.engine, "SELECT count(*) FROM tenants") == tenants
    assert rows(world.engine, "SELECT count(*) AS n FROM audit_log")[0]["n"] == before
    assert scalar(world.engine, "SELECT count(*) FROM admin_tokens") == 3
