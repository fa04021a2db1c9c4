"""`python -m bench.console_pages [--screenshots DIR]`: console page times over a big filter.

Seeds an installation with two tenants and ~30,000 deliveries (12,000 of them dead on one
endpoint, so the `state=dead` filter matches more than 10,000), each with an attempt
spread over the last day, then serves the real admin app (console and portal) on
loopback and times the pages an operator opens: the first page of the filter, a page
deep into it (keyset paging: `before=`), the same filters narrowed by tenant, error
text, event type and message id, the overview, and a tenant's portal list. Each is
fetched a few times after a warm-up; the table gives p50, p95 and max in ms, measured by
the client (server and client share one process and event loop).

With --screenshots DIR it also drives Chromium (Playwright, Debian's `chromium`) to save
console-overview.png, console-delivery.png and portal.png into DIR.

The rows are written with SQL (generate_series) rather than through the worker so that
seeding 30,000 deliveries takes seconds; the pages read them exactly as they read rows
the worker wrote.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from sqlalchemy import Engine, text

from delivery.operator.api import AdminConfig, create_app, serve
from delivery.operator.console.config import ConsoleConfig
from delivery.operator.console.sessions import issue_portal_link, portal_link
from outbox.clock import SystemClock
from outbox.crypto import SecretBox, generate_key
from outbox.db import make_async_engine, make_engine
from outbox.embedded import EmbeddedPostgres
from outbox.endpoints import create_endpoint
from outbox.migrate import upgrade
from outbox.tenants import create_tenant
from outbox.tokens import create_token

DEAD = 12_000
SUCCEEDED = 15_000
OTHER = 3_000
RUNS = 15

SEED = text(
    """
    WITH ev AS (
        INSERT INTO outbox_events (message_id, tenant_id, event_type, payload, created_at,
                                   relayed_at)
        SELECT 'msg_' || :prefix || '_' || lpad(g::text, 6, '0'),
               (SELECT id FROM tenants WHERE uid = :tenant),
               (ARRAY['order.created', 'order.paid', 'invoice.paid'])[1 + g % 3],
               jsonb_build_object('order_id', 10000 + g, 'amount_cents', (g * 7919) % 100000,
                                  'currency', 'EUR', 'customer', 'cus_' || (g % 977)),
               :now - make_interval(secs => (:count - g) * :spacing),
               :now - make_interval(secs => (:count - g) * :spacing)
        FROM generate_series(1, :count) g
        RETURNING id, created_at, tenant_id, message_id
    ), d AS (
        INSERT INTO deliveries (event_id, endpoint_id, tenant_id, state, attempts, max_attempts,
                                next_attempt_at, last_status_code, last_error, final_reason,
                                created_at, updated_at, completed_at)
        SELECT ev.id, e.id, ev.tenant_id, :state, 1, 8, ev.created_at,
               :status, :error, :final_reason, ev.created_at, ev.created_at, ev.created_at
        FROM ev, endpoints e WHERE e.uid = :endpoint
        RETURNING id, created_at, event_id
    )
    INSERT INTO delivery_attempts (delivery_id, attempt_number, started_at, duration_ms,
                                   status_code, outcome, error, response_excerpt,
                                   request_headers, worker_id)
    SELECT d.id, 1, d.created_at, 20 + (d.id * 37) % :spread, :status, :outcome, :error,
           :excerpt,
           jsonb_build_object('content-type', 'application/json',
                              'webhook-id', ev.message_id,
                              'webhook-timestamp', extract(epoch FROM d.created_at)::bigint::text,
                              'webhook-signature', 'v1,<redacted>'),
           'bench-worker'
    FROM d JOIN ev ON ev.id = d.event_id
    """
)


def seed(engine: Engine, box: SecretBox, now: dt.datetime) -> dict[str, str]:
    """Tenants, endpoints and deliveries; returns the ids the pages are opened with."""
    with engine.begin() as conn:
        create_tenant(conn, "acme", name="Acme Corp")
        create_tenant(conn, "globex", name="Globex")
        ids = {
            name: create_endpoint(
                conn,
                box,
                url=url,
                event_types=types,
                tenant=tenant,
                description=name,
                concurrency="fixed",
            ).endpoint.uid
            for name, url, types, tenant in (
                ("orders", "https://hooks.acme.example/orders", "order.*", "acme"),
                ("billing", "https://billing.acme.example/webhooks", "*", "acme"),
                ("globex", "https://globex.example/in", "invoice.*", "globex"),
            )
        }
        day = 86_400.0
        for tenant, endpoint, count, state, status, outcome, error, reason, spread in (
            ("acme", ids["orders"], SUCCEEDED, "succeeded", 200, "succeeded", None, None, 180),
            (
                "acme",
                ids["billing"],
                DEAD,
                "dead",
                422,
                "permanent",
                "HTTP 422 Unprocessable Entity: amount_cents must be positive",
                "permanent failure: HTTP 422",
                900,
            ),
            ("globex", ids["globex"], OTHER, "succeeded", 204, "succeeded", None, None, 120),
        ):
            conn.execute(
                SEED,
                {
                    "tenant": tenant,
                    "endpoint": endpoint,
                    "prefix": "".join(k for k, v in ids.items() if v == endpoint),
                    "count": count,
                    "spacing": day / count,
                    "now": now,
                    "state": state,
                    "status": status,
                    "outcome": outcome,
                    "error": error,
                    "final_reason": reason,
                    "excerpt": '{"error": "amount_cents must be positive"}' if error else "ok",
                    "spread": spread,
                },
            )
        conn.execute(text("ANALYZE"))
        dead = conn.execute(text("SELECT max(id) FROM deliveries WHERE state = 'dead'")).scalar()
        message = conn.execute(
            text(
                "SELECT ev.message_id FROM deliveries d JOIN outbox_events ev "
                "ON ev.id = d.event_id WHERE d.state = 'dead' ORDER BY d.id LIMIT 1 OFFSET 6000"
            )
        ).scalar()
        deep = conn.execute(
            text("SELECT id FROM deliveries WHERE state = 'dead' ORDER BY id LIMIT 1 OFFSET 2000")
        ).scalar()
        token = create_token(conn, name="bench", role="operator", actor="bench")[1]
        links = [
            issue_portal_link(conn, "acme", actor="bench", now=now, ttl=dt.timedelta(minutes=15))
            for _ in range(2)  # one for the timings, one for the screenshot
        ]
    return {
        **ids,
        "dead": str(dead),
        "message": str(message),
        "deep": str(deep),
        "token": token,
        "link": portal_link(links[0], None),
        "screenshot_link": portal_link(links[1], None),
    }


async def timed(client: httpx.AsyncClient, path: str) -> list[float]:
    for _ in range(2):  # warm-up: plans and connections
        answer = await client.get(path)
        answer.raise_for_status()
    times = []
    for _ in range(RUNS):
        started = time.perf_counter()
        answer = await client.get(path)
        times.append((time.perf_counter() - started) * 1000)
        answer.raise_for_status()
    return times


async def screenshots(base: str, ids: dict[str, str], out: Path, token: str) -> None:
    from playwright.async_api import async_playwright

    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    if executable is None:
        raise SystemExit("no chromium on PATH: apt-get install -y chromium")
    await asyncio.to_thread(out.mkdir, parents=True, exist_ok=True)
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=executable, args=["--no-sandbox", "--disable-gpu"]
        )
        page = await browser.new_page(viewport={"width": 1360, "height": 900})
        await page.goto(f"{base}/console/login")
        await page.fill("input[name=token]", token)
        async with page.expect_navigation():
            await page.click("button[type=submit]")
        await page.locator("[data-chart][data-rendered=true]").nth(3).wait_for()
        await page.screenshot(path=str(out / "console-overview.png"), full_page=True)
        await page.goto(f"{base}/console/deliveries/{ids['dead']}")
        await page.click("#attempts details summary")
        await page.screenshot(path=str(out / "console-delivery.png"), full_page=True)
        portal = await browser.new_page(viewport={"width": 1360, "height": 900})
        await portal.goto(base + ids["screenshot_link"])
        await portal.goto(f"{base}/portal/endpoints/{ids['billing']}")
        await portal.locator("[data-chart][data-rendered=true]").nth(1).wait_for()
        await portal.screenshot(path=str(out / "portal.png"), full_page=True)
        await browser.close()


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", default=os.environ.get("OUTBOX_DATABASE_URL"))
    parser.add_argument("--screenshots", type=Path, default=None, help="save PNGs here")
    args = parser.parse_args()
    box = SecretBox.from_setting(generate_key("bench"))
    now = SystemClock().now()
    with contextlib.ExitStack() as stack:
        url = args.database_url
        if not url:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="outbox-console-"))
            url = stack.enter_context(EmbeddedPostgres(Path(tmp), delete_on_stop=True)).url()
        engine = make_engine(url)
        stack.callback(engine.dispose)
        upgrade(engine)
        started = time.perf_counter()
        ids = seed(engine, box, now)
        print(f"seeded in {time.perf_counter() - started:.1f}s", file=sys.stderr)
        async_engine = make_async_engine(url)
        # The application's own name and colour (OUTBOX_CONSOLE_*), as its tenants see them.
        brand = ConsoleConfig(app_name="Shopfront webhooks", brand_color="#0f766e")
        app = create_app(async_engine, box, config=AdminConfig(console=brand))
        stop, ready, bound = asyncio.Event(), asyncio.Event(), []

        def on_started(port: int) -> None:
            bound.append(port)
            ready.set()

        server = asyncio.create_task(
            serve(app, host="127.0.0.1", port=0, stop=stop, on_started=on_started)
        )
        await asyncio.wait_for(ready.wait(), 30)
        base = f"http://127.0.0.1:{bound[0]}"
        results: list[tuple[str, list[float], int]] = []
        try:
            async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                login = await client.post("/console/login", data={"token": ids["token"]})
                assert login.status_code == 303, login.text
                pages = [
                    ("dead, first page", "/console/deliveries?state=dead", DEAD),
                    (
                        "dead, page 41 (before=)",
                        f"/console/deliveries?state=dead&before={ids['deep']}",
                        DEAD,
                    ),
                    ("dead + tenant acme", "/console/deliveries?state=dead&tenant=acme", DEAD),
                    (
                        "dead + error text",
                        "/console/deliveries?state=dead&error=amount_cents",
                        DEAD,
                    ),
                    (
                        "dead + event type",
                        "/console/deliveries?state=dead&event_type=order.paid",
                        DEAD // 3,
                    ),
                    ("message id", f"/console/deliveries?message_id={ids['message']}", 1),
                    ("all deliveries", "/console/deliveries", DEAD + SUCCEEDED + OTHER),
                    ("overview", "/console/", 0),
                ]
                for name, path, matching in pages:
                    results.append((name, await timed(client, path), matching))
            async with httpx.AsyncClient(base_url=base, timeout=30) as tenant_client:
                entered = await tenant_client.get(ids["link"])
                assert entered.status_code == 303, entered.text
                results.append(
                    (
                        "portal: acme deliveries",
                        await timed(tenant_client, "/portal/deliveries?state=dead"),
                        DEAD,
                    )
                )
            if args.screenshots:
                await screenshots(base, ids, args.screenshots, ids["token"])
        finally:
            stop.set()
            await server
            await async_engine.dispose()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"\n{RUNS} fetches per page after 2 warm-ups; {DEAD + SUCCEEDED + OTHER} deliveries; "
        f"{os.cpu_count()} CPUs ({platform.machine()}), load average after the run {load}\n"
    )
    print("| page | matching | p50 ms | p95 ms | max ms |")
    print("|---|---|---|---|---|")
    for name, times, matching in results:
        p95 = statistics.quantiles(times, n=20, method="inclusive")[18]
        print(
            f"| {name} | {matching} | {statistics.median(times):.1f} | {p95:.1f} "
            f"| {max(times):.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
