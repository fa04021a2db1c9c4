"""Per-workflow thresholds and owners: each threshold fires and stays quiet on a manual
clock; dead and held deliveries count per owner; an endpoint can take only one owner's
operational events; hostile thresholds and owners are refused with what to give."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import httpx
import pytest
from click.testing import CliRunner, Result
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.operator.api import create_app
from delivery.operator.cli import main
from delivery.receiver import Behaviour, Receiver
from outbox import publish
from outbox.catalogue import add_event_type
from outbox.clock import ManualClock
from outbox.crypto import SecretBox, generate_key
from outbox.endpoints import set_failure_policy
from outbox.errors import OperationError
from outbox.relay import Relay
from outbox.stats import Alert, collect_stats
from outbox.tokens import create_token
from outbox.workflows import set_workflow
from tests.helpers import add_endpoint, rows, scalar
from tests.operator_helpers import deliver

KEY = generate_key("workflows")


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


def alerts(engine: Engine, clock: ManualClock, window_minutes: int = 60) -> dict[str, Alert]:
    with engine.connect() as conn:
        stats = collect_stats(conn, now=clock.now(), window=dt.timedelta(minutes=window_minutes))
    return {a.name: a for a in stats.alerts if a.name.startswith("workflow_")}


def catalogue(engine: Engine, *names: str) -> None:
    with engine.begin() as conn:
        for name in names:
            add_event_type(conn, name, schema={}, actor="t")


async def test_oldest_due_fires_past_its_threshold_and_not_before(
    engine: Engine, async_engine: AsyncEngine, box: SecretBox, clock: ManualClock
) -> None:
    catalogue(engine, "invoice.paid", "order.created")
    add_endpoint(engine, box, "https://example.com/h")
    with engine.begin() as conn:
        set_workflow(conn, "invoice.paid", actor="t", alert_oldest_seconds=300, owner="billing")
        publish(conn, "invoice.paid", {"n": 1})
        publish(conn, "order.created", {"n": 1})  # no threshold: no signal of its own
    await Relay(async_engine, clock).run_until_idle()  # due now; no worker runs
    clock.advance(299)
    quiet = alerts(engine, clock)
    assert list(quiet) == ["workflow_oldest_due:invoice.paid"]
    assert not quiet["workflow_oldest_due:invoice.paid"].firing
    clock.advance(2)
    late = alerts(engine, clock)["workflow_oldest_due:invoice.paid"]
    assert late.firing and late.value == pytest.approx(301) and late.threshold == 300
    assert "owner billing" in late.message


async def test_error_rate_fires_at_its_threshold_within_the_window_only(
    engine: Engine,
    async_engine: AsyncEngine,
    box: SecretBox,
    clock: ManualClock,
    receiver: Receiver,
) -> None:
    catalogue(engine, "invoice.paid", "order.created")
    add_endpoint(engine, box, receiver.route("/ok"), "*")
    add_endpoint(engine, box, receiver.route("/busy", status=503), "invoice.*")
    with engine.begin() as conn:
        set_workflow(conn, "invoice.paid", actor="t", alert_error_rate=0.5)
        set_workflow(conn, "order.created", actor="t", alert_error_rate=0.2)
        publish(conn, "invoice.paid", {"n": 1})
        publish(conn, "order.created", {"n": 1})
    await deliver(async_engine, box, clock)
    found = alerts(engine, clock)
    invoice, order = (
        found["workflow_error_rate:invoice.paid"],
        found["workflow_error_rate:order.created"],
    )
    assert (invoice.firing, invoice.value) == (True, 0.5)  # one of two attempts failed
    assert (order.firing, order.value) == (False, 0.0)
    with engine.begin() as conn:
        set_workflow(conn, "invoice.paid", actor="t", alert_error_rate=0.6)
    assert not alerts(engine, clock)["workflow_error_rate:invoice.paid"].firing
    with engine.begin() as conn:
        set_workflow(conn, "invoice.paid", actor="t", alert_error_rate=0.5)
    clock.advance(minutes=61)  # the failed attempt left the window
    assert not alerts(engine, clock)["workflow_error_rate:invoice.paid"].firing


async def test_processing_p95_fires_above_its_threshold(
    engine: Engine,
    async_engine: AsyncEngine,
    box: SecretBox,
    clock: ManualClock,
    receiver: Receiver,
) -> None:
    catalogue(engine, "invoice.paid")
    add_endpoint(engine, box, receiver.route("/ok"), "*")
    with engine.begin() as conn:
        set_workflow(conn, "invoice.paid", actor="t", alert_processing_p95_seconds=30)
        publish(conn, "invoice.paid", {"n": 1})
    await Relay(async_engine, clock).run_until_idle()
    # Published 40 s before the manual clock's now: delivered 40 s after it was published.
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE outbox_events SET created_at = :t"),
            {"t": clock.now() - dt.timedelta(seconds=40)},
        )
    await deliver(async_engine, box, clock)
    p95 = alerts(engine, clock)["workflow_processing_p95:invoice.paid"]
    assert p95.firing and p95.value == pytest.approx(40, abs=1)
    with engine.begin() as conn:
        set_workflow(conn, "invoice.paid", actor="t", alert_processing_p95_seconds=60)
    assert not alerts(engine, clock)["workflow_processing_p95:invoice.paid"].firing
    with engine.begin() as conn:
        set_workflow(conn, "invoice.paid", actor="t", alert_processing_p95_seconds=None)
    assert "workflow_processing_p95:invoice.paid" not in alerts(engine, clock)


def test_thresholds_from_the_cli_and_hostile_values(engine: Engine, outbox: Any) -> None:
    catalogue(engine, "invoice.paid")
    done = outbox(
        "event-types", "set", "invoice.paid", "--alert-oldest", "5m", "--alert-error-rate",
        "0.2", "--alert-processing-p95", "30s", "--owner", "billing", "--on-ambiguous", "hold",
        "--json",
    )  # fmt: skip
    assert json.loads(done.output) == {
        "name": "invoice.paid",
        "on_ambiguous": "hold",
        "owner": "billing",
        "alert_oldest_seconds": 300.0,
        "alert_error_rate": 0.2,
        "alert_processing_p95_seconds": 30.0,
    }
    for flag, bad, says in [
        ("--alert-oldest", "-5m", "not a duration"),
        ("--alert-oldest", "0", "more than 0"),
        ("--alert-oldest", "5y", "not a duration"),
        ("--alert-oldest", "99999d", "longer than"),
        ("--alert-oldest", "3000h", "at most 30 days"),
        ("--alert-error-rate", "0", "more than 0"),
        ("--alert-error-rate", "1.5", "at most 1"),
        ("--alert-error-rate", "nan", "share between 0 and 1"),
        ("--alert-error-rate", "20%", "not a share"),
        ("--alert-processing-p95", "-1s", "not a duration"),
        ("--owner", "<b>x</b>", "team name"),
        ("--owner", "a" * 65, "team name"),
        ("--owner", "ops\x1b[31m", "team name"),
    ]:
        refused = outbox("event-types", "set", "invoice.paid", flag, bad, ok=False)
        assert refused.exit_code != 0 and says in refused.output, (flag, bad, refused.output)
    outbox("event-types", "set", "invoice.paid", "--alert-oldest", "off", "--owner", "off")
    [row] = rows(engine, "SELECT owner, alert_oldest_seconds FROM event_types")
    assert dict(row) == {"owner": None, "alert_oldest_seconds": None}
    # Nothing refused reached the audit log; each change did.
    assert scalar(engine, "SELECT count(*) FROM audit_log WHERE action = 'event_type.set'") == 2
    missing = outbox("event-types", "set", "no.such", "--owner", "x", ok=False)
    assert "no event type 'no.such'" in missing.output


async def test_dead_and_held_counted_per_owner_in_stats_and_metrics(
    engine: Engine,
    async_engine: AsyncEngine,
    box: SecretBox,
    clock: ManualClock,
    receiver: Receiver,
) -> None:
    catalogue(engine, "invoice.paid")
    gone = receiver.route("/bad", status=400)
    owned = add_endpoint(engine, box, gone, "order.*").endpoint.uid
    add_endpoint(engine, box, gone, "invoice.*")
    add_endpoint(engine, box, gone, "misc.*")
    with engine.begin() as conn:
        set_failure_policy(conn, owned, actor="t", owner="shipping")
        set_workflow(conn, "invoice.paid", actor="t", owner="billing")
        for event_type in ("order.created", "order.created", "invoice.paid", "misc.thing"):
            publish(conn, event_type, {})
    await deliver(async_engine, box, clock)
    with engine.connect() as conn:
        stats = collect_stats(conn, now=clock.now())
    assert stats.dead_by_owner == {"shipping": 2, "billing": 1, "(unowned)": 1}
    [dead_alert] = [a for a in stats.alerts if a.name == "dead_letters_rising"]
    assert dead_alert.message.endswith(
        "; dead now by owner: shipping: 2, billing: 1, no owner: 1"
    ), dead_alert.message
    with engine.begin() as conn:
        _, secret = create_token(conn, name="m", role="viewer", actor="t")
    app = create_app(async_engine, box, clock=clock)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://admin"
    ) as api:
        scraped = await api.get("/metrics", headers={"authorization": f"Bearer {secret}"})
    [family] = [
        f
        for f in text_string_to_metric_families(scraped.text)
        if f.name == "outbox_owner_deliveries"
    ]
    counted = {(s.labels["owner"], s.labels["state"]): s.value for s in family.samples}
    assert counted == {
        ("shipping", "dead"): 2, ("billing", "dead"): 1, ("(unowned)", "dead"): 1,
    }  # fmt: skip


async def test_an_endpoint_takes_only_its_owners_operational_events(
    engine: Engine,
    async_engine: AsyncEngine,
    box: SecretBox,
    clock: ManualClock,
    receiver: Receiver,
) -> None:
    """Two teams' endpoints hold ambiguous outcomes (the receiver reads the request and
    drops the connection); the `delivery.held` events name each owner, and a watcher with
    `operational_owner = shipping` gets shipping's only, a plain watcher both."""
    dropped = receiver.route("/drop", Behaviour(reset=True))
    for team in ("shipping", "billing"):
        uid = add_endpoint(engine, box, dropped, f"{team}.*").endpoint.uid
        with engine.begin() as conn:
            set_failure_policy(conn, uid, actor="t", owner=team, on_ambiguous="hold")
    for path, team in (("/ops-shipping", "shipping"), ("/ops-all", None)):
        uid = add_endpoint(engine, box, receiver.route(path), "delivery.*").endpoint.uid
        if team:
            with engine.begin() as conn:
                set_failure_policy(conn, uid, actor="t", operational_owner=team)
    with engine.begin() as conn:
        publish(conn, "shipping.sent", {})
        publish(conn, "billing.charged", {})
    await deliver(async_engine, box, clock)  # two held, two delivery.held events
    await deliver(async_engine, box, clock)  # the operational events go out
    got = {
        path: sorted(json.loads(r.body)["data"]["owner"] for r in receiver.received(path))
        for path in ("/ops-shipping", "/ops-all")
    }
    assert got == {"/ops-shipping": ["shipping"], "/ops-all": ["billing", "shipping"]}


