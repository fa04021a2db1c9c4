"""The operator console in a real Chromium: find a dead delivery, read its attempts, replay
it with a reason and watch it succeed; viewers cannot act; CSP and CSRF hold."""

from __future__ import annotations

from typing import Any

import httpx
from sqlalchemy import Engine

from delivery.receiver import Behaviour
from outbox import publish
from outbox.catalogue import add_event_type
from outbox.relay import Relay
from outbox.workflows import set_workflow
from tests.browser.site import Site, sign_in
from tests.helpers import add_endpoint, rows, scalar


def _dead_delivery(site: Site, payload: dict[str, Any] | None = None) -> int:
    url = site.receiver.route("/hook", Behaviour(status=400, body=b"bad order"))
    add_endpoint(site.engine, site.box, url, "order.*")
    with site.engine.begin() as conn:
        publish(conn, "order.created", payload or {"order_id": 42})
    site.deliver()
    return int(scalar(site.engine, "SELECT id FROM deliveries WHERE state = 'dead'"))


def test_operator_finds_a_dead_delivery_reads_attempts_replays_and_sees_success(
    site: Site, page: Any
) -> None:
    dead = _dead_delivery(site)
    sign_in(page, site, site.token("operator", "alice"))

    page.goto(f"{site.base_url}/console/deliveries?state=dead")
    with page.expect_navigation():
        page.click(f"#deliveries a:text-is('{dead}')")
    assert page.url == f"{site.base_url}/console/deliveries/{dead}"
    assert page.inner_text("#state") == "dead"
    attempt = page.inner_text("#attempts")
    assert "permanent" in attempt and "status 400" in attempt

    site.receiver.route("/hook", Behaviour(status=204))
    page.fill(".actions input[name=reason]", "partner fixed their validation")
    with page.expect_navigation():
        page.click("button[value=replay]")
    assert "/replay" not in page.url, page.inner_text("main")
    replay_id = int(page.url.rsplit("/", 1)[1])
    assert replay_id != dead
    assert page.inner_text("#state") == "scheduled"

    site.deliver()
    page.reload()
    assert page.inner_text("#state") == "succeeded"
    # The dead one is unchanged; the replay is recorded with who and why.
    assert (
        rows(site.engine, "SELECT state FROM deliveries WHERE id = :id", id=dead)[0]["state"]
        == "dead"
    )
    audit = rows(
        site.engine, "SELECT actor, reason FROM audit_log WHERE action = 'delivery.replay'"
    )
    assert [(a["actor"], a["reason"]) for a in audit] == [
        ("token:alice", "partner fixed their validation")
    ]
    assert page.problems == []


def test_a_viewer_sees_no_action_and_forged_posts_are_refused(site: Site, page: Any) -> None:
    dead = _dead_delivery(site)
    sign_in(page, site, site.token("viewer", "victor"))
    page.goto(f"{site.base_url}/console/deliveries/{dead}")
    assert page.inner_text("#state") == "dead"
    assert page.locator("button[value=replay]").count() == 0
    assert page.locator("button[value=discard]").count() == 0
    csrf = page.get_attribute("meta[name=csrf-token]", "content")

    # The viewer's own session, with its valid CSRF token: refused by role.
    answer = page.request.post(
        f"{site.base_url}/console/deliveries/{dead}/replay",
        form={"csrf": csrf, "reason": "sneaky"},
    )
    assert answer.status == 403

    # An operator's session without the CSRF token (a forged cross-site form): refused.
    page.context.clear_cookies()
    sign_in(page, site, site.token("operator", "olga"))
    forged = page.request.post(
        f"{site.base_url}/console/deliveries/{dead}/replay", form={"reason": "forged"}
    )
    assert forged.status == 403
    wrong = page.request.post(
        f"{site.base_url}/console/deliveries/{dead}/replay",
        form={"reason": "forged", "csrf": "x" * 32},
    )
    assert wrong.status == 403
    assert scalar(site.engine, "SELECT count(*) FROM deliveries WHERE replay_of IS NOT NULL") == 0


