"""Every console and portal page in a real Chromium at 390 and 1280 px wide.

Each page must fit its viewport (no horizontal scrolling of the page: tables scroll in
their card), no two visible controls may overlap, axe-core (tests/browser/vendor; at both
widths) must find no serious or critical violation, and a screenshot of it is saved
(OUTBOX_SCREENSHOT_DIR, else a temporary directory) so what people see can be looked at.
One server, one database and one browser serve the whole module; the pages share one set
of data, and no test's page depends on another test having run first.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from delivery.operator.console.sessions import issue_portal_link
from delivery.receiver import Behaviour
from outbox import publish
from outbox.deliveries import replay
from outbox.endpoint_auth import check_client_certificate, check_oauth_client, set_endpoint_auth
from outbox.endpoints import set_failure_policy
from outbox.tenants import create_tenant
from tests.browser.site import Site
from tests.helpers import add_endpoint, scalar, self_signed_client_certificate

# Authenticated delivery's secrets: none of them may ever be in a page.
AUTH_SECRET = "oauth-client-s3cret-never-shown"
AUTH_TOKEN = "tok-issued-never-shown"
AUTH_CERTIFICATE = self_signed_client_certificate("partner-client.acme.example")

AXE_SOURCE = (Path(__file__).parent / "vendor" / "axe-core-4.14.1.min.js").read_text()
WIDTHS = (390, 1280)

# The page's own width against the viewport's, and every pair of visible controls whose
# boxes overlap (a control inside another, like a link in a button, is not a pair).
LAYOUT_CHECK = """
() => {
  const root = document.documentElement;
  const selector = "a[href], button, input:not([type=hidden]), select, textarea, summary";
  // checkVisibility: not hidden by CSS (a collapsed menu) nor inside a closed <details>.
  const shown = [...document.querySelectorAll(selector)].filter((el) => {
    const box = el.getBoundingClientRect();
    return box.width > 0 && box.height > 0 && el.checkVisibility({ visibilityProperty: true });
  });
  const name = (el) =>
    el.tagName.toLowerCase() + ":" + (el.textContent || el.name || "").trim().slice(0, 30);
  const overlaps = [];
  for (let i = 0; i < shown.length; i++) {
    for (let j = i + 1; j < shown.length; j++) {
      const a = shown[i], b = shown[j];
      if (a.contains(b) || b.contains(a)) continue;
      const p = a.getBoundingClientRect(), q = b.getBoundingClientRect();
      const w = Math.min(p.right, q.right) - Math.max(p.left, q.left);
      const h = Math.min(p.bottom, q.bottom) - Math.max(p.top, q.top);
      if (w > 1 && h > 1) overlaps.push(name(a) + " / " + name(b));
    }
  }
  return { scrollWidth: root.scrollWidth, viewport: root.clientWidth, overlaps: overlaps };
}
"""

AXE_RUN = """
async () => {
  const result = await axe.run(document, { resultTypes: ["violations"] });
  return result.violations
    .filter((v) => v.impact === "serious" || v.impact === "critical")
    .map((v) => v.impact + " " + v.id + ": " + v.help + " at " +
         v.nodes.slice(0, 3).map((n) => n.target.join(" ")).join(", "));
}
"""


@dataclass
class Pages:
    """The module's data and three browser contexts: signed out, console, portal."""

    site: Site
    ids: dict[str, Any]
    contexts: dict[str, Any]


