"""Adaptive concurrency per endpoint (AIMD): the pure limiter's properties, then the limit
shared through the database across two worker processes, on real receivers."""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import json
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.health import EndpointLimits, HealthConfig, save, set_endpoint_limits
from delivery.health.adaptive import AdaptiveConfig, Limiter, Signals, next_limit
from delivery.health.rules import Health, Observation, after_outcomes, summarize
from delivery.http import build_http_client
from delivery.operator.api import create_app
from delivery.operator.cli import main
from delivery.policy import Outcome
from delivery.receiver import Behaviour, ReceivedRequest, Receiver
from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.db import make_async_engine
from tests.delivery.test_health import run_until
from tests.delivery.workers import relay_all, worker
from tests.helpers import LOOPBACK, add_endpoint, scalar
from tests.operator_helpers import token

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
CONFIG = AdaptiveConfig(algorithm="aimd")  # the gradient: test_adaptive_gradient.py

signals = st.builds(
    Signals,
    overloaded=st.integers(0, 5),
    answered=st.integers(0, 50),
    fastest_ms=st.none() | st.floats(0, 10_000),
    slowest_ms=st.none() | st.floats(0, 10_000),
)
states = st.builds(
    Limiter,
    limit=st.integers(-5, 10_000),
    baseline_ms=st.none() | st.floats(0, 10_000),
    window_at=st.none()
    | st.integers(-10_000, 10_000).map(lambda ms: T0 + dt.timedelta(milliseconds=ms)),
)
maxima = st.integers(-3, 500)
later = st.integers(0, 10_000).map(lambda ms: T0 + dt.timedelta(milliseconds=ms))


@given(states, signals, maxima, later)
def test_limit_stays_between_one_and_the_configured_maximum(
    state: Limiter, signal: Signals, maximum: int, now: dt.datetime
) -> None:
    after = next_limit(state, signal, maximum=maximum, now=now, config=CONFIG)
    assert 1 <= after.limit <= max(1, maximum)


@given(states, signals, maxima, later)
def test_every_overload_shrinks_the_limit_unless_it_just_shrank(
    state: Limiter, signal: Signals, maximum: int, now: dt.datetime
) -> None:
    overloaded = Signals(signal.overloaded + 1, signal.answered, signal.fastest_ms)
    before = min(max(1, state.limit), max(1, maximum))
    after = next_limit(state, overloaded, maximum=maximum, now=now, config=CONFIG)
    holding = state.window_at is not None and now < state.window_at
    if holding:
        assert after.limit == before  # one decrease per window, never a growth
    else:
        assert after.limit < before or after.limit == 1
        assert after.window_at is not None and after.window_at > now  # the hold starts


def test_a_burst_of_429s_shrinks_once_per_window() -> None:
    state = Limiter(20)
    burst = Signals(overloaded=3)
    for ms in (0, 100, 200, 400):
        state = next_limit(
            state, burst, maximum=32, now=T0 + dt.timedelta(milliseconds=ms), config=CONFIG
        )
    assert state.limit == 14
    state = next_limit(state, burst, maximum=32, now=T0 + dt.timedelta(seconds=0.6), config=CONFIG)
    assert state.limit == 9


@given(st.lists(st.tuples(signals, st.integers(0, 2_000)), max_size=40), st.integers(1, 200))
def test_the_limit_grows_by_at_most_one_per_window(
    batches: list[tuple[Signals, int]], maximum: int
) -> None:
    state, now = Limiter(1), T0
    grown_at: list[dt.datetime] = []
    for signal, step_ms in batches:
        now += dt.timedelta(milliseconds=step_ms)
        after = next_limit(state, signal, maximum=maximum, now=now, config=CONFIG)
        assert after.limit <= state.limit + 1
        if after.limit > state.limit:
            grown_at.append(now)
        state = after
    window = dt.timedelta(seconds=CONFIG.window_seconds)
    assert all(b - a >= window for a, b in itertools.pairwise(grown_at))
    assert len(grown_at) <= 1 + (now - T0) / window


def test_it_grows_near_its_baseline_and_shrinks_when_latency_rises() -> None:
    state = Limiter(4)
    fast = Signals(answered=5, fastest_ms=100, slowest_ms=120)
    state = next_limit(state, fast, maximum=10, now=T0, config=CONFIG)
    assert (state.limit, state.baseline_ms) == (5, 100)
    # within the window: no growth yet
    state = next_limit(state, fast, maximum=10, now=T0 + dt.timedelta(seconds=0.1), config=CONFIG)
    assert state.limit == 5
    state = next_limit(state, fast, maximum=10, now=T0 + dt.timedelta(seconds=1), config=CONFIG)
    assert state.limit == 6
    slow = Signals(answered=5, fastest_ms=110, slowest_ms=400)  # 4x its unloaded latency
    state = next_limit(state, slow, maximum=10, now=T0 + dt.timedelta(seconds=2), config=CONFIG)
    assert state.limit == 4
    # held: no growth one window on, growth again after two
    state = next_limit(state, fast, maximum=10, now=T0 + dt.timedelta(seconds=2.5), config=CONFIG)
    assert state.limit == 4
    state = next_limit(state, fast, maximum=10, now=T0 + dt.timedelta(seconds=3), config=CONFIG)
    assert state.limit == 5