def test_pages_escape_values_and_send_a_strict_policy(site: Site, page: Any) -> None:
    dead = _dead_delivery(site, {"note": "<script>window.hacked=1</script><img src=x>"})
    sign_in(page, site, site.token("operator", "alice"))
    dialogs: list[str] = []
    page.on("dialog", lambda d: dialogs.append(d.message))
    response = page.goto(f"{site.base_url}/console/deliveries/{dead}")
    assert response is not None
    policy = response.headers["content-security-policy"]
    assert "script-src 'self';" in policy and "unsafe-inline" not in policy
    assert "frame-ancestors 'none'" in policy
    assert response.headers["x-frame-options"] == "DENY"
    assert "<script>window.hacked=1</script>" in page.inner_text("pre.payload")
    assert page.evaluate("window.hacked") is None
    assert page.locator("main img").count() == 0
    assert dialogs == []
    # Pages carry no token in their URLs, and a page without a session goes to sign-in.
    page.context.clear_cookies()
    page.goto(f"{site.base_url}/console/deliveries/{dead}")
    assert page.url == f"{site.base_url}/console/login"
    assert page.problems == []


def test_the_overview_charts_render_with_data(site: Site, page: Any) -> None:
    _dead_delivery(site)
    url = site.receiver.route("/ok", Behaviour(status=200))
    add_endpoint(site.engine, site.box, url, "invoice.*")
    with site.engine.begin() as conn:
        for n in range(5):
            publish(conn, "invoice.paid", {"n": n})
    site.deliver()
    sign_in(page, site, site.token("viewer", "victor"))
    # Each chart fetches its data on its own: wait for the fourth, not just the first.
    page.locator("[data-chart][data-rendered=true]").nth(3).wait_for()
    charts = page.locator("[data-chart][data-rendered=true]")
    assert charts.count() == 4
    assert page.locator("[data-chart] canvas").count() == 4
    assert int(page.get_attribute("[data-chart]", "data-points") or 0) >= 1
    assert page.inner_text("[data-state=dead]") == "1"
    assert page.inner_text("[data-state=succeeded]") == "5"
    assert page.problems == []


def test_login_is_rate_limited_and_a_bad_token_is_refused(site: Site) -> None:
    with httpx.Client(base_url=site.base_url) as http:
        codes = [
            http.post("/console/login", data={"token": "obx_nope_nope"}).status_code
            for _ in range(12)
        ]
    assert codes[:10] == [401] * 10
    assert codes[10:] == [429, 429]


def test_unscoped_pages_need_a_session(site: Site, engine: Engine) -> None:
    with httpx.Client(base_url=site.base_url) as http:
        for path in ("/console/", "/console/deliveries", "/console/audit", "/console/charts.json"):
            answer = http.get(path)
            assert answer.status_code == 303, path
            assert answer.headers["location"] == "/console/login"


def test_the_overview_shows_which_workflow_is_late_and_whose_it_is(site: Site, page: Any) -> None:
    """Two event types with their own oldest-due thresholds (5 and 10 minutes) wait six
    minutes: the overview marks the first late and names its owner, the second is ok."""
    add_endpoint(site.engine, site.box, site.receiver.route("/hook"), "*")
    with site.engine.begin() as conn:
        workflows = (("invoice.paid", "billing", 300), ("order.created", None, 600))
        for name, owner, seconds in workflows:
            add_event_type(conn, name, schema={}, actor="t")
            set_workflow(conn, name, actor="t", owner=owner, alert_oldest_seconds=seconds)
            publish(conn, name, {"n": 1})
    site.loop.run(Relay(site.async_engine, site.clock).run_until_idle())  # due; no worker
    site.clock.advance(360)
    sign_in(page, site, site.token("viewer", "val"))
    late = page.inner_text("#workflows tr[data-event-type='invoice.paid']")
    assert "billing" in late and "LATE: oldest" in late, late
    fine = page.inner_text("#workflows tr[data-event-type='order.created']")
    assert "LATE" not in fine and "ok" in fine, fine
    assert "invoice.paid (owner billing): the oldest due delivery has waited 360s" in (
        page.inner_text("#overview-panel")
    )
