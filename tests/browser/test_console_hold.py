"""Held deliveries in the console, in a real Chromium: the three actions from the delivery
page (confirm delivered, send again, discard), the owner overview, and scoping."""

from __future__ import annotations

from typing import Any

from delivery.http import build_http_client
from delivery.receiver import Behaviour
from delivery.worker import Worker, WorkerConfig
from outbox import publish
from outbox.endpoints import set_failure_policy
from outbox.relay import Relay
from tests.browser.site import Site, sign_in
from tests.helpers import LOOPBACK, add_endpoint, rows, scalar


def _run(site: Site) -> None:
    """Relay, then worker passes with a short deadline (the silent receiver never answers)."""

    async def work() -> None:
        await Relay(site.async_engine, site.clock).run_until_idle()
        config = WorkerConfig(request_timeout=0.3, lease_seconds=30)
        async with build_http_client(
            max_connections=10, timeout=5, allowed_networks=LOOPBACK
        ) as http:
            worker = Worker(site.async_engine, http, site.box, site.clock, config)
            while (await worker.run_once()).claimed:
                pass

    site.loop.run(work())


def _held(site: Site, count: int, tenant: str | None = None) -> list[int]:
    url = site.receiver.route("/silent", Behaviour(delay=30))
    scope = {"tenant": tenant} if tenant else {}
    uid = add_endpoint(site.engine, site.box, url, "invoice.*", **scope).endpoint.uid
    with site.engine.begin() as conn:
        set_failure_policy(conn, uid, actor="t", on_ambiguous="hold", owner="payments")
        for n in range(count):
            publish(conn, "invoice.paid", {"n": n}, **scope)
    _run(site)
    held = rows(site.engine, "SELECT id FROM deliveries WHERE state = 'held' ORDER BY id")
    assert len(held) == count
    return [int(r["id"]) for r in held]


def _act(page: Any, site: Site, delivery_id: int, action: str, reason: str) -> None:
    page.goto(f"{site.base_url}/console/deliveries/{delivery_id}")
    assert page.inner_text("#state") == "held"
    assert "may have arrived" in page.inner_text("#held-notice")
    form = page.locator(f"form:has(button[value={action}])")
    form.locator("input[name=reason]").fill(reason)
    with page.expect_navigation():
        form.locator(f"button[value={action}]").click()
    assert page.url == f"{site.base_url}/console/deliveries/{delivery_id}", page.inner_text("main")


def test_each_held_action_works_from_the_delivery_page(site: Site, page: Any) -> None:
    confirm, retry, discard = _held(site, 3)
    sign_in(page, site, site.token("operator", "alice"))

    # The overview groups what needs attention by owner, with a link to the list.
    page.goto(f"{site.base_url}/console/")
    assert page.inner_text("#owners tr[data-owner=payments]").split() == ["payments", "3", "0"]
    with page.expect_navigation():
        page.click("#owners tr[data-owner=payments] a >> nth=0")
    listed = page.inner_text("#deliveries")
    assert all(str(i) in listed for i in (confirm, retry, discard))

    _act(page, site, confirm, "confirm", "partner's log shows it")
    assert page.inner_text("#state") == "succeeded"
    _act(page, site, discard, "discard", "order cancelled")
    assert page.inner_text("#state") == "discarded"
    site.receiver.route("/silent", Behaviour(status=204))
    _act(page, site, retry, "retry", "receiver dedupes on webhook-id")
    assert page.inner_text("#state") == "scheduled"
    _run(site)
    page.reload()
    assert page.inner_text("#state") == "succeeded"

    audit = rows(
        site.engine,
        "SELECT actor, action, reason, target_id FROM audit_log"
        " WHERE action LIKE 'delivery.%' ORDER BY id",
    )
    assert [(a["actor"], a["action"], a["reason"], a["target_id"]) for a in audit] == [
        ("token:alice", "delivery.confirm_held", "partner's log shows it", str(confirm)),
        ("token:alice", "delivery.discard", "order cancelled", str(discard)),
        ("token:alice", "delivery.retry_held", "receiver dedupes on webhook-id", str(retry)),
    ]
    assert page.problems == []


def test_a_viewer_sees_no_held_action_and_a_bad_owner_filter_is_escaped(
    site: Site, page: Any
) -> None:
    [held] = _held(site, 1)
    sign_in(page, site, site.token("viewer", "victor"))
    page.goto(f"{site.base_url}/console/deliveries/{held}")
    assert page.locator("button[value=confirm]").count() == 0
    csrf = page.get_attribute("meta[name=csrf-token]", "content")
    refused = page.request.post(
        f"{site.base_url}/console/deliveries/{held}/held/confirm",
        form={"csrf": csrf, "reason": "sneaky"},
    )
    assert refused.status == 403
    dialogs: list[str] = []
    page.on("dialog", lambda d: dialogs.append(d.message))
    answer = page.goto(
        f"{site.base_url}/console/deliveries?owner=%3Cscript%3Ealert(1)%3C/script%3E"
    )
    assert answer.status == 400
    assert "<script>" not in answer.text() and "team name" in page.inner_text("main")
    assert dialogs == []
    assert scalar(site.engine, "SELECT state FROM deliveries WHERE id = :i", i=held) == "held"


def test_another_tenants_held_delivery_is_not_found(site: Site, page: Any) -> None:
    [theirs] = _held(site, 1, tenant=site.tenant("seller-b"))
    site.tenant("seller-a")
    sign_in(page, site, site.token("operator", "amy", tenant="seller-a"))
    assert page.goto(f"{site.base_url}/console/deliveries/{theirs}").status == 404
    page.goto(f"{site.base_url}/console/")
    # the overview's owners are seller-a's only: seller-b's held one (payments') is not there
    assert page.locator("#owners tr[data-owner=payments]").count() == 0
    csrf = page.get_attribute("meta[name=csrf-token]", "content")
    for action in ("held/confirm", "held/retry", "discard"):
        answer = page.request.post(
            f"{site.base_url}/console/deliveries/{theirs}/{action}",
            form={"csrf": csrf, "reason": "not mine"},
        )
        assert answer.status == 404, action
    assert scalar(site.engine, "SELECT state FROM deliveries WHERE id = :i", i=theirs) == "held"
