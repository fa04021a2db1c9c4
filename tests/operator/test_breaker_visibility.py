"""An endpoint's circuit breaker is visible wherever an operator looks, and agrees with the row.

The breaker is driven for real (a receiver on 127.0.0.1 answering 503, a Worker on a
manual clock, as in tests/delivery/test_health.py), then read back through `collect_stats`, the
CLI (`outbox stats`, `outbox endpoints status`, text and --json), the admin API
(`GET /v1/endpoints`, `GET /v1/stats`) and the parsed `/metrics`. Each view must report
what `endpoint_health` holds: no view computes a breaker state of its own.

The CLI reads the real clock (SystemClock) while the rest read the manual one, which
starts at the real time; so the CLI is checked on the stored columns, and the derived
`paused` / `cooldown_remaining_seconds` only where the manual clock is used.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.http import build_http_client
from delivery.operator.api import create_app, openapi_document
from delivery.operator.cli import main
from delivery.receiver import Receiver
from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.stats import collect_stats
from tests.delivery.workers import HEALTH, breaker, relay_all, worker
from tests.helpers import LOOPBACK, add_endpoint, rows
from tests.operator_helpers import token

# The stored columns every view repeats as they are.
STORED = (
    "opened_at",
    "open_until",
    "probe_until",
    "paused_until",
    "consecutive_failures",
    "trips",
)


@pytest.fixture
def cli(database_url: str, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    monkeypatch.delenv("OUTBOX_ENV_FILE", raising=False)
    return CliRunner()


@pytest.fixture
async def api(
    async_engine: AsyncEngine, box: SecretBox, clock: ManualClock
) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(async_engine, box, clock=clock)
    transport = httpx.ASGITransport(app=app, client=("10.1.2.3", 4567))
    async with httpx.AsyncClient(transport=transport, base_url="http://admin") as http:
        yield http


def stored_breaker(engine: Engine, uid: str) -> dict[str, Any]:
    """The endpoint_health row's breaker columns (the truth every view must repeat).

    A healthy endpoint may have no row at all (the happy path writes nothing): that is
    a closed breaker with no history, as delivery/health.py reads it.
    """
    (row,) = rows(
        engine,
        "SELECT COALESCE(h.breaker_state, 'closed') AS state, h.opened_at, h.open_until,"
        " h.probe_until, h.paused_until,"
        " COALESCE(h.consecutive_failures, 0) AS consecutive_failures,"
        " COALESCE(h.trips, 0) AS trips"
        " FROM endpoints e LEFT JOIN endpoint_health h ON h.endpoint_id = e.id"
        " WHERE e.uid = :uid",
        uid=uid,
    )
    return dict(row)


def as_stored(block: dict[str, Any]) -> dict[str, Any]:
    """A view's breaker block with its timestamps parsed back, to compare with the row."""
    return {
        key: dt.datetime.fromisoformat(block[key]) if key.endswith(("_at", "_until")) and block[key]
        else block[key]
        for key in ("state", *STORED)
    }  # fmt: skip


