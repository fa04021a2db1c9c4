"""Hold on ambiguity: an attempt that went out and got no answer waits for a person.

A real receiver on 127.0.0.1 reads the request and never answers, so the worker's deadline
makes the attempt ambiguous. With `on_ambiguous = hold` (on the endpoint or the event type)
the delivery is held: no worker or reaper pass takes it again, however far the manual clock
moves, until an operator confirms it, sends it again or discards it (CLI and API here; the
console in tests/test_console_hold.py).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from click.testing import CliRunner, Result
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.health import EndpointLimits, set_endpoint_limits
from delivery.http import build_http_client
from delivery.operator.api import create_app
from delivery.operator.cli import main
from delivery.reaper import Reaper
from delivery.receiver import Behaviour, Receiver
from delivery.worker import Worker, WorkerConfig
from outbox import publish, status
from outbox.catalogue import add_event_type
from outbox.clock import ManualClock
from outbox.crypto import SecretBox, generate_key
from outbox.endpoints import set_failure_policy
from outbox.errors import OperationError
from outbox.relay import Relay
from outbox.stats import collect_stats
from outbox.tokens import create_token
from outbox.workflows import set_workflow
from tests.helpers import LOOPBACK, add_endpoint, rows, scalar

KEY = generate_key("hold")
SILENT = Behaviour(delay=30)  # reads the request, then no answer before the deadline


@pytest.fixture
def hold_box() -> SecretBox:
    return SecretBox.from_setting(KEY)


@pytest.fixture
def outbox(database_url: str) -> Any:
    runner = CliRunner()
    env = {"OUTBOX_DATABASE_URL": database_url, "OUTBOX_SECRET_KEYS": KEY, "USER": "night"}

    def invoke(*args: str, ok: bool = True) -> Result:
        result = runner.invoke(main, list(args), env=env, catch_exceptions=False)
        if ok:
            assert result.exit_code == 0, result.output
        return result

    return invoke


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with build_http_client(max_connections=10, timeout=5, allowed_networks=LOOPBACK) as c:
        yield c


async def passes(
    async_engine: AsyncEngine,
    http: httpx.AsyncClient,
    box: SecretBox,
    clock: ManualClock,
    times: int = 1,
) -> None:
    """Relay, then `times` worker and reaper passes, each a day after the last: far past
    every backoff, lease and breaker cooldown."""
    await Relay(async_engine, clock).run_until_idle()
    config = WorkerConfig(request_timeout=0.3, lease_seconds=30, retry_schedule=(5.0, 60.0))
    worker = Worker(async_engine, http, box, clock, config)
    for _ in range(times):
        while (await worker.run_once()).claimed:
            pass
        await Reaper(async_engine, clock).run_once()
        clock.advance(days=1)


def delivery(engine: Engine) -> dict[str, Any]:
    [row] = rows(
        engine,
        "SELECT d.id, d.state, d.attempts, d.final_reason, d.completed_at, ev.message_id,"
        " (SELECT count(*) FROM delivery_attempts a WHERE a.delivery_id = d.id) AS tried,"
        " (SELECT array_agg(a.outcome ORDER BY a.id) FROM delivery_attempts a"
        "  WHERE a.delivery_id = d.id) AS outcomes"
        " FROM deliveries d JOIN outbox_events ev ON ev.id = d.event_id"
        " WHERE ev.event_type NOT LIKE 'delivery.%'",
    )
    return dict(row)


def held_events(engine: Engine) -> list[dict[str, Any]]:
    return [
        dict(r["payload"])
        for r in rows(
            engine,
            "SELECT payload FROM outbox_events WHERE event_type = 'delivery.held' ORDER BY id",
        )
    ]


async def hold_one(
    engine: Engine,
    async_engine: AsyncEngine,
    http: httpx.AsyncClient,
    box: SecretBox,
    clock: ManualClock,
    receiver: Receiver,
) -> dict[str, Any]:
    """A `hold` endpoint owned by payments, a silent receiver, one event: held."""
    url = receiver.route("/silent", SILENT)
    uid = add_endpoint(engine, box, url, "invoice.*").endpoint.uid
    with engine.begin() as conn:
        set_failure_policy(conn, uid, actor="t", on_ambiguous="hold", owner="payments")
        publish(conn, "invoice.paid", {"id": "inv_7"})
    await passes(async_engine, http, box, clock)
    return delivery(engine)


async def test_a_silent_receiver_keeps_the_delivery_held_until_someone_acts(
    engine: Engine,
    async_engine: AsyncEngine,
    http: httpx.AsyncClient,
    hold_box: SecretBox,
    clock: ManualClock,
    receiver: Receiver,
) -> None:
    held = await hold_one(engine, async_engine, http, hold_box, clock, receiver)
    assert (held["state"], held["attempts"], held["outcomes"]) == ("held", 1, ["ambiguous"])
    assert held["completed_at"] is None
    assert held["final_reason"].startswith("held for review at ")
    assert len(receiver.received("/silent")) == 1  # it did reach the receiver
    # Ten more days of worker and reaper passes: nothing claims it, nothing is sent.
    await passes(async_engine, http, hold_box, clock, times=10)
    again = delivery(engine)
    assert (again["state"], again["tried"]) == ("held", 1)
    assert len(receiver.received("/silent")) == 1
    # The application sees it needs a person; the owner is told, once, by an event naming it.
    with engine.connect() as conn:
        assert status(conn, held["message_id"]).state == "needs_attention"  # type: ignore[union-attr]
    [event] = held_events(engine)
    assert event["delivery_id"] == held["id"] and event["owner"] == "payments"
    assert event["message_id"] == held["message_id"]


async def test_without_hold_an_ambiguous_attempt_is_retried(
    engine: Engine,
    async_engine: AsyncEngine,
    http: httpx.AsyncClient,
    hold_box: SecretBox,
    clock: ManualClock,
    receiver: Receiver,
) -> None:
    add_endpoint(engine, hold_box, receiver.route("/silent", SILENT), "invoice.*")
    with engine.begin() as conn:
        publish(conn, "invoice.paid", {"id": "inv_7"})
    await passes(async_engine, http, hold_box, clock, times=2)
    assert delivery(engine)["outcomes"] == ["ambiguous", "ambiguous"]
    assert held_events(engine) == []


async def test_the_event_type_can_ask_for_hold_when_the_endpoint_does_not(
    engine: Engine,
    async_engine: AsyncEngine,
    http: httpx.AsyncClient,
    hold_box: SecretBox,
    clock: ManualClock,
    receiver: Receiver,
) -> None:
    """Hold if either says hold: the endpoint's 'retry' does not overrule the workflow."""
    uid = add_endpoint(engine, hold_box, receiver.route("/silent", SILENT), "invoice.*")
    with engine.begin() as conn:
        set_failure_policy(conn, uid.endpoint.uid, actor="t", on_ambiguous="retry")
        add_event_type(conn, "invoice.paid", schema={}, actor="t")
        set_workflow(conn, "invoice.paid", actor="t", on_ambiguous="hold", owner="billing")
        publish(conn, "invoice.paid", {"id": "inv_7"})
    await passes(async_engine, http, hold_box, clock, times=3)
    assert (delivery(engine)["state"], delivery(engine)["tried"]) == ("held", 1)
    assert [e["owner"] for e in held_events(engine)] == ["billing"]


