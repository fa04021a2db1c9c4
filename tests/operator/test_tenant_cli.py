"""`outbox tenants ...` and the --tenant filters, through click's CliRunner on the real database."""

from __future__ import annotations

import json
from typing import Any

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.operator.cli import main
from delivery.receiver import Receiver
from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox, generate_key
from outbox.relay import Relay
from outbox.schema import LATENCY_BUCKETS
from outbox.stats import read_totals
from tests.helpers import rows, scalar
from tests.operator_helpers import deliver

KEY = generate_key("cli")


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


def one_line_error(result: Result, says: str) -> None:
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and says in lines[0], result.output


async def test_tenant_lifecycle_from_the_terminal(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, receiver: Receiver, outbox: Any
) -> None:
    made = as_json(outbox("tenants", "add", "seller-7", "--name", "Seven", "--metadata",
                          '{"plan": "pro"}', "--max-in-flight", "5", "--json"))  # fmt: skip
    assert made["id"] == "seller-7" and made["metadata"] == {"plan": "pro"}
    assert made["max_in_flight"] == 5 and made["max_per_second"] is None
    outbox("tenants", "add", "seller-8")
    listed = as_json(outbox("tenants", "list", "--json"))
    assert [t["id"] for t in listed["items"]] == ["default", "seller-7", "seller-8"]
    page = as_json(outbox("tenants", "list", "--limit", "1", "--after", "default", "--json"))
    assert [t["id"] for t in page["items"]] == ["seller-7"] and page["next_after"] == "seller-7"
    assert "seller-8" in outbox("tenants", "list").output

    updated = as_json(
        outbox("tenants", "update", "seller-7", "--max-in-flight", "0",
               "--max-per-second", "2.5", "--name", "Seven Ltd", "--json")
    )  # fmt: skip
    assert updated["max_in_flight"] is None and updated["max_per_second"] == 2.5
    assert updated["metadata"] == {"plan": "pro"}  # not given: unchanged
    one_line_error(outbox("tenants", "update", "seller-7", ok=False), "nothing to change")
    one_line_error(
        outbox("tenants", "update", "seller-7", "--max-per-second", "-1", ok=False), "positive"
    )

    # An endpoint of seller-7 gets a delivery; disabling the tenant keeps it (held, not dropped).
    key = SecretBox.from_setting(KEY)
    added = as_json(outbox("endpoints", "add", receiver.route("/7"), "--events", "*",
                           "--tenant", "seller-7", "--json"))  # fmt: skip
    assert added["tenant"] == "seller-7" and added["all_tenants"] is False
    with engine.begin() as conn:
        publish(conn, "order.created", {"n": 1}, tenant="seller-7")
    disabled = as_json(outbox("tenants", "disable", "seller-7", "--reason", "unpaid", "--json"))
    assert disabled["enabled"] is False and disabled["disabled_reason"] == "unpaid"
    await deliver(async_engine, key, clock)  # relayed, then held by the claim: not sent
    assert receiver.received("/7") == []
    shown = as_json(outbox("tenants", "show", "seller-7", "--json"))
    assert shown["deliveries"]["scheduled"] == 1 and shown["pending"] == 1
    # Two events: the one published, and the service's tenant.disabled report to seller-7.
    assert shown["endpoints"] == 1 and shown["events"] == 2
    assert "unpaid" in outbox("tenants", "show", "seller-7").output
    refused = outbox("tenants", "delete", "seller-7", "--reason", "churned", ok=False)
    one_line_error(refused, "1 pending deliveries")
    assert scalar(engine, "SELECT count(*) FROM deliveries") == 1

    assert as_json(outbox("tenants", "enable", "seller-7", "--json"))["enabled"] is True
    await deliver(async_engine, key, clock)
    assert len(receiver.received("/7")) == 1
    with engine.connect() as conn:
        before = read_totals(conn, LATENCY_BUCKETS)
    outbox("tokens", "create", "seven-portal", "--role", "viewer", "--tenant", "seller-7")
    deleted = as_json(outbox("tenants", "delete", "seller-7", "--reason", "churned", "--json"))
    assert deleted["deliveries"] == 1 and deleted["attempts"] == 1
    assert len(deleted["revoked_tokens"]) == 1
    assert scalar(engine, "SELECT count(*) FROM endpoints") == 0
    with engine.connect() as conn:
        after = read_totals(conn, LATENCY_BUCKETS)
    # Deleting history never makes a /metrics counter go backwards.
    # (Two: the published event and the service's tenant.disabled report.)
    assert after.events_published == before.events_published == 2
    assert after.attempts_by_outcome == before.attempts_by_outcome
    audit = rows(engine, "SELECT action, tenant_uid, reason FROM audit_log ORDER BY id")
    tenant_rows = [
        (a["action"], a["tenant_uid"]) for a in audit if a["action"].startswith("tenant")
    ]
    assert tenant_rows == [
        ("tenant.create", "seller-7"),
        ("tenant.create", "seller-8"),
        ("tenant.update", "seller-7"),
        ("tenant.disable", "seller-7"),
        ("tenant.enable", "seller-7"),
        ("tenant.delete", "seller-7"),
    ]
    assert audit[-1]["reason"] == "churned"
    one_line_error(outbox("tenants", "show", "seller-7", ok=False), "no tenant 'seller-7'")
    one_line_error(
        outbox("tenants", "delete", "default", "--reason", "x", ok=False), "cannot be deleted"
    )