@pytest.fixture(scope="module")
def pages(module_site: Site, browser: Any) -> Iterator[Pages]:
    site = module_site
    with site.engine.begin() as conn:
        create_tenant(conn, "acme", name="Acme Corp")
        create_tenant(conn, "globex", name="Globex")
    ok = site.receiver.route("/orders", Behaviour(status=200))
    bad = site.receiver.route(
        "/invoices", Behaviour(status=400, body=b"invoice rejected: " + b"x" * 300)
    )
    # A reset after the request went out is ambiguous: this endpoint holds it for a person.
    hangs_up = site.receiver.route("/payouts", Behaviour(reset=True))
    orders = add_endpoint(site.engine, site.box, ok, "order.*", tenant="acme").endpoint.uid
    add_endpoint(site.engine, site.box, bad, "invoice.*", tenant="acme")
    globex = add_endpoint(site.engine, site.box, ok, "*", tenant="globex").endpoint.uid
    # Authenticated delivery: acme's partner endpoint presents a client certificate and
    # asks a token endpoint that refuses its client; globex's gets (and sends) a token.
    partner = add_endpoint(
        site.engine, site.box, "https://127.0.0.1:9/partner", "partner.*", tenant="acme"
    ).endpoint.uid
    refused = site.receiver.route(
        "/token-refused",
        Behaviour(
            status=401,
            body=b'{"error": "invalid_client", "error_description": "<b>who</b>? `x`"}',
        ),
    )
    issuing = site.receiver.route(
        "/token", Behaviour(status=200, body=json.dumps({"access_token": AUTH_TOKEN}).encode())
    )
    for uid, token_url in ((partner, refused), (globex, issuing)):
        client, shown = check_oauth_client(token_url, f"{uid}-app", AUTH_SECRET, "webhooks")
        with site.engine.begin() as conn:
            set_endpoint_auth(conn, site.box, uid, oauth=client, oauth_summary=shown, actor="test")
    checked, summary = check_client_certificate(*AUTH_CERTIFICATE, now=site.clock.now())
    with site.engine.begin() as conn:
        set_endpoint_auth(
            conn, site.box, partner, client_certificate=checked, certificate_summary=summary,
            actor="test",
        )  # fmt: skip
    add_endpoint(site.engine, site.box, bad, "refund.*", tenant="globex")
    payouts = add_endpoint(site.engine, site.box, hangs_up, "payout.*", tenant="globex")
    with site.engine.begin() as conn:
        for n in range(6):
            publish(conn, "order.created", {"order_id": n}, tenant="acme")
        for n in range(2):
            publish(conn, "invoice.paid", {"invoice": n, "lines": list(range(40))}, tenant="acme")
        publish(conn, "order.shipped", {"order_id": 99}, tenant="globex")
        publish(conn, "partner.signed", {"contract": 7}, tenant="acme")
        set_failure_policy(
            conn, payouts.endpoint.uid, actor="test", on_ambiguous="hold", owner="payments"
        )
        publish(conn, "payout.sent", {"payout": 1}, tenant="globex")
        # A dead refund, kept for the bulk replay that goes through to its result.
        publish(conn, "refund.issued", {"refund": 1}, tenant="globex")
    site.deliver()
    dead = int(scalar(site.engine, "SELECT min(id) FROM deliveries WHERE state = 'dead'"))
    with site.engine.begin() as conn:
        replay(conn, [dead], actor="test", reason="partner fixed it", now=site.clock.now())
    site.deliver()
    ids = {
        "dead": dead,
        "succeeded": int(
            scalar(site.engine, "SELECT min(id) FROM deliveries WHERE state = 'succeeded'")
        ),
        "endpoint": orders,
        "partner": partner,
        "globex": globex,
        "new_endpoint_url": site.receiver.route("/new", Behaviour(status=204)),
        "held": int(scalar(site.engine, "SELECT min(id) FROM deliveries WHERE state = 'held'")),
    }
    contexts = {kind: browser.new_context(viewport={"width": 1280, "height": 900}) for kind in
                ("anonymous", "console", "portal")}  # fmt: skip
    console = contexts["console"].new_page()
    console.goto(f"{site.base_url}/console/login")
    console.fill("input[name=token]", site.token("operator", "alice"))
    with console.expect_navigation():
        console.click("button[type=submit]")
    with site.engine.begin() as conn:
        link = issue_portal_link(
            conn, "acme", actor="test", now=site.clock.now(), ttl=dt.timedelta(minutes=5)
        )
    portal = contexts["portal"].new_page()
    portal.goto(f"{site.base_url}/portal/enter?link={link}")
    assert portal.url.endswith("/portal/endpoints")
    try:
        yield Pages(site, ids, contexts)
    finally:
        for context in contexts.values():
            context.close()