async def test_a_held_delivery_nobody_owns_says_so(
    engine: Engine,
    async_engine: AsyncEngine,
    http: httpx.AsyncClient,
    hold_box: SecretBox,
    clock: ManualClock,
    receiver: Receiver,
) -> None:
    """Neither the endpoint nor the event type names an owner: the event says so (null),
    rather than leaving the field out."""
    uid = add_endpoint(engine, hold_box, receiver.route("/silent", SILENT), "invoice.*")
    with engine.begin() as conn:
        set_failure_policy(conn, uid.endpoint.uid, actor="t", on_ambiguous="hold")
        publish(conn, "invoice.paid", {"id": "inv_7"})
    await passes(async_engine, http, hold_box, clock)
    [event] = held_events(engine)
    assert "owner" in event and event["owner"] is None


async def test_cli_confirm_records_success_with_who_and_why(
    engine: Engine,
    async_engine: AsyncEngine,
    http: httpx.AsyncClient,
    hold_box: SecretBox,
    clock: ManualClock,
    receiver: Receiver,
    outbox: Any,
) -> None:
    held = await hold_one(engine, async_engine, http, hold_box, clock, receiver)
    listed = json.loads(outbox("deliveries", "list", "--state", "held", "--json").output)
    assert [(i["id"], i["owner"]) for i in listed["items"]] == [(held["id"], "payments")]
    for owner, found in (("payments", [held["id"]]), ("billing", [])):  # --owner filters
        by_owner = outbox("deliveries", "list", "--owner", owner, "--json").output
        assert [i["id"] for i in json.loads(by_owner)["items"]] == found
    refused = outbox("deliveries", "confirm", str(held["id"]), "--reason", " ", ok=False)
    assert refused.exit_code != 0 and "reason" in refused.output
    outbox("deliveries", "confirm", str(held["id"]), "--reason", "partner's log shows it")
    done = delivery(engine)
    assert (done["state"], done["final_reason"]) == ("succeeded", "partner's log shows it")
    assert done["completed_at"] is not None
    [audit] = rows(engine, "SELECT actor, action, reason, target_id FROM audit_log"
                   " WHERE action LIKE 'delivery.%'")  # fmt: skip
    assert dict(audit) == {
        "actor": "cli:night",
        "action": "delivery.confirm_held",
        "reason": "partner's log shows it",
        "target_id": str(held["id"]),
    }
    # Settled: a second action is refused and says why.
    again = outbox("deliveries", "retry", str(held["id"]), "--reason", "x", ok=False)
    assert "only held deliveries" in again.output


