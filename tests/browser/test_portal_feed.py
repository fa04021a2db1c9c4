"""The portal's endpoint forms set the delivery mode and payload filter, show the feed
token once, and make a new one; in a real Chromium against the served admin app."""

from __future__ import annotations

from typing import Any

import httpx
from standardwebhooks import Webhook

from outbox import publish
from tests.browser.site import Site
from tests.helpers import scalar


def _open_portal(site: Site, tenant: str) -> str:
    token = site.token("operator", f"issuer-{tenant}")
    with httpx.Client(base_url=site.base_url) as http:
        answer = http.post(
            f"/v1/tenants/{tenant}/portal-links",
            json={"ttl_seconds": 600},
            headers={"authorization": f"Bearer {token}"},
        )
    assert answer.status_code == 200, answer.text
    return str(answer.json()["link"])


def _feed(site: Site, uid: str, token: str) -> httpx.Response:
    with httpx.Client(base_url=site.base_url) as http:
        return http.get(f"/feed/v1/{uid}", headers={"authorization": f"Bearer {token}"})


def test_a_tenant_adds_a_filtered_pull_endpoint_and_reads_its_feed(site: Site, page: Any) -> None:
    site.tenant("acme")
    page.goto(site.base_url + _open_portal(site, "acme"))
    page.fill("#add-endpoint input[name=url]", "https://acme.example/hooks")
    page.fill("#add-endpoint input[name=patterns]", "order.*")
    page.select_option("#add-endpoint select[name=delivery_mode]", "pull")
    page.fill("#add-endpoint input[name=payload_filter]", "$.amount >= 100")
    page.select_option("#add-endpoint select[name=concurrency]", "fixed")  # opting out
    with page.expect_navigation():
        page.click("#add-endpoint button[type=submit]")
    token = page.inner_text("#feed-token")
    secret = page.inner_text("#secret")
    uid = str(scalar(site.engine, "SELECT uid FROM endpoints"))
    assert scalar(site.engine, "SELECT count(*) FROM endpoint_health WHERE adaptive") == 0
    assert token.startswith(f"obf_{uid}.")
    assert page.inner_text("#delivery-mode").startswith("pull")
    assert "$.amount >= 100" in page.inner_text("#payload-filter")

    with site.engine.begin() as conn:
        publish(conn, "order.created", {"amount": 150}, tenant="acme")
        publish(conn, "order.created", {"amount": 5}, tenant="acme")
    site.deliver()
    assert scalar(site.engine, "SELECT count(*) FROM deliveries") == 0  # pull: no POSTs
    items = _feed(site, uid, token).json()["items"]
    assert [Webhook(secret).verify(i["body"], i["headers"])["data"] for i in items] == [
        {"amount": 150}
    ]

    # A filter PostgreSQL cannot parse is refused with its reason; nothing changes.
    page.fill("#edit-endpoint input[name=payload_filter]", "$.amount >")
    with page.expect_navigation():
        page.click("button[value=edit]")
    assert "not a valid SQL/JSON path: syntax error" in page.inner_text("[role=alert]")
    page.problems.clear()  # the browser logs the 400 it was answered on purpose
    page.goto(f"{site.base_url}/portal/endpoints/{uid}")
    assert "$.amount >= 100" in page.inner_text("#payload-filter")

    # A new token: shown once, and the old one stops working at once.
    with page.expect_navigation():
        page.click("button[value=feed-token]")
    fresh = page.inner_text("#feed-token")
    assert fresh != token
    assert _feed(site, uid, token).status_code == 401
    assert _feed(site, uid, fresh).status_code == 200

    # Back to push and without a filter, from the edit form.
    page.select_option("#edit-endpoint select[name=delivery_mode]", "push")
    page.fill("#edit-endpoint input[name=payload_filter]", "")
    with page.expect_navigation():
        page.click("button[value=edit]")
    assert page.inner_text("#delivery-mode") == "push"
    assert page.inner_text("#payload-filter") == "none"
    assert _feed(site, uid, fresh).status_code == 404