def _bulk_preview(page: Any, base: str, ids: dict[str, Any]) -> None:
    page.goto(f"{base}/console/deliveries?state=dead")
    page.fill("form[action='/console/replays'] input[name=reason]", "partner fixed it")
    with page.expect_navigation():
        page.click("form[action='/console/replays'] button")


Visit = Callable[[Any, str, dict[str, Any]], None]


def _refused_sign_in(page: Any, base: str, ids: dict[str, Any]) -> None:
    page.goto(f"{base}/console/login")
    page.fill("input[name=token]", "obx_unknown_token")
    with page.expect_navigation():
        page.click("button[type=submit]")
    assert page.locator(".error").count() == 1


def _held_delivery(page: Any, base: str, ids: dict[str, Any]) -> None:
    page.goto(f"{base}/console/deliveries/{ids['held']}")
    assert page.inner_text("#state") == "held"
    for action in ("confirm", "retry", "discard"):
        assert page.locator(f"section.actions button[value={action}]").count() == 1, action


def _bulk_result(page: Any, base: str, ids: dict[str, Any]) -> None:
    """Preview and confirm a bulk replay of the dead refund."""
    page.goto(f"{base}/console/deliveries?state=dead&event_type=refund.issued")
    page.fill("form[action='/console/replays'] input[name=reason]", "partner fixed it")
    with page.expect_navigation():
        page.click("form[action='/console/replays'] button")
    with page.expect_navigation():
        page.click("form[action='/console/replays'] button")
    assert page.inner_text("#bulk-result") == "Replayed 1 of 1 matched delivery."


def _created_endpoint(page: Any, base: str, ids: dict[str, Any]) -> None:
    """The portal's answer to "Add endpoint": the new endpoint, its secret and feed token
    shown once."""
    page.goto(f"{base}/portal/endpoints")
    page.fill("#add-endpoint input[name=url]", ids["new_endpoint_url"])
    page.fill("#add-endpoint input[name=description]", "orders, from the page tests")
    page.check("#add-endpoint input[value='order.created']")
    # Pushed and on the catch-up feed: the page shows the feed token once too.
    page.select_option("#add-endpoint select[name=delivery_mode]", "both")
    with page.expect_navigation():
        page.click("#add-endpoint button[type=submit]")
    assert "Endpoint created" in page.inner_text(".notice")
    assert page.inner_text("#secret").startswith("whsec_")
    assert page.locator("#feed-token").count() == 1


def _revealed_secret(page: Any, base: str, ids: dict[str, Any]) -> None:
    page.goto(f"{base}/portal/endpoints/{ids['endpoint']}")
    with page.expect_navigation():
        page.click("button[value=reveal]")
    assert page.locator("#secret").count() == 1


def _issued_link(page: Any, base: str, ids: dict[str, Any]) -> None:
    page.goto(f"{base}/console/tenants")
    with page.expect_navigation():
        page.click("#tenant-globex button[value=portal-link]")
    assert page.locator("#portal-link").count() == 1


def _go(path: str) -> Visit:
    def visit(page: Any, base: str, ids: dict[str, Any]) -> None:
        page.goto(base + path.format(**ids))

    return visit


