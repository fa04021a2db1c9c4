"""Console and portal sessions end with what opened them (issue 29, items 3 and 4).

Against a real admin server on loopback (tests/browser/conftest.py): a console session dies with
its token (revoked through the API or the CLI, or expired), sessions and portal links
die with their tenant and do not come back with a new tenant of the same uid, failed
sign-ins are audited in bounded rows, and X-Forwarded-For is believed only from
OUTBOX_TRUSTED_PROXIES, for the limits and for the audit log alike.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import re
import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from sqlalchemy import Engine, text

from delivery.operator.api import AdminConfig
from delivery.operator.cli import main
from delivery.operator.console.sessions import load_session, redeem_portal_link
from delivery.operator.console.web import LINK_REFUSED, SIGN_IN_REFUSED
from delivery.receiver import Behaviour
from outbox import publish
from outbox.db import make_engine
from outbox.migrate import upgrade
from outbox.tokens import create_token
from tests.browser.site import Site
from tests.helpers import add_endpoint, rows, scalar


@contextlib.contextmanager
def _signed_in(site: Site, token: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=site.base_url) as http:
        answer = http.post("/console/login", data={"token": token})
        assert answer.status_code == 303, answer.text
        assert answer.headers["location"] == "/console/"
        yield http


def _csrf(page: httpx.Response) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert found is not None, page.text
    return found.group(1)


def _token_id(token: str) -> str:
    return token.split("_")[1]


def _dead_deliveries(site: Site) -> list[int]:
    url = site.receiver.route("/hook", Behaviour(status=400, body=b"bad order"))
    add_endpoint(site.engine, site.box, url, "order.*")
    with site.engine.begin() as conn:
        for order in (41, 42):
            publish(conn, "order.created", {"order_id": order})
    site.deliver()
    dead = rows(site.engine, "SELECT id FROM deliveries WHERE state = 'dead' ORDER BY id")
    return [int(row["id"]) for row in dead]


def _refused(engine: Engine) -> list[Any]:
    return rows(
        engine,
        "SELECT actor, reason, target_id, details FROM audit_log"
        " WHERE action = 'api.refused' ORDER BY id",
    )


def _signed_out(answer: httpx.Response) -> bool:
    return answer.status_code == 303 and answer.headers["location"] == "/console/login"


# -- a console session is the token's --------------------------------------------------------


@pytest.mark.parametrize("revoke_with", ["api", "cli"])
def test_revoking_a_token_ends_its_console_sessions_replays_included(
    site: Site, database_url: str, revoke_with: str
) -> None:
    dead, other = _dead_deliveries(site)
    token = site.token("operator", "alice")
    with _signed_in(site, token) as alice, _signed_in(site, token) as alice_elsewhere:
        page = alice.get(f"/console/deliveries/{dead}")
        assert page.status_code == 200
        csrf = _csrf(page)
        first = alice.post(
            f"/console/deliveries/{dead}/replay",
            data={"csrf": csrf, "reason": "partner fixed it"},
        )
        assert first.status_code == 303 and "/console/deliveries/" in first.headers["location"]
        assert alice_elsewhere.get("/console/").status_code == 200

        if revoke_with == "api":
            admin = site.token("operator", "admin")
            answer = httpx.delete(
                f"{site.base_url}/v1/tokens/{_token_id(token)}",
                headers={"authorization": f"Bearer {admin}"},
            )
            assert answer.status_code == 200, answer.text
        else:
            done = CliRunner().invoke(
                main,
                ["tokens", "revoke", "alice"],
                env={"OUTBOX_DATABASE_URL": database_url, "USER": "night"},
            )
            assert done.exit_code == 0, done.output

        # At once, in both sessions the token opened: every form and every page.
        replayed = alice.post(
            f"/console/deliveries/{other}/replay",
            data={"csrf": csrf, "reason": "after revocation"},
        )
        assert _signed_out(replayed), replayed.headers.get("location")
        assert _signed_out(alice.get("/console/"))
        assert _signed_out(alice_elsewhere.get(f"/console/deliveries/{dead}"))
    replays = rows(site.engine, "SELECT reason FROM audit_log WHERE action = 'delivery.replay'")
    assert [r["reason"] for r in replays] == ["partner fixed it"]
    replayed_from = rows(
        site.engine, "SELECT replay_of FROM deliveries WHERE replay_of IS NOT NULL"
    )
    assert [r["replay_of"] for r in replayed_from] == [dead]


def test_in_a_browser_a_revoked_token_sends_its_session_back_to_sign_in(
    site: Site, page: Any
) -> None:
    token = site.token("operator", "bob")
    page.goto(f"{site.base_url}/console/login")
    page.fill("input[name=token]", token)
    with page.expect_navigation():
        page.click("button[type=submit]")
    assert page.url == f"{site.base_url}/console/"
    admin = site.token("operator", "admin")
    revoked = httpx.delete(
        f"{site.base_url}/v1/tokens/bob", headers={"authorization": f"Bearer {admin}"}
    )
    assert revoked.status_code == 200, revoked.text
    page.goto(f"{site.base_url}/console/deliveries")
    assert page.url == f"{site.base_url}/console/login"
    assert page.locator("input[name=token]").count() == 1
    assert page.problems == []


def test_an_expired_token_ends_its_console_session_and_cannot_sign_in(site: Site) -> None:
    with site.engine.begin() as conn:
        _, token = create_token(
            conn,
            name="contractor",
            role="viewer",
            actor="test",
            expires_in=dt.timedelta(hours=1),
            now=site.clock.now(),
        )
    with _signed_in(site, token) as http:
        assert http.get("/console/").status_code == 200
        site.clock.advance(3599)
        assert http.get("/console/").status_code == 200
        site.clock.advance(1)
        # The session's own lifetime (8 h) has hours left; the token's has not.
        assert _signed_out(http.get("/console/"))
        again = http.post("/console/login", data={"token": token})
    assert again.status_code == 401
    api = httpx.get(f"{site.base_url}/v1/deliveries", headers={"authorization": f"Bearer {token}"})
    assert api.status_code == 401 and "expired" in api.json()["error"]
    reasons = [r["reason"] for r in _refused(site.engine)]
    assert any(r.startswith("console sign-in: this token expired at") for r in reasons), reasons


def test_tokens_expire_when_asked_through_the_api_and_the_cli(
    site: Site, database_url: str
) -> None:
    admin = site.token("operator", "admin")
    headers = {"authorization": f"Bearer {admin}"}
    with httpx.Client(base_url=site.base_url, headers=headers) as http:
        made = http.post(
            "/v1/tokens", json={"name": "brief", "role": "viewer", "expires_in_seconds": 60}
        )
        assert made.status_code == 200, made.text
        expected = site.clock.now() + dt.timedelta(seconds=60)
        assert dt.datetime.fromisoformat(made.json()["expires_at"]) == expected
        for bad in ("soon", 0, -5, True, 1e12, None):
            refused = http.post(
                "/v1/tokens",
                json={"name": f"bad-{bad}", "role": "viewer", "expires_in_seconds": bad},
            )
            if bad is None:
                assert refused.status_code == 200 and refused.json()["expires_at"] is None
            else:
                assert refused.status_code == 400, (bad, refused.text)
                assert "expires_in_seconds" in refused.json()["error"]
    env = {"OUTBOX_DATABASE_URL": database_url, "USER": "night"}
    runner = CliRunner()
    done = runner.invoke(
        main, ["tokens", "create", "week", "--role", "viewer", "--expires-in", "7d"], env=env
    )
    assert done.exit_code == 0 and ", expires 20" in done.output, done.output
    wrong = runner.invoke(
        main, ["tokens", "create", "x", "--role", "viewer", "--expires-in", "0"], env=env
    )
    assert wrong.exit_code != 0 and "lifetime must be above 0" in wrong.output


# -- sessions and links are the tenant's, not its uid's --------------------------------------


def test_a_deleted_tenant_s_sessions_and_links_stay_dead_when_its_uid_is_reused(
    site: Site,
) -> None:
    site.tenant("acme")
    old = add_endpoint(
        site.engine, site.box, "https://old-acme.example/hook", "*", tenant="acme"
    ).endpoint.uid
    admin = site.token("operator", "admin")
    api = httpx.Client(base_url=site.base_url, headers={"authorization": f"Bearer {admin}"})

    def link() -> str:
        answer = api.post("/v1/tenants/acme/portal-links", json={"ttl_seconds": 600})
        assert answer.status_code == 200, answer.text
        return str(answer.json()["link"])

    with (
        api,
        _signed_in(site, site.token("viewer", "acme-viewer", tenant="acme")) as console,
        httpx.Client(base_url=site.base_url) as portal,
    ):
        entered = portal.get(link())
        assert entered.status_code == 303 and entered.headers["location"] == "/portal/"
        unused = link()
        assert old in portal.get("/portal/endpoints").text
        assert old in console.get("/console/endpoints").text

        deleted = api.delete("/v1/tenants/acme", params={"reason": "customer left"})
        assert deleted.status_code == 200, deleted.text
        # Gone with the tenant, not merely refused.
        assert scalar(site.engine, "SELECT count(*) FROM console_sessions") == 0
        assert scalar(site.engine, "SELECT count(*) FROM portal_links") == 0

        recreated = api.post("/v1/tenants", json={"id": "acme", "name": "Another Acme"})
        assert recreated.status_code == 200, recreated.text
        new = add_endpoint(
            site.engine, site.box, "https://new-owner.example/hook", "*", tenant="acme"
        ).endpoint.uid

        for path in ("/console/", "/console/endpoints", f"/console/endpoints/{new}"):
            answer = console.get(path)
            assert _signed_out(answer), (path, answer.status_code)
            assert new not in answer.text and "new-owner" not in answer.text
        for path in ("/portal/", "/portal/endpoints", f"/portal/endpoints/{new}"):
            answer = portal.get(path)
            assert answer.status_code == 401, (path, answer.status_code)
            assert new not in answer.text and "new-owner" not in answer.text
        reused = portal.get(unused)
        assert reused.status_code == 401 and "already used or has expired" in reused.text
        # A link issued for the new tenant works, and opens the new tenant only.
        fresh = httpx.Client(base_url=site.base_url)
        with fresh:
            assert fresh.get(link()).status_code == 303
            listing = fresh.get("/portal/endpoints").text
        assert new in listing and old not in listing


def test_sessions_and_links_from_before_the_binding_are_refused(site: Site) -> None:
    """Rows written before migration 0022 carry no token or tenant id: sign in again."""
    site.tenant("acme")
    admin = site.token("operator", "admin")
    with (
        _signed_in(site, admin) as console,
        httpx.Client(base_url=site.base_url) as portal,
        httpx.Client(base_url=site.base_url, headers={"authorization": f"Bearer {admin}"}) as api,
    ):
        link = api.post("/v1/tenants/acme/portal-links", json={}).json()["link"]
        assert portal.get(link).status_code == 303
        unused = api.post("/v1/tenants/acme/portal-links", json={}).json()["link"]
        assert console.get("/console/").status_code == 200
        assert portal.get("/portal/endpoints").status_code == 200
        with site.engine.begin() as conn:
            conn.exec_driver_sql("UPDATE console_sessions SET token_row = NULL, tenant_id = NULL")
            conn.exec_driver_sql("UPDATE portal_links SET tenant_id = NULL")
        assert _signed_out(console.get("/console/"))
        assert portal.get("/portal/endpoints").status_code == 401
        assert portal.get(unused).status_code == 401


# -- failed sign-ins are audited, boundedly --------------------------------------------------


def test_failed_sign_ins_are_audited_in_bounded_rows(site: Site) -> None:
    with httpx.Client(base_url=site.base_url) as http:
        codes = [
            http.post("/console/login", data={"token": f"obx_guess_{n}"}).status_code
            for n in range(25)
        ]
        links = [http.get(f"/portal/enter?link=obxl_guess{n}").status_code for n in range(12)]
    assert codes == [401] * 10 + [429] * 15
    assert links == [401] * 10 + [429] * 2
    refused = _refused(site.engine)
    assert [(r["actor"], r["reason"], r["details"]["count"]) for r in refused] == [
        ("anonymous", SIGN_IN_REFUSED, 10),
        ("anonymous", LINK_REFUSED, 10),
    ]
    assert all(r["details"]["client"] == "127.0.0.1" for r in refused)
    assert "obx_guess" not in str(refused)  # what was presented is never stored

    # A minute later: the next failure is written, and the 429s in between ride along.
    site.clock.advance(60)
    with httpx.Client(base_url=site.base_url) as http:
        assert http.post("/console/login", data={"token": "obx_guess"}).status_code == 401
    latest = _refused(site.engine)[2:]
    assert [(r["reason"], r["details"]["status"], r["details"]["count"]) for r in latest] == [
        (SIGN_IN_REFUSED, 401, 1),
        ("rate limited: too many calls without a valid token", 429, 15),
    ]


# -- X-Forwarded-For only from trusted proxies -----------------------------------------------

UNTRUSTED = AdminConfig(unauthenticated_per_minute=20)  # OUTBOX_TRUSTED_PROXIES empty
LOOPBACK_TRUSTED = AdminConfig(unauthenticated_per_minute=20, trusted_proxies=("127.0.0.1",))


@pytest.mark.parametrize("admin_config", [UNTRUSTED])
def test_rotating_forwarded_addresses_do_not_escape_the_login_limit(site: Site) -> None:
    attempts = 300
    with httpx.Client(base_url=site.base_url) as http:
        logins = [
            http.post(
                "/console/login",
                data={"token": "obx_nope"},
                headers={"x-forwarded-for": f"198.51.{n // 250}.{n % 250 + 1}"},
            ).status_code
            for n in range(attempts)
        ]
    # 10 a minute per client, and a loopback peer's X-Forwarded-For does not make it another.
    assert logins.count(401) == 10 and logins.count(429) == attempts - 10
    refused = _refused(site.engine)
    assert [(r["reason"], r["details"]["count"], r["details"]["client"]) for r in refused] == [
        (SIGN_IN_REFUSED, 10, "127.0.0.1")
    ]
    assert "198.51." not in str(rows(site.engine, "SELECT * FROM audit_log"))


@pytest.mark.parametrize("admin_config", [UNTRUSTED])
def test_rotating_forwarded_addresses_do_not_escape_the_anonymous_audit_bound(
    site: Site,
) -> None:
    with httpx.Client(base_url=site.base_url) as http:
        calls = [
            http.get(
                "/v1/deliveries", headers={"x-forwarded-for": f"203.0.113.{n % 250 + 1}"}
            ).status_code
            for n in range(100)
        ]
    # 20 calls a minute without a token (set here), then 429 and nothing written.
    assert calls.count(401) == 20 and calls.count(429) == 80
    refused = _refused(site.engine)
    # One row, under the real peer; the spoofed addresses are stored nowhere.
    assert [(r["reason"], r["details"]["count"], r["details"]["client"]) for r in refused] == [
        ("no bearer token", 20, "127.0.0.1")
    ]
    assert "203.0.113." not in str(rows(site.engine, "SELECT * FROM audit_log"))


@pytest.mark.parametrize("admin_config", [LOOPBACK_TRUSTED])
def test_a_trusted_proxy_s_forwarded_address_is_the_client(site: Site) -> None:
    with httpx.Client(base_url=site.base_url) as http:

        def login(forwarded: str) -> int:
            headers = {"x-forwarded-for": forwarded}
            return http.post("/console/login", data={"token": "obx_x"}, headers=headers).status_code

        # Each forwarded client has its own limit: 12 tries each, 10 pass.
        codes = [login(f"192.0.2.{n % 3 + 1}") for n in range(36)]
        # The rightmost address that is not a trusted proxy is the client: what a client
        # wrote to the left of it is ignored, and the trusted hop to its right skipped.
        assert login("192.0.2.1, 198.51.100.7") == 401
        assert login("198.51.100.8, 127.0.0.1") == 401
        assert login("not-an-address, 198.51.100.9") == 401
        # Whatever a trusted proxy passes on is stored bounded (a proxy that forwards a
        # client's own header unchanged is misconfigured, not a way to fill the disk).
        assert login("x" * 4000) == 401
    assert codes.count(401) == 30 and codes.count(429) == 6
    clients = [r["details"]["client"] for r in _refused(site.engine)]
    assert clients == ["192.0.2.1", "192.0.2.2", "192.0.2.3", "198.51.100.7", "198.51.100.8",
                       "198.51.100.9", "x" * 63 + "…"]  # fmt: skip


@pytest.mark.parametrize("admin_config", [AdminConfig(trusted_proxies=("10.9.8.7",))])
def test_a_peer_outside_the_trusted_proxies_is_itself_the_client(site: Site) -> None:
    with httpx.Client(base_url=site.base_url) as http:
        answer = http.get("/v1/deliveries", headers={"x-forwarded-for": "192.0.2.44"})
    assert answer.status_code == 401
    assert [r["details"]["client"] for r in _refused(site.engine)] == ["127.0.0.1"]


# -- the upgrade ---------------------------------------------------------------------------


def test_sessions_and_links_stored_before_the_upgrade_open_nothing_after_it(
    empty_database_url: str,
) -> None:
    """Migration 0022 cannot know which token opened an old session: sign in again."""
    engine = make_engine(empty_database_url)
    now = dt.datetime.now(dt.UTC)
    cookies = {kind: secrets.token_urlsafe(32) for kind in ("console", "portal")}
    link = "obxl_" + secrets.token_urlsafe(32)
    try:
        upgrade(engine, "0019")
        with engine.begin() as conn:
            # The rows as the code before 0022 wrote them.
            conn.execute(text("INSERT INTO tenants (uid) VALUES ('acme')"))
            for kind, cookie in cookies.items():
                conn.execute(
                    text(
                        "INSERT INTO console_sessions (id_hash, kind, actor, role, tenant_uid,"
                        " csrf_token, expires_at) VALUES (:h, :kind, 'token:admin', 'operator',"
                        " :tenant, 'csrf', :until)"
                    ),
                    {
                        "h": hashlib.sha256(cookie.encode()).hexdigest(),
                        "kind": kind,
                        "tenant": "acme" if kind == "portal" else None,
                        "until": now + dt.timedelta(hours=8),
                    },
                )
            conn.execute(
                text(
                    "INSERT INTO portal_links (id_hash, tenant_uid, created_by, expires_at)"
                    " VALUES (:h, 'acme', 'test', :until)"
                ),
                {
                    "h": hashlib.sha256(link.encode()).hexdigest(),
                    "until": now + dt.timedelta(hours=1),
                },
            )
        upgrade(engine)
        with engine.begin() as conn:
            for kind, cookie in cookies.items():
                assert load_session(conn, cookie, kind=kind, now=now) is None, kind
            assert redeem_portal_link(conn, link, now=now) is None
            # Nothing was rewritten: the old rows are there, with no token or tenant id.
            assert (
                conn.execute(
                    text(
                        "SELECT count(*) FROM console_sessions"
                        " WHERE token_row IS NULL AND tenant_id IS NULL"
                    )
                ).scalar()
                == 2
            )
    finally:
        engine.dispose()