def test_hostile_endpoint_policy_from_the_cli(engine: Engine, box: SecretBox, outbox: Any) -> None:
    uid = add_endpoint(engine, box, "https://example.com/h").endpoint.uid
    for args, says in [
        (["--owner", "<img src=x>"], "team name"),
        (["--operational-owner", "x" * 200], "team name"),
        (["--on-ambiguous", "maybe"], "'maybe' is not one of"),
        ([], "nothing to change"),
    ]:
        refused = outbox("endpoints", "set", uid, *args, ok=False)
        assert refused.exit_code != 0 and says in refused.output, (args, refused.output)
    done = json.loads(outbox("endpoints", "set", uid, "--owner", "ops", "--json").output)
    assert (done["owner"], done["on_ambiguous"]) == ("ops", "retry")
    with pytest.raises(OperationError), engine.begin() as conn:
        set_failure_policy(conn, "ep_nope", actor="t", owner="ops")


async def test_workflow_settings_over_the_api(
    engine: Engine, async_engine: AsyncEngine, box: SecretBox, clock: ManualClock
) -> None:
    catalogue(engine, "invoice.paid")
    with engine.begin() as conn:
        _, secret = create_token(conn, name="ops", role="operator", actor="t")
    auth = {"authorization": f"Bearer {secret}"}
    app = create_app(async_engine, box, clock=clock)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://admin"
    ) as api:
        url = "/v1/event-types/invoice.paid/workflow"
        done = await api.patch(
            url, json={"alert_error_rate": 0.2, "owner": "billing"}, headers=auth
        )
        assert (done.json()["alert_error_rate"], done.json()["owner"]) == (0.2, "billing")
        for bad in (
            {"alert_error_rate": 2},
            {"alert_error_rate": "NaN"},
            {"alert_oldest_seconds": -1},
            {"alert_oldest_seconds": 0},
            {"alert_processing_p95_seconds": 1e12},
            {"owner": "x y"},
            {"on_ambiguous": "sometimes"},
        ):
            answer = await api.patch(url, json=bad, headers=auth)
            assert answer.status_code == 400, (bad, answer.text)
        cleared = await api.patch(url, json={"owner": None}, headers=auth)
        assert cleared.json()["owner"] is None and cleared.json()["alert_error_rate"] == 0.2
        missing = await api.patch(
            "/v1/event-types/no.such/workflow", json={"owner": "x"}, headers=auth
        )
        assert missing.status_code == 404