# (name, context, how to get there): every template of the console and the portal.
PAGES: list[tuple[str, str, Visit]] = [
    ("console-login", "anonymous", _go("/console/login")),
    ("console-login-refused", "anonymous", _refused_sign_in),
    ("console-overview", "console", _go("/console/")),
    ("console-deliveries", "console", _go("/console/deliveries")),
    ("console-delivery-dead", "console", _go("/console/deliveries/{dead}")),
    ("console-delivery-succeeded", "console", _go("/console/deliveries/{succeeded}")),
    ("console-delivery-held", "console", _held_delivery),
    ("console-endpoints", "console", _go("/console/endpoints")),
    ("console-endpoint", "console", _go("/console/endpoints/{endpoint}")),
    ("console-endpoint-auth", "console", _go("/console/endpoints/{partner}")),
    ("console-tenants", "console", _go("/console/tenants")),
    ("console-tenants-link", "console", _issued_link),
    ("console-audit", "console", _go("/console/audit")),
    ("console-bulk-replay", "console", _bulk_preview),
    ("console-bulk-replay-result", "console", _bulk_result),
    ("console-error", "console", _go("/console/deliveries/999999999")),
    ("portal-endpoints", "portal", _go("/portal/endpoints")),
    ("portal-endpoint", "portal", _go("/portal/endpoints/{endpoint}")),
    ("portal-endpoint-auth", "portal", _go("/portal/endpoints/{partner}")),
    ("portal-endpoint-secret", "portal", _revealed_secret),
    ("portal-endpoint-created", "portal", _created_endpoint),
    ("portal-deliveries", "portal", _go("/portal/deliveries")),
    ("portal-delivery", "portal", _go("/portal/deliveries/{dead}")),
    ("portal-expired", "anonymous", _go("/portal/enter?link=obxl_unknown")),
]


def _page(pages: Pages, kind: str) -> Any:
    """The context's one open tab (opened on first use)."""
    context = pages.contexts[kind]
    return context.pages[0] if context.pages else context.new_page()


def _wait_for_charts(page: Any) -> None:
    """Every chart drawn (or its empty state shown), at its card's present width."""
    page.wait_for_function(
        "() => [...document.querySelectorAll('[data-chart]')].every(e => e.dataset.rendered"
        " && (!e.chart || e.chart.width === Math.max(e.clientWidth, 200)))"
    )


@pytest.mark.parametrize(("name", "kind", "visit"), PAGES, ids=[p[0] for p in PAGES])
def test_every_page_fits_the_screen_and_passes_axe(
    pages: Pages, screenshot_dir: Path, name: str, kind: str, visit: Visit
) -> None:
    """Opened once on the phone's width, then widened (the charts redraw): each width gets
    its screenshot, the layout checks and its own axe-core run on the same loaded page."""
    page = _page(pages, kind)
    page.set_viewport_size({"width": WIDTHS[0], "height": 900})
    visit(page, pages.site.base_url, pages.ids)
    # Messages shared with the CLI mark commands with backticks: pages show <code> instead.
    assert "`" not in page.inner_text("body"), f"{name} shows markdown backticks"
    page.evaluate(AXE_SOURCE)
    for width in WIDTHS:
        page.set_viewport_size({"width": width, "height": 900})
        _wait_for_charts(page)
        page.screenshot(path=str(screenshot_dir / f"{name}-{width}.png"), full_page=True)
        layout = page.evaluate(LAYOUT_CHECK)
        assert layout["viewport"] == width
        assert layout["scrollWidth"] <= width, (
            f"{name} is {layout['scrollWidth']} px wide in a {width} px viewport"
        )
        assert layout["overlaps"] == [], (
            f"{name} at {width} px: controls overlap: {layout['overlaps']}"
        )
        violations = page.evaluate(AXE_RUN)
        assert violations == [], f"{name} at {width} px:\n" + "\n".join(violations)


ACTIVE = (
    "() => { const el = document.activeElement;"
    " return [el.tagName.toLowerCase(), el.getAttribute('href')]; }"
)
# Where an element is: its box against the viewport's width.
BOX = "el => { const b = el.getBoundingClientRect(); return [b.left, b.right, b.top]; }"