def observation(status: int | None, *, retry_after: float | None = None) -> Observation:
    outcome = Outcome.SUCCEEDED if status == 200 else Outcome.RETRYABLE
    return Observation(1, outcome, status, retry_after, None if status else "timed out", 50)


@pytest.mark.parametrize("status", [429, 503, None])
def test_429_503_and_timeouts_count_as_overload(status: int | None) -> None:
    summary = summarize([observation(200), observation(status)], HealthConfig())[1]
    assert summary.adaptive.overloaded == 1 and summary.adaptive.answered == 1


def test_an_adaptive_endpoint_shrinks_on_429_instead_of_pausing_unless_told_how_long() -> None:
    config = HealthConfig()
    health = Health(1, max_in_flight=10, adaptive=True, adaptive_limit=10)
    plain = after_outcomes(health, summarize([observation(429)], config)[1], now=T0, config=config)
    assert plain.adaptive_limit == 7 and plain.paused_until is None
    told = summarize([observation(429, retry_after=30)], config)[1]
    paused = after_outcomes(health, told, now=T0, config=config)
    assert paused.paused_until == T0 + dt.timedelta(seconds=30)
    fixed = Health(1, max_in_flight=10)
    assert after_outcomes(fixed, told, now=T0, config=config).adaptive_limit is None


def make_adaptive(engine: Engine, uid: str, maximum: int, **state: Any) -> None:
    with engine.begin() as conn:
        set_endpoint_limits(
            conn, uid, EndpointLimits(max_in_flight=maximum, adaptive=True), actor="test"
        )
    if state:
        sets = ", ".join(f"{key} = :{key}" for key in state)
        with engine.begin() as conn:
            conn.execute(text(f"UPDATE endpoint_health SET {sets}"), state)


async def test_two_workers_share_the_adaptive_limit_not_the_maximum(
    engine: Engine, database_url: str, clock: ManualClock, box: SecretBox, receiver: Receiver
) -> None:
    current, peak = 0, 0

    async def slow(_: ReceivedRequest) -> Behaviour:
        nonlocal current, peak
        current += 1
        peak = max(peak, current)
        await asyncio.sleep(0.1)  # long enough that the limit is reached, slow machine or not
        current -= 1
        return Behaviour(status=200)

    uid = add_endpoint(engine, box, receiver.route("/adaptive", slow)).endpoint.uid
    # The limiter stands at 2 and its window just started: the frozen clock never lets it grow.
    make_adaptive(engine, uid, 20, adaptive_limit=2, adaptive_window_at=clock.now())
    with engine.begin() as conn:
        for i in range(30):
            publish(conn, "order.created", {"i": i})
    engines = [make_async_engine(database_url) for _ in range(2)]
    try:
        await relay_all(engines[0], clock)
        async with build_http_client(
            max_connections=50, timeout=5, allowed_networks=LOOPBACK
        ) as http:
            workers = [
                worker(e, http, box, clock, batch_size=10, max_in_flight=40, poll_interval=0.01)
                for e in engines
            ]
            await run_until(workers, lambda: sum(w.stats.succeeded for w in workers) == 30)
    finally:
        for e in engines:
            await e.dispose()
    assert peak == 2
    assert scalar(engine, "SELECT adaptive_limit FROM endpoint_health") == 2
    assert scalar(engine, "SELECT latency_baseline_ms FROM endpoint_health") >= 100


async def test_429s_bring_the_limit_down_to_one_without_a_pause(
    engine: Engine, database_url: str, clock: ManualClock, box: SecretBox, receiver: Receiver
) -> None:
    uid = add_endpoint(
        engine, box, receiver.route("/busy", lambda _: Behaviour(status=429))
    ).endpoint.uid
    make_adaptive(engine, uid, 8, adaptive_limit=8)
    with engine.begin() as conn:
        for i in range(40):
            publish(conn, "order.created", {"i": i})
    engines = [make_async_engine(database_url) for _ in range(2)]

    seen: list[int] = []

    def down_to_one() -> bool:
        """Each look moves the clock past the limiter's hold (and the 429s' retry delay)."""
        limit = int(scalar(engine, "SELECT adaptive_limit FROM endpoint_health"))
        if not seen or seen[-1] != limit:
            seen.append(limit)
        clock.advance(1.5)
        return limit == 1

    try:
        await relay_all(engines[0], clock)
        async with build_http_client(
            max_connections=50, timeout=5, allowed_networks=LOOPBACK
        ) as http:
            workers = [
                worker(e, http, box, clock, batch_size=4, max_in_flight=40, poll_interval=0.01)
                for e in engines
            ]
            await run_until(workers, down_to_one)
    finally:
        for e in engines:
            await e.dispose()
    # 0.7x per window (a look may miss a step), never a growth, never a pause
    assert seen == sorted(set(seen), reverse=True) and set(seen) <= {8, 5, 3, 2, 1}
    assert scalar(engine, "SELECT paused_until FROM endpoint_health") is None


