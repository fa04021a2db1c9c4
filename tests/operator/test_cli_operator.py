"""The operator commands, driven through click's CliRunner against the real database."""

from __future__ import annotations

import json
from typing import Any

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine
from standardwebhooks import Webhook

from delivery.operator.cli import main
from delivery.operator.cli.common import parse_duration
from delivery.receiver import Receiver
from outbox.clock import ManualClock
from outbox.crypto import SecretBox, generate_key
from tests.helpers import rows, scalar
from tests.operator_helpers import deliver, publish_many, snapshot

KEY = generate_key("cli")


@pytest.fixture
def cli_box() -> SecretBox:
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


def as_json(result: Result) -> Any:
    return json.loads(result.output)


async def test_find_by_error_show_replay_and_audit_from_the_terminal(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    cli_box: SecretBox,
    receiver: Receiver,
    outbox: Any,
) -> None:
    added = as_json(outbox("endpoints", "add", receiver.route("/p", status=400), "--events",
                           "order.*", "--json"))  # fmt: skip
    ok = as_json(outbox("endpoints", "add", receiver.route("/ok"), "--events", "*", "--json"))
    [message_id] = publish_many(engine, "order.created")
    await deliver(async_engine, cli_box, clock)

    found = as_json(outbox("deliveries", "list", "--error", "bad REQUEST", "--json"))
    [dead] = found["items"]
    assert (dead["state"], dead["endpoint"]) == ("dead", added["id"])
    assert "400 Bad Request" in outbox("deliveries", "list", "--state", "dead").output
    assert as_json(outbox("deliveries", "list", "--error", "nothing like it", "--json")) == {
        "items": [],
        "next_before": None,
    }
    shown = outbox("deliveries", "show", str(dead["id"])).output
    assert message_id in shown and "Bad Request" in shown
    before = snapshot(engine, dead["id"])

    dry = outbox("replay", "--endpoint", added["id"], "--reason", "fixed", "--dry-run")
    assert "1 delivery would be replayed; nothing changed" in dry.output
    assert scalar(engine, "SELECT count(*) FROM deliveries") == 2
    refused = outbox("replay", str(dead["id"] + 1), "--reason", "again", ok=False)
    assert refused.exit_code == 1 and "--force" in refused.output
    both = outbox("replay", str(dead["id"]), "--endpoint", "x", "--reason", "r", ok=False)
    assert both.exit_code == 2

    receiver.route("/p", status=200)
    replayed = as_json(outbox("replay", str(dead["id"]), "--reason", "schema fixed", "--json"))
    new_id = replayed["replayed"][0]["replay"]
    clock.advance(60)  # the CLI stamps replays with the wall clock, a little after the test's
    await deliver(async_engine, cli_box, clock)
    assert snapshot(engine, dead["id"]) == before
    assert scalar(engine, "SELECT state FROM deliveries WHERE id = :id", id=new_id) == "succeeded"
    assert receiver.received("/p")[-1].headers["webhook-id"] == message_id

    entries = as_json(outbox("audit", "--json"))
    assert [(e["actor"], e["action"], e["target_id"], e["reason"]) for e in entries] == [
        ("cli:night", "delivery.replay", str(dead["id"]), "schema fixed"),
        ("cli:night", "endpoint.create", ok["id"], None),
        ("cli:night", "endpoint.create", added["id"], None),
    ]
    assert "delivery.replay" in outbox("audit", "--action", "delivery").output