@pytest.mark.parametrize(
    ("kind", "start"), [("console", "/console/"), ("portal", "/portal/deliveries")]
)
def test_the_nav_collapses_on_a_phone_opens_from_the_keyboard_and_is_inline_when_wide(
    pages: Pages, kind: str, start: str
) -> None:
    page = _page(pages, kind)
    base = pages.site.base_url
    page.set_viewport_size({"width": 390, "height": 900})
    page.goto(base + start)
    toggle = page.locator("header .menu-toggle")
    links = page.locator("header nav a")
    hrefs = links.evaluate_all("els => els.map(e => e.getAttribute('href'))")
    assert len(hrefs) == (5 if kind == "console" else 2)
    # Collapsed: one "Menu" button, no link shown, the page no wider than the phone.
    assert toggle.inner_text() == "Menu" and toggle.get_attribute("aria-expanded") == "false"
    assert [link.is_visible() for link in links.all()] == [False] * len(hrefs)
    layout = page.evaluate(LAYOUT_CHECK)
    assert layout["scrollWidth"] <= layout["viewport"] == 390

    # The keyboard: Tab reaches "Menu" first, Enter opens it, Tab walks every link.
    page.keyboard.press("Tab")
    assert page.evaluate(ACTIVE) == ["button", None]
    page.keyboard.press("Enter")
    assert toggle.get_attribute("aria-expanded") == "true"
    reached = []
    for _ in hrefs:
        page.keyboard.press("Tab")
        tag, href = page.evaluate(ACTIVE)
        assert tag == "a"
        left, right, _top = page.evaluate(f"({BOX})(document.activeElement)")
        assert left >= 0 and right <= 390, f"{href} is outside the phone's screen"
        reached.append(href)
    assert reached == hrefs
    layout = page.evaluate(LAYOUT_CHECK)
    assert layout["scrollWidth"] <= layout["viewport"], "the open menu widens the page"
    assert layout["overlaps"] == [], layout["overlaps"]
    # The page tests see the menu closed: axe-core checks the open one here.
    page.evaluate(AXE_SOURCE)
    assert page.evaluate(AXE_RUN) == []
    # Escape closes it, back on "Menu"; Space opens it again; Enter follows a link.
    page.keyboard.press("Escape")
    assert toggle.get_attribute("aria-expanded") == "false"
    assert page.evaluate(ACTIVE) == ["button", None]
    assert not links.first.is_visible()
    page.keyboard.press(" ")
    page.keyboard.press("Tab")
    with page.expect_navigation():
        page.keyboard.press("Enter")
    assert page.url == base + hrefs[0]
    assert toggle.get_attribute("aria-expanded") == "false"  # the next page starts collapsed

    # Wide: no "Menu", the links inline in the header's row, first in the Tab order.
    page.set_viewport_size({"width": 1280, "height": 900})
    page.goto(base + start)
    assert not toggle.is_visible()
    assert [link.is_visible() for link in links.all()] == [True] * len(hrefs)
    brand_top = page.locator("header .brand").evaluate(BOX)[2]
    tops = {round(top) for _l, _r, top in links.evaluate_all(f"els => els.map({BOX})")}
    assert len(tops) == 1 and abs(tops.pop() - brand_top) < 8, "the nav links are not one row"
    page.keyboard.press("Tab")
    assert page.evaluate(ACTIVE) == ["a", hrefs[0]]


def test_without_scripts_the_nav_shows_its_links_on_a_phone(pages: Pages, browser: Any) -> None:
    """The "Menu" button needs console.js; without scripts the links show instead."""
    signed_in = pages.contexts["console"].storage_state()
    context = browser.new_context(
        java_script_enabled=False, storage_state=signed_in, viewport={"width": 390, "height": 900}
    )
    try:
        page = context.new_page()
        page.goto(f"{pages.site.base_url}/console/deliveries")
        assert not page.locator("header .menu-toggle").is_visible()
        links = page.locator("header nav a")
        assert links.count() == 5
        assert [link.is_visible() for link in links.all()] == [True] * 5
        layout = page.evaluate(LAYOUT_CHECK)
        assert layout["scrollWidth"] <= layout["viewport"] and layout["overlaps"] == []
    finally:
        context.close()


def test_the_layout_check_sees_overlap_and_overflow(pages: Pages) -> None:
    """The checker itself: a button moved onto the token field, a table made too wide."""
    page = _page(pages, "anonymous")
    page.set_viewport_size({"width": 390, "height": 900})
    page.goto(f"{pages.site.base_url}/console/login")
    assert page.evaluate(LAYOUT_CHECK)["overlaps"] == []
    page.evaluate(
        "() => { const at = document.querySelector('input[name=token]').getBoundingClientRect();"
        " Object.assign(document.querySelector('button[type=submit]').style,"
        " {position: 'fixed', left: at.left + 'px', top: at.top + 'px'}); }"
    )
    page.evaluate("document.querySelector('main').style.minWidth = '600px'")
    layout = page.evaluate(LAYOUT_CHECK)
    assert layout["overlaps"] == ["input:token / button:Sign in"]
    assert layout["scrollWidth"] > layout["viewport"]


