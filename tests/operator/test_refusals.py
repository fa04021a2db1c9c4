"""Refused admin API calls are audited without letting anyone fill the disk.

Issue 14: 32 clients without a token wrote 6,704 audit rows (411 MB) in 15 s, each
holding the whole request path, and retention never pruned the audit log.
"""

from __future__ import annotations

import asyncio
import datetime as dt

import httpx
from click.testing import CliRunner
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.operator.api import AdminConfig, create_app
from delivery.operator.cli import main
from delivery.operator.refusals import RATE_LIMITED, UnauthenticatedLimiter, bounded
from delivery.retention import Retention, RetentionConfig
from outbox.audit import record_audit
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.tokens import create_token
from tests.helpers import rows, scalar

CLIENTS = 32
PER_CLIENT = 20
PER_MINUTE = 10  # the burst: this many 401s per client, then 429s
LONG_PATH = "/v1/deliveries/" + "A" * 10_000


def _app(async_engine: AsyncEngine, box: SecretBox, clock: ManualClock) -> object:
    config = AdminConfig(
        unauthenticated_per_minute=PER_MINUTE, refused_interval=dt.timedelta(minutes=1)
    )
    return create_app(async_engine, box, clock=clock, config=config)


async def _flood(app: object, client_no: int, requests: int) -> list[httpx.Response]:
    transport = httpx.ASGITransport(app=app, client=(f"10.0.0.{client_no}", 40000))  # type: ignore[arg-type]
    answers = []
    async with httpx.AsyncClient(transport=transport, base_url="http://admin") as http:
        for index in range(requests):
            headers = {"user-agent": "flood\x1b[31m" + "U" * 5000}
            if index % 2:
                headers["authorization"] = "Bearer obx_" + "x" * 3000
            answers.append(await http.get(LONG_PATH, headers=headers))
    return answers