async def test_endpoint_lifecycle_commands_and_rotation_grace(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    cli_box: SecretBox,
    receiver: Receiver,
    outbox: Any,
) -> None:
    first = as_json(outbox("endpoints", "add", receiver.route("/a"), "--events", "a.*", "--json"))
    uid = first["id"]
    outbox("endpoints", "update", uid, "--url", receiver.route("/b"), "--events", "a.*,b.*")
    rotated = as_json(outbox("endpoints", "rotate-secret", uid, "--grace", "1h", "--json"))
    publish_many(engine, "b.thing")
    await deliver(async_engine, cli_box, clock)
    [request] = receiver.received("/b")
    # During the grace period both the old and the new secret verify the same request.
    Webhook(first["secret"]).verify(request.body, request.headers)
    Webhook(rotated["secret"]).verify(request.body, request.headers)

    status = as_json(outbox("endpoints", "status", "--json"))
    assert [(e["uid"], e["attempts"], e["success_rate"]) for e in status] == [(uid, 1, 1.0)]
    outbox("endpoints", "disable", uid, "--reason", "maintenance")
    assert "disabled (maintenance)" in outbox("endpoints", "status").output
    deleted = outbox("endpoints", "delete", uid, "--reason", "partner left")
    assert "with 1 delivery and 1 attempt" in deleted.output
    actions = [e["action"] for e in as_json(outbox("audit", "--json"))]
    assert actions == [
        "endpoint.delete",
        "endpoint.disable",
        "endpoint.rotate_secret",
        "endpoint.update",
        "endpoint.create",
    ]


async def test_discard_stats_and_alerts(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    cli_box: SecretBox,
    receiver: Receiver,
    outbox: Any,
) -> None:
    outbox("endpoints", "add", receiver.route("/down", status=500), "--events", "*")
    publish_many(engine, "order.created", 3)
    await deliver(async_engine, cli_box, clock)
    ids = [str(r["id"]) for r in rows(engine, "SELECT id FROM deliveries ORDER BY id")]
    publish_many(engine, "order.created", 1)  # not relayed: relay lag

    report = as_json(outbox("stats", "--json"))
    assert report["counts_by_state"]["scheduled"] == 3
    assert report["unrelayed_events"] == 1
    [top] = report["top_errors"]
    assert (top["error"], top["deliveries"]) == ("HTTP 500 Internal Server Error", 3)
    text = outbox("stats").output
    assert "most repeated errors" in text and "HTTP 500" in text
    watched = outbox("stats", "--watch", "--times", "2", "--interval", "0", "--json")
    assert len(watched.output.strip().splitlines()) == 2

    discarded = as_json(outbox("discard", *ids, "--reason", "test data", "--json"))
    assert discarded == {"discarded": [int(i) for i in ids]}
    again = outbox("discard", ids[0], "--reason", "twice", ok=False)
    assert again.exit_code == 1 and "discarded" in again.output
    audit = as_json(outbox("audit", "--action", "delivery.discard", "--json"))
    assert sorted(e["target_id"] for e in audit) == sorted(ids)


def test_tokens_create_list_revoke(engine: Engine, outbox: Any) -> None:
    made = as_json(outbox("tokens", "create", "grafana", "--role", "viewer", "--json"))
    assert made["token"].startswith("obx_") and made["role"] == "viewer"
    stored = rows(engine, "SELECT * FROM admin_tokens")[0]
    assert made["token"].split("_", 2)[2] not in json.dumps(stored, default=str)  # the secret
    assert "grafana" in outbox("tokens", "list").output
    duplicate = outbox("tokens", "create", "grafana", "--role", "operator", ok=False)
    assert duplicate.exit_code == 1 and "revoke it first" in duplicate.output
    outbox("tokens", "revoke", "grafana")
    assert as_json(outbox("tokens", "list", "--json")) == []
    assert len(as_json(outbox("tokens", "list", "--all", "--json"))) == 1
    actions = [e["action"] for e in as_json(outbox("audit", "--json"))]
    assert actions == ["token.revoke", "token.create"]


def test_durations() -> None:
    assert parse_duration("90").total_seconds() == 90
    assert parse_duration("15m").total_seconds() == 900
    assert parse_duration("1.5h").total_seconds() == 5400
    assert parse_duration("7d").days == 7


@pytest.mark.parametrize("interval", ["nan", "inf", "-1", "86401"])
def test_stats_refuses_an_interval_sleep_cannot_honour(outbox: Any, interval: str) -> None:
    refused = outbox("stats", "--watch", "--interval", interval, ok=False)
    assert refused.exit_code == 2
    assert "between 0 and 86400; try --interval 5" in refused.output