async def test_cli_retry_sends_the_same_delivery_again_with_its_webhook_id(
    engine: Engine,
    async_engine: AsyncEngine,
    http: httpx.AsyncClient,
    hold_box: SecretBox,
    clock: ManualClock,
    receiver: Receiver,
    outbox: Any,
) -> None:
    held = await hold_one(engine, async_engine, http, hold_box, clock, receiver)
    receiver.route("/silent", status=200)  # the partner is back
    outbox("deliveries", "retry", str(held["id"]), "--reason", "receiver dedupes on webhook-id")
    await passes(async_engine, http, hold_box, clock)
    done = delivery(engine)
    assert (done["id"], done["state"], done["attempts"]) == (held["id"], "succeeded", 2)
    ids = {r.headers["webhook-id"] for r in receiver.received("/silent")}
    assert ids == {held["message_id"]}
    assert scalar(engine, "SELECT count(*) FROM deliveries") == 1  # no new delivery row


async def test_cli_discard_gives_up_with_the_reason(
    engine: Engine,
    async_engine: AsyncEngine,
    http: httpx.AsyncClient,
    hold_box: SecretBox,
    clock: ManualClock,
    receiver: Receiver,
    outbox: Any,
) -> None:
    held = await hold_one(engine, async_engine, http, hold_box, clock, receiver)
    outbox("deliveries", "discard", str(held["id"]), "--reason", "order was cancelled")
    done = delivery(engine)
    assert (done["state"], done["final_reason"]) == ("discarded", "order was cancelled")


async def test_api_confirm_retry_and_discard(
    engine: Engine,
    async_engine: AsyncEngine,
    http: httpx.AsyncClient,
    hold_box: SecretBox,
    clock: ManualClock,
    receiver: Receiver,
) -> None:
    held = await hold_one(engine, async_engine, http, hold_box, clock, receiver)
    with engine.begin() as conn:
        _, secret = create_token(conn, name="ops", role="operator", actor="t")
        _, viewer = create_token(conn, name="look", role="viewer", actor="t")
    app = create_app(async_engine, hold_box, clock=clock)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://admin"
    ) as api:
        auth = {"authorization": f"Bearer {secret}"}
        url = f"/v1/deliveries/{held['id']}"
        listed = await api.get("/v1/deliveries?state=held&owner=payments", headers=auth)
        assert [i["id"] for i in listed.json()["items"]] == [held["id"]]
        other = await api.get("/v1/deliveries?state=held&owner=billing", headers=auth)
        assert other.json()["items"] == []
        bad_owner = await api.get("/v1/deliveries?owner=%3Cb%3E", headers=auth)
        assert bad_owner.status_code == 400 and "team name" in bad_owner.text
        looked = await api.post(
            f"{url}/confirm", json={"reason": "x"}, headers={"authorization": f"Bearer {viewer}"}
        )
        assert looked.status_code == 403
        no_reason = await api.post(f"{url}/confirm", json={}, headers=auth)
        assert no_reason.status_code == 400
        retried = await api.post(f"{url}/retry", json={"reason": "safe"}, headers=auth)
        assert retried.json() == {"retried": [held["id"]]}
        assert delivery(engine)["state"] == "scheduled"
        await passes(async_engine, http, hold_box, clock)  # still silent: held again
        assert (delivery(engine)["state"], delivery(engine)["tried"]) == ("held", 2)
        assert len(held_events(engine)) == 2  # one event per hold
        confirmed = await api.post(f"{url}/confirm", json={"reason": "seen"}, headers=auth)
        assert confirmed.json() == {"confirmed": [held["id"]]}
        assert delivery(engine)["state"] == "succeeded"
        # Discard of a held one, on a second delivery held the same way.
        with engine.begin() as conn:
            publish(conn, "invoice.paid", {"id": "inv_8"})
        await passes(async_engine, http, hold_box, clock)
        second = scalar(engine, "SELECT max(id) FROM deliveries WHERE state = 'held'")
        gone = await api.post(
            f"/v1/deliveries/{second}/discard", json={"reason": "void"}, headers=auth
        )
        assert gone.json() == {"discarded": [second]}
        actions = [
            r["action"]
            for r in rows(
                engine, "SELECT action FROM audit_log WHERE action LIKE 'delivery.%' ORDER BY id"
            )
        ]
        assert actions == ["delivery.retry_held", "delivery.confirm_held", "delivery.discard"]