@pytest.mark.parametrize(
    ("bad", "says"),
    [("", "empty"), ("x" * 256, "over the limit"), ("sel\tler", "control character")],
    ids=["empty", "too-long", "control-char"],
)
def test_bad_tenant_ids_are_one_line_errors_that_write_nothing(
    engine: Engine, outbox: Any, bad: str, says: str
) -> None:
    for args in (
        ("tenants", "add", bad),
        ("tokens", "create", "portal", "--role", "viewer", "--tenant", bad),
        ("endpoints", "add", "http://127.0.0.1:1/x", "--events", "*", "--tenant", bad),
        ("deliveries", "list", "--tenant", bad),
        ("stats", "--tenant", bad),
        ("audit", "--tenant", bad),
    ):
        one_line_error(outbox(*args, ok=False), says)
    assert scalar(engine, "SELECT count(*) FROM tenants") == 1
    assert scalar(engine, "SELECT count(*) FROM audit_log") == 0
    assert scalar(engine, "SELECT count(*) FROM admin_tokens") == 0
    assert scalar(engine, "SELECT count(*) FROM endpoints") == 0
    one_line_error(
        outbox("tokens", "create", "portal", "--role", "viewer", "--tenant", "nobody", ok=False),
        "no tenant 'nobody'",
    )
    one_line_error(outbox("tenants", "add", "x", "--metadata", "[1]", ok=False), "JSON object")


async def test_tenant_filters_on_endpoints_deliveries_replay_stats_and_audit(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, receiver: Receiver, outbox: Any
) -> None:
    outbox("tenants", "add", "seller-7")
    outbox("tenants", "add", "seller-8")
    gone = receiver.route("/gone", status=404)
    seven = as_json(outbox("endpoints", "add", gone, "--events", "*", "--tenant", "seller-7",
                           "--json"))["id"]  # fmt: skip
    eight = as_json(outbox("endpoints", "add", gone, "--events", "*", "--tenant", "seller-8",
                           "--json"))["id"]  # fmt: skip
    warehouse = as_json(outbox("endpoints", "add", receiver.route("/wh"), "--events", "*",
                               "--all-tenants", "--json"))  # fmt: skip
    assert warehouse["all_tenants"] is True and warehouse["tenant"] == "default"
    with engine.begin() as conn:
        for tenant in ("seller-7", "seller-8", "seller-8"):
            publish(conn, "order.created", {"for": tenant}, tenant=tenant)
    await deliver(async_engine, SecretBox.from_setting(KEY), clock)

    listed = as_json(outbox("endpoints", "list", "--tenant", "seller-7", "--json"))
    assert [e["id"] for e in listed] == [seven]
    text = outbox("endpoints", "list").output
    own, _, everyone = text.partition("receiving every tenant's events:")
    assert seven in own and eight in own and warehouse["id"] not in own
    assert warehouse["id"] in everyone

    found = as_json(outbox("deliveries", "list", "--tenant", "seller-8", "--json"))["items"]
    assert {d["tenant"] for d in found} == {"seller-8"} and len(found) == 2
    assert {d["endpoint"] for d in found} == {eight}
    assert "seller-8" in outbox("deliveries", "list", "--tenant", "seller-8").output
    shown = outbox("deliveries", "show", str(found[0]["id"])).output
    assert f"{eight} " in shown and "(tenant seller-8)" in shown

    dry = as_json(outbox("replay", "--tenant", "seller-7", "--reason", "r", "--dry-run", "--json"))
    assert dry["matched"] == 1
    done = as_json(outbox("replay", "--tenant", "seller-7", "--reason", "back", "--json"))
    [replayed] = done["replayed"]
    assert scalar(engine, "SELECT e.uid FROM deliveries d JOIN endpoints e ON e.id = d.endpoint_id "
                          "WHERE d.id = :id", id=replayed["replay"]) == seven  # fmt: skip

    stats = as_json(outbox("stats", "--tenant", "seller-8", "--json"))
    assert stats["tenant"] == "seller-8"
    assert stats["counts_by_state"]["dead"] == 2 and stats["counts_by_state"]["succeeded"] == 0
    assert [e["uid"] for e in stats["endpoints"]] == [eight]
    status = as_json(outbox("endpoints", "status", "--tenant", "seller-8", "--json"))
    assert [(e["uid"], e["tenant"], e["dead"]) for e in status] == [(eight, "seller-8", 2)]
    everything = as_json(outbox("stats", "--json"))
    assert everything["counts_by_state"]["succeeded"] == 3  # the warehouse's

    audit = as_json(outbox("audit", "--tenant", "seller-7", "--json"))
    assert {e["tenant"] for e in audit} == {"seller-7"}
    assert {e["action"] for e in audit} == {"tenant.create", "endpoint.create", "delivery.replay"}
    assert "seller-7" in outbox("audit", "--tenant", "seller-7").output
    one_line_error(outbox("stats", "--tenant", "nobody", ok=False), "no tenant 'nobody'")

    token = as_json(outbox("tokens", "create", "seven", "--role", "viewer", "--tenant",
                           "seller-7", "--json"))  # fmt: skip
    assert token["tenant"] == "seller-7"
    assert (
        "confined to tenant seller-7"
        in outbox(
            "tokens", "create", "seven-ops", "--role", "operator", "--tenant", "seller-7"
        ).output
    )
    assert [t["tenant"] for t in as_json(outbox("tokens", "list", "--json"))] == ["seller-7"] * 2