def test_chart_axes_span_the_range_with_round_labels(pages: Pages) -> None:
    """The overview's hour chart: x from now - 1 h to now, the ticks charts.py chose (drawn
    by uPlot through our label callback), one bucket a minute."""
    page = _page(pages, "console")
    page.set_viewport_size({"width": 1280, "height": 900})
    page.goto(f"{pages.site.base_url}/console/")
    _wait_for_charts(page)
    data = page.request.get(f"{pages.site.base_url}/console/charts.json?range=hour").json()
    now = int(pages.site.clock.now().timestamp())
    assert (data["from"], data["to"]) == (now - 3600, now)
    chart = page.locator("[data-chart=outcomes]").first
    assert chart.get_attribute("data-rendered") == "true"
    assert (chart.get_attribute("data-x-from"), chart.get_attribute("data-x-to")) == (
        str(now - 3600),
        str(now),
    )
    drawn = chart.get_attribute("data-x-labels") or ""
    assert drawn.split() == data["labels"] and len(data["labels"]) == 6
    scale = page.evaluate(
        "() => { const c = document.querySelector('[data-chart=outcomes]').chart;"
        " return [c.scales.x.min, c.scales.x.max]; }"
    )
    assert scale == [now - 3600, now]
    # Latency of empty buckets is a gap, not a zero: the series has nulls between points.
    assert None in data["p50_ms"] and data["points"] >= 1
    # A range the charts do not have is refused by name, not read as some other range.
    refused = page.request.get(f"{pages.site.base_url}/console/charts.json?range=week")
    assert refused.status == 400
    assert "range must be one of hour, day, not &#39;week&#39;" in refused.text()

    # An endpoint's page in the portal: its one point sits on the same hour-wide axis and
    # the day's charts span the day (the bug was an x axis from 2027 to 2029).
    portal = _page(pages, "portal")
    portal.set_viewport_size({"width": 1280, "height": 900})
    portal.goto(f"{pages.site.base_url}/portal/endpoints/{pages.ids['endpoint']}")
    _wait_for_charts(portal)
    drawn = portal.locator("[data-chart]").evaluate_all(
        "els => els.map(e => [e.dataset.src.split('range=')[1], e.dataset.points,"
        " Number(e.dataset.xFrom), Number(e.dataset.xTo), e.chart.scales.x.min])"
    )
    assert drawn == [
        ["hour", "1", now - 3600, now, now - 3600],
        ["hour", "1", now - 3600, now, now - 3600],
        ["day", "1", now - 86400, now, now - 86400],
        ["day", "1", now - 86400, now, now - 86400],
    ]


def test_an_endpoint_without_attempts_shows_an_empty_chart(pages: Pages) -> None:
    site = pages.site
    url = site.receiver.route("/quiet", Behaviour(status=200))
    quiet = add_endpoint(site.engine, site.box, url, "never.*", tenant="acme").endpoint.uid
    page = _page(pages, "portal")
    page.goto(f"{site.base_url}/portal/endpoints/{quiet}")
    _wait_for_charts(page)
    empty = page.locator("[data-chart] .empty")
    assert empty.count() == 4
    assert empty.first.inner_text() == "No attempts in the last hour."
    assert page.locator("[data-chart] canvas").count() == 0