async def test_dead_delivery_events_name_the_owner_and_route_by_it(
    engine: Engine,
    async_engine: AsyncEngine,
    box: SecretBox,
    clock: ManualClock,
    receiver: Receiver,
) -> None:
    catalogue(engine, "billing.charged")
    bad = receiver.route("/bad", status=400)
    shipping = add_endpoint(engine, box, bad, "shipping.*").endpoint.uid
    add_endpoint(engine, box, bad, "billing.*")
    watcher = add_endpoint(engine, box, receiver.route("/ops"), "delivery.dead").endpoint.uid
    with engine.begin() as conn:
        set_failure_policy(conn, shipping, actor="t", owner="shipping")
        set_workflow(conn, "billing.charged", actor="t", owner="billing")
        set_failure_policy(conn, watcher, actor="t", operational_owner="billing")
        publish(conn, "shipping.sent", {})
        publish(conn, "billing.charged", {})
    await deliver(async_engine, box, clock)
    await deliver(async_engine, box, clock)
    owners = sorted(
        r["owner"]
        for r in rows(
            engine,
            "SELECT payload ->> 'owner' AS owner FROM outbox_events"
            " WHERE event_type = 'delivery.dead'",
        )
    )
    assert owners == ["billing", "shipping"]  # the endpoint's, else the event type's
    got = [json.loads(r.body)["data"] for r in receiver.received("/ops")]
    assert [(d["owner"], d["event_type"]) for d in got] == [("billing", "billing.charged")]