def test_token_names_are_unique_per_tenant_and_an_ambiguous_revoke_asks_for_the_id(
    engine: Engine, outbox: Any
) -> None:
    outbox("tenants", "add", "seller-7")
    outbox("tokens", "create", "ci", "--role", "viewer")
    scoped = as_json(outbox("tokens", "create", "ci", "--role", "viewer", "--tenant", "seller-7",
                            "--json"))  # fmt: skip
    one_line_error(
        outbox("tokens", "create", "ci", "--role", "viewer", "--tenant", "seller-7", ok=False),
        "exists",
    )
    one_line_error(outbox("tokens", "revoke", "ci", ok=False), "2 active tokens are named 'ci'")
    assert scalar(engine, "SELECT count(*) FROM admin_tokens WHERE revoked_at IS NULL") == 2
    outbox("tokens", "revoke", scoped["token_id"])
    outbox("tokens", "revoke", "ci")
    assert scalar(engine, "SELECT count(*) FROM admin_tokens WHERE revoked_at IS NULL") == 0


async def test_publish_with_a_tenant_reaches_that_tenants_endpoints_only(
    outbox: Any, engine: Engine, async_engine: AsyncEngine, clock: ManualClock
) -> None:
    outbox("tenants", "add", "acme")
    outbox("tenants", "add", "globex")

    def add(url: str, *tenant: str) -> str:
        return str(
            as_json(outbox("endpoints", "add", url, "--events", "*", *tenant, "--json"))["id"]
        )

    acme = add("https://acme.example/h", "--tenant", "acme")
    globex = add("https://globex.example/h", "--tenant", "globex")
    default = add("https://default.example/h")

    sent = as_json(outbox("publish", "order.created", '{"n": 1}', "--tenant", "acme", "--json"))
    assert sent["tenant"] == "acme"
    plain = as_json(outbox("publish", "order.created", '{"n": 2}', "--json"))
    assert plain["tenant"] == "default"
    await Relay(async_engine, clock).run_until_idle()
    reached = rows(
        engine,
        "SELECT ev.message_id, en.uid FROM deliveries d JOIN outbox_events ev ON ev.id = d.event_id"
        " JOIN endpoints en ON en.id = d.endpoint_id ORDER BY d.id",
    )
    assert {(r["message_id"], r["uid"]) for r in reached} == {
        (sent["message_id"], acme),
        (plain["message_id"], default),
    }
    assert globex not in {r["uid"] for r in reached}

    # The same idempotency key is one operation per tenant, not across tenants.
    first = outbox("publish", "a.b", "{}", "--tenant", "acme", "--idempotency-key", "k1").output
    other = outbox("publish", "a.b", "{}", "--tenant", "globex", "--idempotency-key", "k1").output
    assert first != other
    # An unknown or malformed tenant is one line saying what to do; nothing is published.
    before = scalar(engine, "SELECT count(*) FROM outbox_events")
    one_line_error(outbox("publish", "a.b", "{}", "--tenant", "nobody", ok=False), "tenants add")
    bad = outbox("publish", "a.b", "{}", "--tenant", "x" * 10_000, ok=False)
    assert bad.exit_code != 0 and "Traceback" not in bad.output
    assert len(bad.output) < 500, bad.output
    assert scalar(engine, "SELECT count(*) FROM outbox_events") == before