@pytest.fixture
def cli(database_url: str, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    monkeypatch.delenv("OUTBOX_ENV_FILE", raising=False)
    return CliRunner()


def test_the_cli_opts_in_with_or_without_a_ceiling_and_shows_the_limit(
    cli: CliRunner, engine: Engine, box: SecretBox
) -> None:
    uid = add_endpoint(engine, box, "http://127.0.0.1:9/hook").endpoint.uid
    # without a maximum of its own, the default maximum (OUTBOX_ADAPTIVE_DEFAULT_MAX) is
    # its ceiling (this once refused: a ceiling was required)
    unbounded = cli.invoke(main, ["endpoints", "limits", uid, "--concurrency", "adaptive"])
    assert unbounded.exit_code == 0, unbounded.output
    assert "adaptive limit - of 100" in cli.invoke(main, ["endpoints", "health"]).output
    shown_limits = cli.invoke(main, ["endpoints", "limits", uid]).output
    assert "100 (default)" in shown_limits and "adaptive" in shown_limits, shown_limits
    for hostile in ("adaptiv", "ADAPTIVE", ""):
        wrong = cli.invoke(main, ["endpoints", "limits", uid, "--concurrency", hostile])
        assert wrong.exit_code != 0
    huge = cli.invoke(main, ["endpoints", "limits", uid, "--max-in-flight", str(10**12)])
    assert huge.exit_code == 1 and "more than 100,000" in huge.output, huge.output
    opted = cli.invoke(
        main,
        [
            "endpoints",
            "limits",
            uid,
            "--concurrency",
            "adaptive",
            "--max-in-flight",
            "16",
            "--json",
        ],
    )
    assert opted.exit_code == 0, opted.output
    assert json.loads(opted.output)["adaptive"] is True
    shown = cli.invoke(main, ["endpoints", "health"])
    assert "adaptive limit - of 16" in shown.output
    back = cli.invoke(main, ["endpoints", "limits", uid, "--concurrency", "fixed", "--json"])
    assert json.loads(back.output)["adaptive"] is False


async def test_metrics_export_the_adaptive_limit_of_opted_in_endpoints_only(
    engine: Engine, async_engine: AsyncEngine, box: SecretBox, clock: ManualClock
) -> None:
    adaptive = add_endpoint(engine, box, "http://127.0.0.1:9/a").endpoint.uid
    fixed = add_endpoint(engine, box, "http://127.0.0.1:9/f").endpoint.uid
    make_adaptive(engine, adaptive, 16, adaptive_limit=7)
    with engine.begin() as conn:
        set_endpoint_limits(conn, fixed, EndpointLimits(max_in_flight=5), actor="test")
    app = create_app(async_engine, box, clock=clock)
    transport = httpx.ASGITransport(app=app, client=("10.1.2.3", 4567))
    async with httpx.AsyncClient(transport=transport, base_url="http://admin") as http:
        answer = await http.get("/metrics", headers=token(engine, "viewer"))
    assert answer.status_code == 200
    limits = {
        s.labels["endpoint"]: s.value
        for family in text_string_to_metric_families(answer.text)
        for s in family.samples
        if s.name == "outbox_endpoint_concurrency_limit"
    }
    assert limits == {adaptive: 7.0}


async def test_the_console_endpoint_page_shows_the_adaptive_limit(
    engine: Engine, async_engine: AsyncEngine, box: SecretBox, clock: ManualClock
) -> None:
    uid = add_endpoint(engine, box, "http://127.0.0.1:9/a").endpoint.uid
    make_adaptive(engine, uid, 16, adaptive_limit=7)
    secret = token(engine, "viewer")["authorization"].removeprefix("Bearer ")
    app = create_app(async_engine, box, clock=clock)
    transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 4567))
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
        signed_in = await http.post("/console/login", data={"token": secret})
        assert signed_in.status_code == 303, signed_in.text
        page = await http.get(f"/console/endpoints/{uid}")
    assert page.status_code == 200
    assert "adaptive: limit 7 of 16 in flight" in page.text


async def test_one_outcome_batch_saves_whole_and_fractional_latencies_of_several_endpoints(
    engine: Engine, async_engine: AsyncEngine, box: SecretBox, clock: ManualClock
) -> None:
    """Two adaptive endpoints in one outcome batch: one's first latency is whole
    milliseconds (an int), the other's baseline has drifted to a fraction; both are saved
    in one statement (psycopg refuses a list mixing int and float)."""
    ids = [
        add_endpoint(engine, box, f"http://127.0.0.1:9/{n}", concurrency="adaptive").endpoint.id
        for n in range(2)
    ]
    async with async_engine.begin() as conn:
        await save(
            conn,
            [
                Health(ids[0], adaptive=True, adaptive_limit=4, latency_baseline_ms=12),
                Health(ids[1], adaptive=True, adaptive_limit=5, latency_baseline_ms=12.5),
            ],
            now=clock.now(),
        )
    saved = scalar(
        engine, "SELECT array_agg(latency_baseline_ms ORDER BY endpoint_id) FROM endpoint_health"
    )
    assert saved == [12.0, 12.5]
