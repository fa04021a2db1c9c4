"""The tenant portal in a real Chromium, and the console confined to one tenant.

A tenant's people open a single-use link, manage their own endpoints, send a test event
through the real worker to a real receiver and watch it arrive; another tenant's ids
answer 404 exactly like ids that do not exist; every action is audited as
`portal:<tenant>`. A console session opened with a tenant-scoped token sees that tenant
only. Framing: the portal may be embedded by the configured origins only.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from sqlalchemy import Engine, text

from delivery.health import EndpointLimits, set_endpoint_limits
from delivery.operator.cli import main
from delivery.operator.console.config import ConsoleConfig
from delivery.receiver import Behaviour
from outbox import publish
from outbox.catalogue import add_event_type
from outbox.endpoints import set_enabled
from tests.browser.site import Site
from tests.helpers import add_endpoint, rows, scalar


def _link(site: Site, tenant: str, token: str | None = None) -> str:
    """A portal link issued through the admin API, as an operator would."""
    token = token or site.token("operator", f"issuer-{tenant}")
    with httpx.Client(base_url=site.base_url) as http:
        answer = http.post(
            f"/v1/tenants/{tenant}/portal-links",
            json={"ttl_seconds": 600},
            headers={"authorization": f"Bearer {token}"},
        )
    assert answer.status_code == 200, answer.text
    link = answer.json()["link"]
    assert link.startswith("/portal/enter?link=obxl_")
    return str(link)


def _listed_ids(page: Any) -> list[str]:
    return [str(t) for t in page.locator("#deliveries tbody td:first-child").all_inner_texts()]


def _other_tenant_delivery(site: Site) -> tuple[str, int]:
    """globex: an endpoint and a dead delivery that acme must never see."""
    site.tenant("globex")
    url = site.receiver.route("/globex", Behaviour(status=400))
    endpoint = add_endpoint(site.engine, site.box, url, "*", tenant="globex").endpoint.uid
    with site.engine.begin() as conn:
        publish(conn, "invoice.paid", {"secret_of": "globex"}, tenant="globex")
    site.deliver()
    delivery = int(scalar(site.engine, "SELECT max(id) FROM deliveries"))
    return endpoint, delivery


def test_a_tenant_adds_an_endpoint_sends_a_test_event_and_sees_it_arrive(
    site: Site, page: Any
) -> None:
    site.tenant("acme")
    globex_endpoint, globex_delivery = _other_tenant_delivery(site)
    with site.engine.begin() as conn:
        publish(conn, "order.created", {"n": 1}, tenant="acme")
    site.deliver()  # relayed now, while acme has no endpoint: it goes nowhere
    link = _link(site, "acme")

    # The link opens the portal and leaves the address bar.
    page.goto(site.base_url + link)
    assert page.url == f"{site.base_url}/portal/endpoints"
    assert "link=" not in page.url
    assert page.locator("#endpoints").inner_text().count("ep_") == 0  # globex's is not here
    # The event types on offer are the ones published for acme, not globex's.
    offered = page.locator("input[name=event_type]").evaluate_all("els => els.map(e => e.value)")
    assert offered == ["order.created"]

    url = site.receiver.route("/acme", Behaviour(status=204))
    page.fill("#add-endpoint input[name=url]", url)
    page.fill("#add-endpoint input[name=description]", "acme orders")
    page.check("#add-endpoint input[value='order.created']")
    with page.expect_navigation():
        page.click("#add-endpoint button[type=submit]")
    secret = page.inner_text("#secret")
    assert secret.startswith("whsec_")
    assert page.inner_text("#event-types") == "order.created"
    uid = page.inner_text("h1").split()[1]
    owner = scalar(
        site.engine,
        "SELECT t.uid FROM endpoints e JOIN tenants t ON t.id = e.tenant_id WHERE e.uid = :u",
        u=uid,
    )
    assert owner == "acme"
    # The form's default: adaptive concurrency, as for every new endpoint.
    adaptive = "SELECT h.adaptive FROM endpoint_health h JOIN endpoints e ON e.id = h.endpoint_id"
    assert scalar(site.engine, f"{adaptive} WHERE e.uid = :u", u=uid) is True

    with page.expect_navigation():
        page.click("button[value=test]")
    assert re.fullmatch(rf"{site.base_url}/portal/deliveries/\d+", page.url)
    assert page.inner_text("#state") == "scheduled"
    site.deliver()
    page.reload()
    assert page.inner_text("#state") == "succeeded"
    [ping] = site.receiver.received("/acme")
    assert json.loads(ping.body)["type"] == "webhook.test"
    assert ping.headers["webhook-id"] == page.inner_text("dl.facts dd")
    # The ping went to this endpoint only: globex's receiver saw only its own event.
    assert len(site.receiver.received("/globex")) == 1

    # Another tenant's delivery and endpoint answer 404, like ids that do not exist.
    for path in (
        f"/portal/deliveries/{globex_delivery}",
        f"/portal/endpoints/{globex_endpoint}",
        "/portal/deliveries/999999",
    ):
        answer = page.goto(site.base_url + path)
        assert answer is not None and answer.status == 404, path
        assert "globex" not in page.content()
    page.problems.clear()  # the browser logs each 404 it was sent to on purpose
    csrf = page.get_attribute("meta[name=csrf-token]", "content")
    for path in (
        f"/portal/deliveries/{globex_delivery}/replay",
        f"/portal/endpoints/{globex_endpoint}/reveal",
        f"/portal/endpoints/{globex_endpoint}/test",
    ):
        forged = page.request.post(site.base_url + path, form={"csrf": csrf, "reason": "x"})
        assert forged.status == 404, path
    page.goto(f"{site.base_url}/portal/deliveries")
    assert "webhook.test" in page.inner_text("#deliveries")
    assert str(globex_delivery) not in _listed_ids(page)
    assert scalar(site.engine, "SELECT count(*) FROM deliveries WHERE replay_of IS NOT NULL") == 0

    audit = rows(
        site.engine,
        "SELECT action, target_id FROM audit_log WHERE actor = 'portal:acme' ORDER BY id",
    )
    assert [(a["action"], a["target_id"]) for a in audit] == [
        ("endpoint.create", uid),
        ("endpoint.test", uid),
    ]

    # The link was single use: a second browser gets the expired page, no session.
    other = page.context.browser.new_context()
    try:
        second = other.new_page()
        answer = second.goto(site.base_url + link)
        assert answer is not None and answer.status == 401
        assert "already used or has expired" in second.inner_text("main")
        assert other.cookies() == []
    finally:
        other.close()
    assert page.problems == []


def test_a_tenant_edits_disables_rotates_replays_and_deletes(site: Site, page: Any) -> None:
    site.tenant("acme")
    failing = site.receiver.route("/acme", Behaviour(status=400))
    uid = add_endpoint(site.engine, site.box, failing, "order.*", tenant="acme").endpoint.uid
    with site.engine.begin() as conn:
        publish(conn, "order.created", {"n": 1}, tenant="acme")
        publish(conn, "refund.created", {"n": 2}, tenant="acme")
        # catalogued but never published yet: still a choice; archived: not one
        add_event_type(conn, "invoice.voided", schema={"type": "object"}, actor="t")
        add_event_type(conn, "invoice.legacy", schema={"type": "object"}, actor="t")
        conn.execute(
            text("UPDATE event_types SET status = 'archived' WHERE name = 'invoice.legacy'")
        )
    site.deliver()
    dead = int(scalar(site.engine, "SELECT id FROM deliveries WHERE state = 'dead'"))
    page.goto(site.base_url + _link(site, "acme"))

    page.goto(f"{site.base_url}/portal/endpoints/{uid}")
    with page.expect_navigation():
        page.click("button[value=reveal]")
    first = page.inner_text("#secret")
    with page.expect_navigation():
        page.click("button[value=rotate]")
    second = page.inner_text("#secret")
    assert first.startswith("whsec_") and second.startswith("whsec_") and first != second

    page.goto(f"{site.base_url}/portal/endpoints/{uid}")
    choices = page.eval_on_selector_all(
        "#edit-endpoint input[name=event_type]", "inputs => inputs.map(i => i.value)"
    )
    assert {"order.created", "refund.created", "invoice.voided"} <= set(choices)
    assert "invoice.legacy" not in choices and "webhook.test" not in choices
    page.check("#edit-endpoint input[value='refund.created']")
    with page.expect_navigation():
        page.click("button[value=edit]")
    assert page.inner_text("#event-types") == "refund.created, order.*"

    page.fill("#endpoint-actions input[name=reason]", "maintenance")
    with page.expect_navigation():
        page.click("button[value=disable]")
    assert page.inner_text("#enabled") == "disabled"
    # A disabled endpoint takes no test (it would wait forever): one clear line instead.
    with page.expect_navigation():
        page.click("button[value=test]")
    assert f"endpoint {uid} is disabled (maintenance): enable it, then send the test" in (
        page.inner_text("[role=alert]")
    )
    page.problems.clear()  # the browser logs the 400 it was answered on purpose
    page.goto(f"{site.base_url}/portal/endpoints/{uid}")
    with page.expect_navigation():
        page.click("button[value=enable]")
    assert page.inner_text("#enabled") == "enabled"

    # Replay the dead delivery after fixing the receiver, and watch it succeed.
    site.receiver.route("/acme", Behaviour(status=200))
    page.goto(f"{site.base_url}/portal/deliveries/{dead}")
    page.fill(".actions input[name=reason]", "fixed our validation")
    with page.expect_navigation():
        page.click("button[value=replay]")
    site.deliver()
    page.reload()
    assert page.inner_text("#state") == "succeeded"
    assert page.locator("button[value=discard]").count() == 0  # discarding is the operator's

    page.goto(f"{site.base_url}/portal/endpoints/{uid}")
    page.fill("#edit-endpoint input[name=reason]", "moving to a new URL")
    with page.expect_navigation():
        page.click("button[value=delete]")
    assert page.url == f"{site.base_url}/portal/endpoints"
    assert scalar(site.engine, "SELECT count(*) FROM endpoints") == 0

    # Signing out ends the session on the server, not only in this browser.
    csrf = page.get_attribute("meta[name=csrf-token]", "content")
    with page.expect_navigation():
        page.click("header button[type=submit]")
    assert "Signed out" in page.inner_text("main")
    assert scalar(site.engine, "SELECT count(*) FROM console_sessions WHERE kind = 'portal'") == 0
    assert page.request.post(f"{site.base_url}/portal/logout", form={"csrf": csrf}).status == 401

    actions = [
        r["action"]
        for r in rows(site.engine, "SELECT action FROM audit_log WHERE actor = 'portal:acme'")
    ]
    assert actions == [
        "endpoint.reveal_secret",
        "endpoint.rotate_secret",
        "endpoint.update",
        "endpoint.disable",
        "endpoint.enable",
        "delivery.replay",
        "endpoint.delete",
    ]
    assert page.problems == []


def test_a_tenant_scoped_console_session_sees_only_its_tenant(site: Site, page: Any) -> None:
    site.tenant("acme")
    globex_endpoint, globex_delivery = _other_tenant_delivery(site)
    url = site.receiver.route("/acme", Behaviour(status=200))
    acme_endpoint = add_endpoint(site.engine, site.box, url, "*", tenant="acme").endpoint.uid
    with site.engine.begin() as conn:
        for n in range(3):
            publish(conn, "order.created", {"n": n}, tenant="acme")
    site.deliver()

    page.goto(f"{site.base_url}/console/login")
    page.fill("input[name=token]", site.token("operator", "acme-ops", tenant="acme"))
    with page.expect_navigation():
        page.click("button[type=submit]")
    assert "tenant acme" in page.inner_text("header")
    assert page.inner_text("[data-state=succeeded]") == "3"
    assert page.inner_text("[data-state=dead]") == "0"  # globex's dead one is not counted
    charts = page.request.get(f"{site.base_url}/console/charts.json?range=hour").json()
    # Buckets without attempts are gaps (None), not zeros.
    assert sum(n for n in charts["succeeded"] if n is not None) == 3
    assert sum(n for n in charts["failed"] if n is not None) == 0

    page.goto(f"{site.base_url}/console/deliveries")
    listed = page.inner_text("#deliveries")
    assert listed.count("order.created") == 3 and "invoice.paid" not in listed
    # The tenant filter cannot widen a scoped session.
    page.goto(f"{site.base_url}/console/deliveries?tenant=globex")
    assert "invoice.paid" not in page.inner_text("#deliveries")
    for path in (f"/console/deliveries/{globex_delivery}", f"/console/endpoints/{globex_endpoint}"):
        answer = page.goto(site.base_url + path)
        assert answer is not None and answer.status == 404, path
    page.problems.clear()  # the browser logs each 404 it was sent to on purpose
    page.goto(f"{site.base_url}/console/endpoints")
    assert acme_endpoint in page.inner_text("#endpoints")
    assert globex_endpoint not in page.inner_text("#endpoints")
    page.goto(f"{site.base_url}/console/tenants")
    assert "globex" not in page.inner_text("#tenants")
    with site.engine.begin() as conn:  # one audit row about each tenant's endpoint
        for uid in (acme_endpoint, globex_endpoint):
            set_enabled(conn, uid, enabled=False, reason=f"pause {uid}", actor="ops")
    page.goto(f"{site.base_url}/console/audit")
    audit = page.inner_text("#audit")
    assert f"pause {acme_endpoint}" in audit and globex_endpoint not in audit
    # A bulk replay from a scoped session stays in its tenant, whatever the form says.
    csrf = page.get_attribute("meta[name=csrf-token]", "content")
    widened = page.request.post(
        f"{site.base_url}/console/replays",
        form={"csrf": csrf, "state": "dead", "tenant": "globex", "reason": "x", "confirm": "yes"},
    )
    assert widened.status == 200 and "Replayed 0 of 0" in widened.text()
    assert scalar(site.engine, "SELECT count(*) FROM deliveries WHERE replay_of IS NOT NULL") == 0
    assert page.problems == []

    # An unscoped operator sees both, and can filter on one tenant or one message id.
    page.context.clear_cookies()
    page.goto(f"{site.base_url}/console/login")
    page.fill("input[name=token]", site.token("operator", "everyone"))
    with page.expect_navigation():
        page.click("button[type=submit]")
    page.goto(f"{site.base_url}/console/deliveries?tenant=globex")
    listed = page.inner_text("#deliveries")
    assert "invoice.paid" in listed and "order.created" not in listed
    message = str(
        scalar(
            site.engine,
            "SELECT ev.message_id FROM deliveries d JOIN outbox_events ev ON ev.id = d.event_id "
            "WHERE d.id = :id",
            id=globex_delivery,
        )
    )
    page.goto(f"{site.base_url}/console/deliveries?message_id={message}")
    assert page.locator("#deliveries tbody tr").count() == 1
    assert message in page.inner_text("#deliveries")
    # Bulk replay of what the tenant filter shows: a dry run first, then globex's only.
    page.goto(f"{site.base_url}/console/deliveries?state=dead&tenant=globex")
    page.fill("form[action='/console/replays'] input[name=reason]", "globex fixed it")
    with page.expect_navigation():
        page.click("form[action='/console/replays'] button[type=submit]")
    assert "Dry run: 1 delivery matches" in page.inner_text("#bulk-preview")
    with page.expect_navigation():
        page.click("form[action='/console/replays'] button[type=submit]")
    assert "Replayed 1 of 1" in page.inner_text("#bulk-result")
    replayed = rows(site.engine, "SELECT replay_of FROM deliveries WHERE replay_of IS NOT NULL")
    assert [r["replay_of"] for r in replayed] == [globex_delivery]


def test_the_console_endpoint_page_shows_limits_charts_and_acts(site: Site, page: Any) -> None:
    url = site.receiver.route("/ok", Behaviour(status=200))
    uid = add_endpoint(site.engine, site.box, url, "order.*").endpoint.uid
    with site.engine.begin() as conn:
        publish(conn, "order.created", {"n": 1})
    site.deliver()
    page.goto(f"{site.base_url}/console/login")
    page.fill("input[name=token]", site.token("operator", "olga"))
    with page.expect_navigation():
        page.click("button[type=submit]")
    page.goto(f"{site.base_url}/console/endpoints")
    with page.expect_navigation():
        page.click(f"#endpoints a:text-is('{uid}')")
    assert "Max attempts" in page.inner_text("#limits")
    # The last hour and the last day, attempts and latency each.
    page.locator("[data-chart][data-rendered=true]").nth(3).wait_for()
    assert page.locator("[data-chart] canvas").count() == 4
    page.fill("#endpoint-actions input[name=reason]", "partner maintenance")
    with page.expect_navigation():
        page.click("button[value=disable]")
    assert page.inner_text("#enabled") == "disabled"
    with page.expect_navigation():
        page.click("button[value=rotate]")
    assert page.inner_text("#secret").startswith("whsec_")
    audit = rows(site.engine, "SELECT actor, action FROM audit_log WHERE target_id = :u", u=uid)
    assert [(a["actor"], a["action"]) for a in audit] == [
        ("token:olga", "endpoint.disable"),
        ("token:olga", "endpoint.rotate_secret"),
    ]
    assert page.problems == []


def test_the_console_endpoint_page_says_which_in_flight_limit_holds(site: Site, page: Any) -> None:
    # a new endpoint's default: adaptive, held to OUTBOX_ADAPTIVE_DEFAULT_MAX, not unlimited
    adaptive = add_endpoint(
        site.engine, site.box, "https://d.example/hook", concurrency="adaptive"
    ).endpoint.uid
    adaptive_capped = add_endpoint(site.engine, site.box, "https://a.example/hook").endpoint.uid
    fixed = add_endpoint(site.engine, site.box, "https://f.example/hook").endpoint.uid
    unlimited = add_endpoint(site.engine, site.box, "https://u.example/hook").endpoint.uid
    with site.engine.begin() as conn:
        set_endpoint_limits(
            conn, adaptive_capped, EndpointLimits(max_in_flight=16, adaptive=True), actor="t"
        )
        set_endpoint_limits(conn, fixed, EndpointLimits(max_in_flight=7), actor="t")
        set_endpoint_limits(conn, unlimited, EndpointLimits(), actor="t")
    page.goto(f"{site.base_url}/console/login")
    page.fill("input[name=token]", site.token("operator", "olga"))
    with page.expect_navigation():
        page.click("button[type=submit]")
    shown = {}
    for uid in (adaptive, adaptive_capped, fixed, unlimited):
        page.goto(f"{site.base_url}/console/endpoints/{uid}")
        text_of = page.inner_text("#limits")
        shown[uid] = re.search(r"Max in flight\s*(.*)", text_of).group(1).strip()  # type: ignore[union-attr]
    assert shown == {
        adaptive: "adaptive, up to 100 (default)",
        adaptive_capped: "adaptive, up to 16",
        fixed: "7",
        unlimited: "unlimited",
    }
    assert page.problems == []


def test_an_operator_issues_a_portal_link_from_the_tenants_page(site: Site, page: Any) -> None:
    site.tenant("acme")
    page.goto(f"{site.base_url}/console/login")
    page.fill("input[name=token]", site.token("operator", "olga"))
    with page.expect_navigation():
        page.click("button[type=submit]")
    page.goto(f"{site.base_url}/console/tenants")
    with page.expect_navigation():
        page.click("#tenants tr:has-text('acme') button[value=portal-link]")
    link = page.inner_text("#portal-link")
    assert link.startswith(f"{site.base_url}/portal/enter?link=obxl_")
    other = page.context.browser.new_context()
    try:
        tenant_page = other.new_page()
        tenant_page.goto(link)
        assert tenant_page.url == f"{site.base_url}/portal/endpoints"
        header = tenant_page.inner_text("header")  # the tenant's name, no internal label
        assert "Acme" in header and "portal:acme" not in header
    finally:
        other.close()
    audit = rows(site.engine, "SELECT actor, target_id FROM audit_log WHERE action = 'portal.link'")
    assert [(a["actor"], a["target_id"]) for a in audit] == [("token:olga", "acme")]
    assert page.problems == []


@pytest.mark.parametrize(
    "console_config",
    [
        ConsoleConfig(),
        ConsoleConfig(frame_origins=("https://app.example", "http://localhost:3000")),
    ],
    ids=["no-origins", "two-origins"],
)
def test_framing_headers_follow_the_configured_origins(
    site: Site, console_config: ConsoleConfig
) -> None:
    site.tenant("acme")
    with httpx.Client(base_url=site.base_url) as http:
        entered = http.get(_link(site, "acme"))
        assert entered.status_code == 303 and entered.headers["location"] == "/portal/"
        portal = http.get("/portal/endpoints")
        assert portal.status_code == 200
        console = http.get("/console/login")
    for answer in (entered, portal):
        policy = answer.headers["content-security-policy"]
        if console_config.frame_origins:
            assert "frame-ancestors https://app.example http://localhost:3000" in policy
            assert "x-frame-options" not in answer.headers
        else:
            assert "frame-ancestors 'none'" in policy
            assert answer.headers["x-frame-options"] == "DENY"
    # The operator console is never framed, whatever the portal allows.
    assert "frame-ancestors 'none'" in console.headers["content-security-policy"]
    assert console.headers["x-frame-options"] == "DENY"


def test_portal_links_from_the_cli_and_their_refusals(
    site: Site, database_url: str, engine: Engine
) -> None:
    site.tenant("acme")
    runner = CliRunner()
    env = {"OUTBOX_DATABASE_URL": database_url, "USER": "night"}
    # Without OUTBOX_PUBLIC_URL: a full URL on the address `outbox serve` listens on.
    local = {**env, "OUTBOX_ADMIN_HOST": "127.0.0.1", "OUTBOX_ADMIN_PORT": "8080"}
    done = runner.invoke(main, ["portal", "link", "acme", "--ttl", "5m", "--json"], env=local)
    assert done.exit_code == 0, done.output
    link = json.loads(done.output)["link"]
    assert link.startswith("http://127.0.0.1:8080/portal/enter?link=obxl_")
    full = runner.invoke(
        main,
        ["portal", "link", "acme"],
        env={**env, "OUTBOX_PUBLIC_URL": "https://hooks.example.com/"},
    )
    assert full.exit_code == 0, full.output
    assert full.stdout.startswith("https://hooks.example.com/portal/enter?link=obxl_")
    unknown = runner.invoke(main, ["portal", "link", "nobody"], env=env)
    assert unknown.exit_code == 1 and "no enabled tenant 'nobody'" in unknown.output
    too_long = runner.invoke(main, ["portal", "link", "acme", "--ttl", "30d"], env=env)
    assert too_long.exit_code == 1 and "at most 7 days" in too_long.output
    audit = rows(engine, "SELECT actor, action, target_id FROM audit_log ORDER BY id")
    assert [(a["actor"], a["action"], a["target_id"]) for a in audit] == [
        ("cli:night", "portal.link", "acme"),
        ("cli:night", "portal.link", "acme"),
    ]
    assert scalar(engine, "SELECT count(*) FROM portal_links") == 2

    # The API: a viewer cannot issue links; a token scoped to another tenant gets 404.
    site.tenant("globex")
    with httpx.Client(base_url=site.base_url) as http:

        def ask(token: str, tenant: str = "acme") -> httpx.Response:
            return http.post(
                f"/v1/tenants/{tenant}/portal-links",
                json={},
                headers={"authorization": f"Bearer {token}"},
            )

        assert ask(site.token("viewer", "v")).status_code == 403
        assert ask(site.token("operator", "g", tenant="globex")).status_code == 404
        assert ask(site.token("operator", "a", tenant="acme")).status_code == 200
        assert ask(site.token("operator", "o"), "nobody").status_code == 404
        bad = http.post(
            "/v1/tenants/acme/portal-links",
            json={"ttl_seconds": "soon"},
            headers={"authorization": f"Bearer {site.token('operator', 'p')}"},
        )
        assert bad.status_code == 400 and "ttl_seconds" in bad.json()["error"]
    assert scalar(engine, "SELECT count(*) FROM portal_links") == 3