async def test_a_held_delivery_holds_its_ordering_key_and_nothing_else(
    engine: Engine,
    async_engine: AsyncEngine,
    http: httpx.AsyncClient,
    hold_box: SecretBox,
    clock: ManualClock,
    receiver: Receiver,
) -> None:
    url = receiver.route("/silent", SILENT)
    uid = add_endpoint(engine, hold_box, url, "invoice.*").endpoint.uid
    with engine.begin() as conn:
        set_failure_policy(conn, uid, actor="t", on_ambiguous="hold")
        set_endpoint_limits(conn, uid, EndpointLimits(ordered=True), actor="t")
        publish(conn, "invoice.paid", {"n": 1}, ordering_key="inv_7")
    await passes(async_engine, http, hold_box, clock)
    receiver.route("/silent", status=200)
    with engine.begin() as conn:
        publish(conn, "invoice.paid", {"n": 2}, ordering_key="inv_7")
        publish(conn, "invoice.paid", {"n": 3}, ordering_key="inv_8")
        publish(conn, "invoice.paid", {"n": 4})
    await passes(async_engine, http, hold_box, clock, times=3)
    states = {
        r["n"]: r["state"]
        for r in rows(
            engine,
            "SELECT (ev.payload ->> 'n')::int AS n, d.state FROM deliveries d"
            " JOIN outbox_events ev ON ev.id = d.event_id WHERE ev.event_type = 'invoice.paid'",
        )
    }
    assert states == {1: "held", 2: "scheduled", 3: "succeeded", 4: "succeeded"}


async def test_held_is_counted_in_stats_metrics_and_alerts(
    engine: Engine,
    async_engine: AsyncEngine,
    http: httpx.AsyncClient,
    hold_box: SecretBox,
    clock: ManualClock,
    receiver: Receiver,
    outbox: Any,
) -> None:
    await hold_one(engine, async_engine, http, hold_box, clock, receiver)
    stats = json.loads(outbox("stats", "--json").output)
    assert stats["counts_by_state"]["held"] == 1
    [alert] = [a for a in stats["alerts"] if a["name"] == "deliveries_held"]
    assert alert["firing"] and alert["value"] == 1
    assert "payments" in alert["message"]
    with engine.connect() as conn:
        held_by_owner = collect_stats(conn, now=clock.now()).held_by_owner
    assert held_by_owner == {"payments": 1}


def test_hostile_policy_input_is_refused(engine: Engine, box: SecretBox) -> None:
    uid = add_endpoint(engine, box, "https://example.com/h").endpoint.uid
    for bad in ("", "<script>", "a" * 65, "team\nx", "-lead", "ünï"):
        with pytest.raises(OperationError, match="team name"), engine.begin() as conn:
            set_failure_policy(conn, uid, actor="t", owner=bad or " ")
    with pytest.raises(ValueError, match=r"retry .* or hold"), engine.begin() as conn:
        set_failure_policy(conn, uid, actor="t", on_ambiguous="maybe")
    # The database refuses what slipped past the code, too.
    with pytest.raises(Exception, match="owner_format"), engine.begin() as conn:
        conn.execute(text("UPDATE endpoints SET owner = '<b>x</b>'"))