def cli_json(cli: CliRunner, *args: str) -> Any:
    result = cli.invoke(main, [*args, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def cli_text(cli: CliRunner, *args: str) -> str:
    result = cli.invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def line_of(output: str, uid: str) -> str:
    (line,) = [line for line in output.splitlines() if line.startswith(uid)]
    return line


async def metric_samples(api: httpx.AsyncClient, headers: dict[str, str]) -> dict[Any, float]:
    answer = await api.get("/metrics", headers=headers)
    assert answer.status_code == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(answer.text)
        for s in family.samples
    }


def enum(samples: dict[Any, float], uid: str) -> dict[str, float]:
    return {
        state: samples[
            ("outbox_endpoint_breaker_state", (("endpoint", uid), ("state", state)))
        ]
        for state in ("closed", "open", "half_open")
    }  # fmt: skip


def alert(samples: dict[Any, float], kind: str) -> float:
    return samples[(f"outbox_alert_{kind}", (("alert", "endpoint_breaker_open"),))]


async def check_every_view(
    *,
    engine: Engine,
    clock: ManualClock,
    cli: CliRunner,
    api: httpx.AsyncClient,
    viewer: dict[str, str],
    uids: dict[str, str],
    expected: dict[str, str],
    paused: dict[str, bool],
) -> None:
    """Every view reports `expected` (name -> breaker state) and repeats the stored row."""
    stored = {name: stored_breaker(engine, uid) for name, uid in uids.items()}
    assert {name: row["state"] for name, row in stored.items()} == expected
    counts = {state: list(expected.values()).count(state) for state in ("closed", "open")}
    counts["half_open"] = 0
    open_now = counts["open"]

    # collect_stats, on the manual clock.
    with engine.connect() as conn:
        stats = collect_stats(conn, now=clock.now())
    by_uid = {e.uid: e for e in stats.endpoints}
    for name, uid in uids.items():
        block = by_uid[uid].breaker.as_json()
        assert as_stored(block) == stored[name]
        assert block["paused"] is paused[name]
        until = stored[name]["open_until"]
        assert block["cooldown_remaining_seconds"] == (
            (until - clock.now()).total_seconds() if expected[name] == "open" else None
        )
    assert stats.breaker_counts == counts
    (signal,) = [a for a in stats.alerts if a.name == "endpoint_breaker_open"]
    assert (signal.firing, signal.value) == (open_now > 0, open_now)

    # `outbox stats --json` and `outbox endpoints status --json`.
    snapshot = cli_json(cli, "stats")
    assert snapshot["breakers"] == counts
    cli_alert = [a for a in snapshot["alerts"] if a["name"] == "endpoint_breaker_open"]
    assert [(a["firing"], a["value"]) for a in cli_alert] == [(open_now > 0, open_now)]
    status = {item["uid"]: item["breaker"] for item in cli_json(cli, "endpoints", "status")}
    from_stats = {item["uid"]: item["breaker"] for item in snapshot["endpoints"]}
    for name, uid in uids.items():
        assert as_stored(status[uid]) == as_stored(from_stats[uid]) == stored[name]

    # The text of `outbox stats` and `outbox endpoints status`.
    text = cli_text(cli, "stats")
    assert f"breakers:    closed {counts['closed']}  open {open_now}  half_open 0" in text
    assert ("! endpoint_breaker_open" in text) is (open_now > 0)
    table = cli_text(cli, "endpoints", "status")
    assert "BREAKER" in table.splitlines()[0]
    for name, uid in uids.items():
        for output in (table, text):
            cell = line_of(output, uid).split()[2]
            assert cell.rstrip(",") == expected[name]
        assert ("paused by 429 until" in line_of(table, uid)) is paused[name]
        if expected[name] == "open":
            opened = stored[name]["opened_at"].astimezone(dt.UTC).strftime("%H:%M:%SZ")
            assert f"open (since {opened}, probe in" in line_of(table, uid)

    # The admin API: GET /v1/endpoints carries the same block as GET /v1/stats.
    listed = await api.get("/v1/endpoints", headers=viewer)
    assert listed.status_code == 200
    items = {item["id"]: item for item in listed.json()["items"]}
    api_stats = (await api.get("/v1/stats", headers=viewer)).json()
    api_by_uid = {item["uid"]: item["breaker"] for item in api_stats["endpoints"]}
    assert api_stats["breakers"] == counts
    for name, uid in uids.items():
        assert items[uid]["breaker"] == api_by_uid[uid] == by_uid[uid].breaker.as_json()
        assert as_stored(items[uid]["breaker"]) == stored[name]
        assert "breaker" not in items[uid]["health"]

    # /metrics, parsed.
    samples = await metric_samples(api, viewer)
    for name, uid in uids.items():
        assert enum(samples, uid) == {
            state: 1.0 if state == expected[name] else 0.0
            for state in ("closed", "open", "half_open")
        }
        endpoint = (("endpoint", uid),)
        assert samples[("outbox_endpoint_paused", endpoint)] == (1.0 if paused[name] else 0.0)
    assert samples[("outbox_endpoint_breaker_open", ())] == open_now
    assert (alert(samples, "firing"), alert(samples, "value")) == (float(open_now > 0), open_now)


async def test_an_open_breaker_shows_in_stats_cli_api_and_metrics_until_a_probe_closes_it(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    cli: CliRunner,
    api: httpx.AsyncClient,
) -> None:
    uids = {
        "down": add_endpoint(engine, box, receiver.route("/down", status=503), "order.*"),
        "healthy": add_endpoint(engine, box, receiver.route("/ok"), "order.*"),
        "throttled": add_endpoint(
            engine,
            box,
            receiver.route("/throttled", status=429, headers={"Retry-After": "30"}),
            "throttle.*",
        ),
    }
    uid = {name: created.endpoint.uid for name, created in uids.items()}
    viewer = token(engine, "viewer")
    with engine.begin() as conn:
        for i in range(HEALTH.failure_threshold):
            publish(conn, "order.created", {"i": i})
        publish(conn, "throttle.ping", {"i": 0})
    await relay_all(async_engine, clock)

    async with build_http_client(max_connections=20, timeout=5, allowed_networks=LOOPBACK) as http:
        w = worker(async_engine, http, box, clock, batch_size=20)
        await w.run_once()  # three 503s in a row: the threshold; the 429 pauses its endpoint
        assert len(receiver.received("/down")) == HEALTH.failure_threshold
        assert breaker(engine, uid["down"]) == "open"
        await check_every_view(
            engine=engine,
            clock=clock,
            cli=cli,
            api=api,
            viewer=viewer,
            uids=uid,
            expected={"down": "open", "healthy": "closed", "throttled": "closed"},
            paused={"down": False, "healthy": False, "throttled": True},
        )
        opened_at = stored_breaker(engine, uid["down"])["opened_at"]

        # The receiver recovers; after the cooldown one probe is claimed and closes it.
        receiver.route("/down", status=200)
        clock.advance(HEALTH.cooldown_seconds)
        assert (await w.run_once()).claimed == 1  # the probe (the paused endpoint waits)
        assert breaker(engine, uid["down"]) == "closed"
        await check_every_view(
            engine=engine,
            clock=clock,
            cli=cli,
            api=api,
            viewer=viewer,
            uids=uid,
            expected={"down": "closed", "healthy": "closed", "throttled": "closed"},
            paused={"down": False, "healthy": False, "throttled": True},
        )
    # Closing keeps the time it last opened (the row does; the views repeat it).
    assert stored_breaker(engine, uid["down"])["opened_at"] == opened_at


async def test_the_breaker_signal_ignores_disabled_endpoints_and_the_openapi_document_builds(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    api: httpx.AsyncClient,
) -> None:
    down = add_endpoint(engine, box, receiver.route("/down", status=503), "order.*").endpoint.uid
    with engine.begin() as conn:
        for i in range(HEALTH.failure_threshold):
            publish(conn, "order.created", {"i": i})
    await relay_all(async_engine, clock)
    async with build_http_client(max_connections=20, timeout=5, allowed_networks=LOOPBACK) as http:
        await worker(async_engine, http, box, clock, batch_size=20).run_once()
    assert breaker(engine, down) == "open"
    operator = token(engine, "operator")
    answer = await api.post(
        f"/v1/endpoints/{down}/disable", headers=operator, json={"reason": "partner outage"}
    )
    assert answer.status_code == 200, answer.text
    with engine.connect() as conn:
        stats = collect_stats(conn, now=clock.now())
    # Disabling leaves the breaker as it was (nothing probes a disabled endpoint): it is
    # still reported, but it no longer fires the signal, which would never clear.
    assert stats.breaker_counts == {"closed": 0, "open": 1, "half_open": 0}
    (signal,) = [a for a in stats.alerts if a.name == "endpoint_breaker_open"]
    assert (signal.firing, signal.value) == (False, 0)

    document = (await api.get("/openapi.json")).json()
    assert document == openapi_document()
    assert "breaker" in document["paths"]["/v1/endpoints"]["get"]["summary"]