def test_endpoint_pages_show_authenticated_delivery_and_never_its_secrets(pages: Pages) -> None:
    """The console and the tenant's portal show the certificate's subject and expiry, the
    OAuth2 client and what its token did; the key, the client secret and the token are in
    no page's HTML. Another tenant's endpoint is a 404 in the portal."""
    site, ids = pages.site, pages.ids
    key_lines = [line for line in AUTH_CERTIFICATE[1].splitlines() if "-----" not in line]
    expiry = x509.load_pem_x509_certificate(AUTH_CERTIFICATE[0].encode()).not_valid_after_utc
    html: dict[str, str] = {}

    def visit(kind: str, path: str) -> Any:
        page = _page(pages, kind)
        page.set_viewport_size({"width": 1280, "height": 900})
        answer = page.goto(site.base_url + path)
        html[f"{kind} {path}"] = page.content()
        return page, answer

    for kind in ("console", "portal"):
        page, _ = visit(kind, f"/{kind}/endpoints/{ids['partner']}")
        assert page.inner_text("#auth-mtls") == "client certificate presented"
        assert page.inner_text("#auth-cert-subject") == "CN=partner-client.acme.example"
        assert page.inner_text("#auth-cert-expiry").startswith(f"{expiry:%Y-%m-%d %H:%M:%S}")
        assert page.inner_text("#auth-token-url").endswith("/token-refused")
        assert page.inner_text("#auth-client-id") == f"{ids['partner']}-app"
        assert page.inner_text("#auth-scope") == "webhooks"
        assert page.inner_text("#auth-token-used") == "not in the last day"
        error = page.inner_text("#auth-token-error")
        # The token endpoint's words are text, never markup.
        assert "answered HTTP 401 (invalid_client: <b>who</b>? x)" in error, error
        assert page.locator("#auth-token-error b").count() == 0
        assert "check the endpoint's OAuth client id and secret" in error
    page, _ = visit("console", f"/console/endpoints/{ids['globex']}")
    assert page.inner_text("#auth-mtls") == "not configured"
    assert page.inner_text("#auth-token-used") == site.clock.now().strftime("%Y-%m-%d %H:%M:%S")
    assert page.inner_text("#auth-token-error") == "none in the last day"
    page, _ = visit("console", f"/console/endpoints/{ids['endpoint']}")
    assert page.inner_text("#auth-oauth") == "not configured"

    # acme's portal: globex's endpoint does not exist, and nothing of its settings shows.
    page, answer = visit("portal", f"/portal/endpoints/{ids['globex']}")
    assert answer.status == 404
    assert f"{ids['globex']}-app" not in html[f"portal /portal/endpoints/{ids['globex']}"]

    for where, text in html.items():
        for secret in (AUTH_SECRET, AUTH_TOKEN, "PRIVATE KEY", *key_lines):
            assert secret not in text, f"{secret[:20]}... is in {where}"


def test_the_portal_names_the_tenant_and_the_brand_never_internal_labels(pages: Pages) -> None:
    page = _page(pages, "portal")
    page.goto(f"{pages.site.base_url}/portal/deliveries/{pages.ids['succeeded']}")
    header = page.inner_text("header")
    assert "Shopfront webhooks" in header and "Acme Corp" in header
    for internal in ("portal:", "operator", "tenant acme", "webhook-outbox"):
        assert internal not in header
    assert page.title().endswith("· Shopfront webhooks")
    # A succeeded delivery: no next attempt, no empty actions card.
    assert page.locator("#next-attempt").count() == 0
    assert page.locator("#finished").count() == 1
    assert page.locator("section.actions").count() == 0


# Each <code> in a form's hint against the text around it: whether it sits on the line the
# text before it ends on and the text after it starts on (a label laid out as a column of
# flex items puts each piece on a line of its own).
HINT_FLOW = """
() => [...document.querySelectorAll("form label code")].map((code) => {
  const line = code.getBoundingClientRect().top;
  const edge = (node, last) => {
    if (!node || !node.textContent.trim()) return line;
    const range = document.createRange();
    range.selectNodeContents(node);
    const rects = range.getClientRects();
    return rects[last ? rects.length - 1 : 0].top;
  };
  const flows = Math.abs(edge(code.previousSibling, true) - line) < 4 &&
    Math.abs(edge(code.nextSibling, false) - line) < 4;
  return [code.textContent, flows];
})
"""


