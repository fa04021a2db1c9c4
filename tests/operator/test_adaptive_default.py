"""Adaptive concurrency is the default for NEW endpoints (issue 25): every creation path
(CLI, admin API, the portal's function, the library) makes them adaptive with the default
maximum as their ceiling; an explicit fixed choice stays fixed; endpoints that existed
before keep what they had, even when their health row is only created later."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest
from click.testing import CliRunner
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.health import ensure_health_rows, get_endpoint_concurrency, get_endpoint_limits
from delivery.operator.api import create_app
from delivery.operator.cli import main
from delivery.operator.console import scoped
from delivery.operator.context import AdminConfig
from outbox.clock import ManualClock
from outbox.crypto import SecretBox, generate_key
from outbox.errors import EndpointError
from tests.helpers import add_endpoint, rows
from tests.operator_helpers import token


@pytest.fixture
def cli(database_url: str, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    monkeypatch.setenv("OUTBOX_SECRET_KEYS", generate_key("cli"))
    monkeypatch.delenv("OUTBOX_ENV_FILE", raising=False)
    monkeypatch.delenv("OUTBOX_ADAPTIVE_DEFAULT_MAX", raising=False)
    return CliRunner()


@pytest.fixture
async def http(
    engine: Engine, async_engine: AsyncEngine, box: SecretBox, clock: ManualClock
) -> AsyncIterator[httpx.AsyncClient]:
    # a default maximum other than the built-in one: the API must report the configured one
    config = AdminConfig(adaptive_default_max=8)
    app = create_app(async_engine, box, clock=clock, config=config)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://admin",
        headers=token(engine, "operator"),
    ) as client:
        yield client


def mode(engine: Engine, uid: str) -> tuple[bool, int | None]:
    with engine.connect() as conn:
        limits = get_endpoint_limits(conn, uid)
    return limits.adaptive, limits.max_in_flight


def test_the_cli_adds_adaptive_endpoints_unless_told_fixed(cli: CliRunner, engine: Engine) -> None:
    added = cli.invoke(
        main, ["endpoints", "add", "https://example.com/a", "--events", "*", "--json"]
    )
    assert added.exit_code == 0, added.output
    adaptive = json.loads(added.output)["id"]
    assert mode(engine, adaptive) == (True, None)  # no ceiling of its own: the default
    shown = cli.invoke(main, ["endpoints", "health"])
    assert "adaptive limit - of 100" in shown.output, shown.output
    fixed = cli.invoke(
        main,
        ["endpoints", "add", "https://example.com/f", "--events", "*", "--concurrency", "fixed"],
    )
    assert fixed.exit_code == 0, fixed.output
    (fixed_uid,) = [
        r["uid"] for r in rows(engine, "SELECT uid FROM endpoints WHERE url LIKE '%/f'")
    ]
    assert mode(engine, fixed_uid) == (False, None)
    # a fixed endpoint gets no health row at all, as every endpoint did before
    assert rows(
        engine, "SELECT e.uid FROM endpoint_health h JOIN endpoints e ON e.id = h.endpoint_id"
    ) == [{"uid": adaptive}]
    for hostile in ("ADAPTIVE", "adaptiv", "", "fixed;drop"):
        refused = cli.invoke(
            main,
            [
                "endpoints",
                "add",
                "https://example.com/x",
                "--events",
                "*",
                "--concurrency",
                hostile,
            ],
        )
        assert refused.exit_code != 0 and "--concurrency" in refused.output, refused.output
    assert rows(engine, "SELECT count(*) AS n FROM endpoints") == [{"n": 2}]


async def test_the_api_adds_adaptive_endpoints_unless_told_fixed(
    http: httpx.AsyncClient, engine: Engine
) -> None:
    made = await http.post(
        "/v1/endpoints", json={"url": "https://example.com/a", "event_types": "*"}
    )
    assert made.status_code in (200, 201), made.text
    uid = made.json()["id"]
    concurrency = (await http.get(f"/v1/endpoints/{uid}/concurrency")).json()
    # the configured default maximum (8 here) is its ceiling; the limiter starts at 4
    assert (concurrency["mode"], concurrency["max_in_flight"], concurrency["limit"]) == (
        "adaptive",
        8,
        4,
    )
    audit = rows(engine, "SELECT details FROM audit_log WHERE action = 'endpoint.create'")
    assert audit[-1]["details"]["concurrency"] == "adaptive"
    fixed = await http.post(
        "/v1/endpoints",
        json={"url": "https://example.com/f", "event_types": "*", "concurrency": "fixed"},
    )
    assert fixed.status_code in (200, 201), fixed.text
    fixed_uid = fixed.json()["id"]
    shown = (await http.get(f"/v1/endpoints/{fixed_uid}/concurrency")).json()
    assert (shown["mode"], shown["max_in_flight"], shown["limit"]) == ("fixed", None, None)
    for hostile in ("ADAPTIVE", "", None, 1, True, ["adaptive"]):
        refused = await http.post(
            "/v1/endpoints",
            json={"url": "https://example.com/x", "event_types": "*", "concurrency": hostile},
        )
        assert refused.status_code == 400 and "concurrency" in refused.json()["error"], hostile
    assert rows(engine, "SELECT count(*) AS n FROM endpoints") == [{"n": 2}]
    # opting a fixed endpoint in without a maximum: the default maximum is its ceiling
    opted = await http.patch(f"/v1/endpoints/{fixed_uid}/concurrency", json={"mode": "adaptive"})
    assert opted.status_code == 200, opted.text
    assert (opted.json()["mode"], opted.json()["max_in_flight"]) == ("adaptive", 8)


def test_the_portal_and_the_library_add_adaptive_endpoints_unless_told_fixed(
    engine: Engine, box: SecretBox
) -> None:
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO tenants (uid) VALUES ('acme')"))
        portal = scoped.add_endpoint(
            conn,
            box,
            "acme",
            actor="portal:acme",
            url="https://acme.example/a",
            event_types=["*"],
            description="",
            https_only=False,
        ).endpoint.uid
        portal_fixed = scoped.add_endpoint(
            conn,
            box,
            "acme",
            actor="portal:acme",
            url="https://acme.example/f",
            event_types=["*"],
            description="",
            https_only=False,
            concurrency="fixed",
        ).endpoint.uid
        with pytest.raises(EndpointError, match=r"'adaptive' .* or 'fixed'"):
            scoped.add_endpoint(
                conn,
                box,
                "acme",
                actor="portal:acme",
                url="https://acme.example/x",
                event_types=["*"],
                description="",
                https_only=False,
                concurrency="ADAPTIVE",
            )
    library = add_endpoint(engine, box, "https://example.com/l", concurrency="adaptive")
    assert mode(engine, portal) == (True, None)
    assert mode(engine, library.endpoint.uid) == (True, None)
    assert mode(engine, portal_fixed) == (False, None)
    with engine.connect() as conn:
        shown = get_endpoint_concurrency(conn, portal, scope="acme", default_maximum=12)
    assert (shown.mode, shown.max_in_flight, shown.limit) == ("adaptive", 12, 4)


async def test_endpoints_from_before_the_default_stay_fixed_when_their_health_row_comes(
    engine: Engine, async_engine: AsyncEngine, box: SecretBox
) -> None:
    """An endpoint created before this release has no health row (as a fixed one now);
    its first failure creates one (ensure_health_rows), which must not make it adaptive:
    that is why the column's default stays false and no migration changes it."""
    old = add_endpoint(engine, box, "https://example.com/old", concurrency="fixed").endpoint
    assert rows(engine, "SELECT * FROM endpoint_health") == []
    await ensure_health_rows(async_engine, [old.id], set())
    assert rows(engine, "SELECT adaptive FROM endpoint_health") == [{"adaptive": False}]
    assert mode(engine, old.uid) == (False, None)