async def test_32_clients_without_a_token_write_a_bounded_number_of_small_rows(
    engine: Engine, async_engine: AsyncEngine, box: SecretBox
) -> None:
    # At the start of a minute, so the intervals fall where the test expects them.
    clock = ManualClock(dt.datetime.now(dt.UTC).replace(second=0, microsecond=0))
    app = _app(async_engine, box, clock)
    results = await asyncio.gather(*(_flood(app, n, PER_CLIENT) for n in range(CLIENTS)))

    for answers in results:
        codes = [a.status_code for a in answers]
        assert codes == [401] * PER_MINUTE + [429] * (PER_CLIENT - PER_MINUTE)
        limited = answers[-1]
        # One token per 60/PER_MINUTE seconds: that is how long to wait.
        assert limited.headers["retry-after"] == str(60 // PER_MINUTE)
        assert "rate limited" in limited.json()["error"]

    refused = rows(engine, "SELECT * FROM audit_log WHERE action = 'api.refused'")
    # The bound: per client, one row per reason (no token / invalid token) per interval;
    # the 429s were not written at all yet.
    assert len(refused) <= CLIENTS * 2
    assert {r["details"]["client"] for r in refused} == {f"10.0.0.{n}" for n in range(CLIENTS)}
    assert sum(r["details"]["count"] for r in refused) == CLIENTS * PER_MINUTE
    assert max(len(r["target_id"]) for r in refused) <= 200
    assert all(r["target_id"].endswith("…") for r in refused)
    agents = [r["details"]["user_agent"] for r in refused]
    assert max(len(a) for a in agents) <= 120 and not any("\x1b" in a for a in agents)
    size = scalar(engine, "SELECT pg_total_relation_size('audit_log')")
    assert size < 1024 * 1024  # the old code wrote ~20 KB per refused request

    # Later, one more call per client: its 401 row also carries the 429s counted so far,
    # so the counts add up to every refused call without a write per 429.
    clock.advance(60 / PER_MINUTE)
    again = await asyncio.gather(*(_flood(app, n, 1) for n in range(CLIENTS)))
    assert {answers[0].status_code for answers in again} == {401}
    refused = rows(engine, "SELECT * FROM audit_log WHERE action = 'api.refused'")
    assert len(refused) <= CLIENTS * 3
    assert sum(r["details"]["count"] for r in refused) == CLIENTS * (PER_CLIENT + 1)
    limited_rows = [r for r in refused if r["reason"] == RATE_LIMITED]
    assert len(limited_rows) == CLIENTS
    assert {r["details"]["status"] for r in limited_rows} == {429}
    assert {r["details"]["count"] for r in limited_rows} == {PER_CLIENT - PER_MINUTE}

    # A new interval starts a new row instead of growing an old one without end.
    clock.advance(120)
    await _flood(app, 0, 1)
    newest = rows(
        engine, "SELECT details FROM audit_log WHERE action = 'api.refused' ORDER BY id DESC"
    )[0]
    assert newest["details"]["count"] == 1 and newest["details"]["client"] == "10.0.0.0"


async def test_a_valid_token_is_never_rate_limited_and_403s_aggregate(
    engine: Engine,
    async_engine: AsyncEngine,
    box: SecretBox,
    clock: ManualClock,
    database_url: str,
) -> None:
    app = _app(async_engine, box, clock)
    with engine.begin() as conn:
        _, viewer = create_token(conn, name="grafana", role="viewer", actor="test")
    await _flood(app, 7, PER_MINUTE + 5)  # the address is now over its limit
    transport = httpx.ASGITransport(app=app, client=("10.0.0.7", 40000))  # type: ignore[arg-type]
    async with httpx.AsyncClient(
        transport=transport,
        base_url="http://admin",
        headers={"authorization": f"Bearer {viewer}"},
    ) as http:
        for _ in range(5):
            assert (await http.get("/v1/deliveries")).status_code == 200
            assert (await http.post("/v1/discards", json={})).status_code == 403
    forbidden = rows(
        engine,
        "SELECT * FROM audit_log WHERE action = 'api.refused' AND actor = 'token:grafana'",
    )
    assert len(forbidden) == 1 and forbidden[0]["details"]["count"] == 5
    shown = CliRunner().invoke(
        main, ["audit", "--action", "api.refused"], env={"OUTBOX_DATABASE_URL": database_url}
    )
    assert shown.exit_code == 0, shown.output
    assert "api.refused x5" in shown.output


def test_the_limiter_refills_and_forgets_the_oldest_clients() -> None:
    start = dt.datetime(2026, 11, 30, tzinfo=dt.UTC)
    limiter = UnauthenticatedLimiter(60, max_clients=3)
    assert all(limiter.take("a", start) is None for _ in range(60))
    assert limiter.take("a", start) == 1.0
    assert limiter.take("a", start + dt.timedelta(seconds=1)) is None
    assert limiter.limited_since_written("a") == 1
    assert limiter.limited_since_written("a") == 0
    for name in ("b", "c", "d"):
        limiter.take(name, start)
    assert limiter.limited_since_written("a") == 0  # "a" was dropped, memory stays bounded
    assert len(limiter._buckets) == 3
    assert bounded("x\x00y" + "z" * 10, 5) == "x?yz…"


async def test_retention_prunes_the_audit_log_with_its_own_setting(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock
) -> None:
    with engine.begin() as conn:
        for age_days in (200, 100, 10):
            record_audit(conn, actor="t", action="x", target_type="t", target_id=str(age_days))
            conn.execute(
                text("UPDATE audit_log SET at = :at WHERE target_id = :id"),
                {"at": clock.now() - dt.timedelta(days=age_days), "id": str(age_days)},
            )
    # Deliveries kept for ever (retention_days=0) does not keep the audit log for ever.
    keep = RetentionConfig(retention_days=0, dead_retention_days=0, audit_retention_days=0)
    assert (await Retention(async_engine, clock, keep).run_until_done()).audit == 0
    config = RetentionConfig(retention_days=0, dead_retention_days=0, audit_retention_days=90)
    pruned = await Retention(async_engine, clock, config).run_until_done()
    assert pruned.audit == 2
    assert [r["target_id"] for r in rows(engine, "SELECT target_id FROM audit_log")] == ["10"]