def test_form_hints_keep_their_code_in_the_sentence(pages: Pages) -> None:
    """The portal's add-endpoint hints read as sentences, not one piece a line."""
    page = _page(pages, "portal")
    page.set_viewport_size({"width": 1280, "height": 900})
    page.goto(f"{pages.site.base_url}/portal/endpoints")
    hints = page.evaluate(HINT_FLOW)
    assert len(hints) == 3, hints  # order.*, *, the payload filter's example
    assert [code for code, flows in hints if not flows] == []


def test_words_read_right(pages: Pages) -> None:
    page = _page(pages, "console")
    base = pages.site.base_url
    page.goto(f"{base}/console/")
    alerts = page.inner_text("#overview-panel table")
    assert "`" not in page.content()
    assert "behind or stopped" not in alerts and "is the relay running" not in alerts
    assert "workers are keeping up" in alerts and "the relay is keeping up" in alerts
    assert "1 deliveries" not in alerts and "endpoint(s)" not in alerts
    page.goto(f"{base}/console/deliveries/{pages.ids['dead']}")
    assert page.locator("#next-attempt").count() == 0
    # A refusal that names a command shows it as code, not in markdown backticks.
    signed_out = _page(pages, "anonymous")
    signed_out.goto(f"{base}/console/login")
    signed_out.fill("input[name=token]", "obx_unknown_token")
    with signed_out.expect_navigation():
        signed_out.click("button[type=submit]")
    assert signed_out.locator(".error code").all_inner_texts() == ["outbox tokens create"]
    assert "`" not in signed_out.inner_text("main")
    page.goto(f"{base}/console/deliveries")
    # Every replay on the page is marked as one, and nothing else is (other tests of the
    # module replay too, in any order: the count comes from the database).
    marks = page.locator("#deliveries small.replay").all_inner_texts()
    assert f"replay of {pages.ids['dead']}" in marks
    assert len(marks) == scalar(
        pages.site.engine, "SELECT count(*) FROM deliveries WHERE replay_of IS NOT NULL"
    )
    # Tenant names lead to the tenant, not to a list of its deliveries.
    tenant_link = page.locator("#deliveries a:text-is('acme')").first
    assert tenant_link.get_attribute("href") == "/console/tenants#tenant-acme"
    with page.expect_navigation():
        tenant_link.click()
    assert page.locator("#tenant-acme").is_visible()


def test_a_dead_delivery_is_replayed_from_the_keyboard(pages: Pages) -> None:
    """Tab to the reason, type it, Tab to Replay (focus visible), Enter: the replay opens.
    Last in the module: it adds a delivery the other tests' pages would show."""
    site = pages.site
    page = pages.contexts["anonymous"].new_page()
    page.goto(f"{site.base_url}/console/login")
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.name") == "token"
    page.keyboard.type(site.token("operator", "keyboard"))
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.textContent") == "Sign in"
    with page.expect_navigation():
        page.keyboard.press("Enter")
    assert page.url == f"{site.base_url}/console/"

    dead = int(scalar(site.engine, "SELECT max(id) FROM deliveries WHERE state = 'dead'"))
    page.goto(f"{site.base_url}/console/deliveries/{dead}")
    for _ in range(40):
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.name") == "reason":
            break
    form = page.evaluate("document.activeElement.closest('form').getAttribute('action')")
    assert form.endswith("/replay")
    page.keyboard.type("sent again from the keyboard")
    page.keyboard.press("Tab")
    focused = page.evaluate(
        "() => { const el = document.activeElement; const s = getComputedStyle(el);"
        " return [el.value, s.outlineStyle, parseFloat(s.outlineWidth)]; }"
    )
    assert focused[0] == "replay"
    assert focused[1] != "none" and focused[2] >= 2, f"no visible focus: {json.dumps(focused)}"
    with page.expect_navigation():
        page.keyboard.press("Enter")
    replayed = int(page.url.rsplit("/", 1)[1])
    assert replayed != dead
    assert (
        scalar(site.engine, "SELECT replay_of FROM deliveries WHERE id = :id", id=replayed) == dead
    )
    page.close()
