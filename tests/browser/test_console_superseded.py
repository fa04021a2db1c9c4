"""The console and the tenant-scoped console in a real Chromium: the subject filter, the
warning shown before replaying a delivery a newer event superseded, the "replay anyway"
checkbox, the bulk replay preview's count; another tenant's subject stays invisible."""

from __future__ import annotations

from typing import Any

import httpx

from delivery.receiver import Behaviour
from outbox import publish
from tests.browser.site import Site, sign_in
from tests.helpers import add_endpoint, rows, scalar


def _superseded(site: Site, tenant: str = "default") -> tuple[int, str]:
    """A dead order.updated for order/1, then a newer one delivered: (dead id, newer id)."""
    url = site.receiver.route(f"/{tenant}", Behaviour(status=400, body=b"bad order"))
    add_endpoint(site.engine, site.box, url, "order.*", tenant=tenant)
    with site.engine.begin() as conn:
        publish(conn, "order.updated", {"v": 1}, subject="order/1", tenant=tenant)
    site.deliver()
    site.receiver.route(f"/{tenant}", Behaviour(status=204))
    with site.engine.begin() as conn:
        newer = publish(conn, "order.updated", {"v": 2}, subject="order/1", tenant=tenant)
        publish(conn, "order.updated", {"v": 3}, subject="order/2", tenant=tenant)
    site.deliver()
    dead = scalar(
        site.engine,
        "SELECT min(d.id) FROM deliveries d JOIN tenants t ON t.id = d.tenant_id"
        " WHERE d.state = 'dead' AND t.uid = :tenant",
        tenant=tenant,
    )
    return int(dead), newer


def test_the_delivery_page_warns_before_replaying_a_superseded_event(site: Site, page: Any) -> None:
    dead, newer = _superseded(site)
    sign_in(page, site, site.token("operator", "alice"))

    page.goto(f"{site.base_url}/console/deliveries?subject=order/1")
    listed = page.inner_text("#deliveries")
    assert listed.count("order/1") == 2 and "order/2" not in listed

    page.goto(f"{site.base_url}/console/deliveries/{dead}")
    warning = page.inner_text("#superseded-warning")
    assert newer in warning and "older state" in warning
    page.fill(".actions input[name=reason]", "partner fixed it")
    with page.expect_navigation():
        page.click("button[value=replay]")
    assert "superseded" in page.inner_text("main") and newer in page.inner_text("main")
    assert scalar(site.engine, "SELECT count(*) FROM deliveries WHERE replay_of IS NOT NULL") == 0
    page.problems.clear()  # the refusal is an error page on purpose

    page.goto(f"{site.base_url}/console/deliveries/{dead}")
    page.fill(".actions input[name=reason]", "partner fixed it")
    page.check(".actions input[name=force]")
    with page.expect_navigation():
        page.click("button[value=replay]")
    assert page.inner_text("#state") == "scheduled"
    [audit] = rows(site.engine, "SELECT details FROM audit_log WHERE action = 'delivery.replay'")
    assert audit["details"]["forced"] is True
    assert page.problems == []


def test_the_bulk_preview_counts_the_superseded(site: Site, page: Any) -> None:
    _superseded(site)
    sign_in(page, site, site.token("operator", "alice"))
    page.goto(f"{site.base_url}/console/deliveries?state=dead&subject=order/1")
    page.fill("input[name=reason]", "retry")
    with page.expect_navigation():
        page.click("text=Preview bulk replay")
    assert "1 of them would be left out" in page.inner_text("#bulk-superseded")
    with page.expect_navigation():
        page.click("button:has-text('Replay 1 delivery')")
    assert "Replayed 0 of 1" in page.inner_text("#bulk-result")
    assert page.problems == []


def test_a_scoped_session_filters_its_own_subjects_only(site: Site, page: Any) -> None:
    site.tenant("acme")
    site.tenant("globex")
    _superseded(site, "acme")
    globex_dead, _ = _superseded(site, "globex")
    sign_in(page, site, site.token("operator", "acme-ops", tenant="acme"))
    page.goto(f"{site.base_url}/console/deliveries?subject=order/1")
    listed = page.inner_text("#deliveries")
    assert listed.count("order/1") == 2  # acme's two, not globex's
    answer = page.goto(f"{site.base_url}/console/deliveries/{globex_dead}")
    assert answer is not None and answer.status == 404
    hostile = page.goto(f"{site.base_url}/console/deliveries?subject=" + "x" * 300)
    assert hostile is not None and hostile.status == 400
    assert "at most 255 characters" in page.inner_text("main")
    control = page.goto(f"{site.base_url}/console/deliveries?subject=a%00b")
    assert control is not None and control.status == 400
    page.problems.clear()


def test_the_portal_filters_a_tenants_deliveries_by_subject(site: Site, page: Any) -> None:
    site.tenant("acme")
    site.tenant("globex")
    acme_dead, newer = _superseded(site, "acme")
    globex_dead, _ = _superseded(site, "globex")
    with httpx.Client(base_url=site.base_url) as http:
        answer = http.post(
            "/v1/tenants/acme/portal-links",
            json={"ttl_seconds": 600},
            headers={"authorization": f"Bearer {site.token('operator', 'issuer')}"},
        )
    page.goto(site.base_url + answer.json()["link"])
    page.goto(f"{site.base_url}/portal/deliveries?subject=order/1")
    ids = page.locator("#deliveries tbody td:first-child").all_inner_texts()
    assert str(acme_dead) in ids and str(globex_dead) not in ids
    assert len(ids) == 2 and "order/2" not in page.inner_text("#deliveries")
    page.goto(f"{site.base_url}/portal/deliveries/{acme_dead}")
    assert newer in page.inner_text("#superseded-warning")
    answer_other = page.goto(f"{site.base_url}/portal/deliveries/{globex_dead}")
    assert answer_other is not None and answer_other.status == 404
    page.problems.clear()
