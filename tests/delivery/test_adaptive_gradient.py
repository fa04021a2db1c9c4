"""The gradient limiter (delivery/health/adaptive.py) as pure logic on a manual clock:
against a modelled partner whose latency grows past N concurrent requests it settles
between N and 2N, climbs again when the partner's capacity doubles, and shrinks on
overload like AIMD; then once through a real worker, for the state it keeps."""

from __future__ import annotations

import datetime as dt

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.health import EndpointLimits, set_endpoint_limits
from delivery.health.adaptive import AdaptiveConfig, Limiter, Signals, next_limit
from delivery.health.rules import Health, HealthConfig, Observation, after_outcomes, summarize
from delivery.operator.app import health_config
from delivery.policy import Outcome
from delivery.receiver import Behaviour, Receiver
from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.errors import ConfigurationError
from outbox.settings import load_settings
from tests.delivery.workers import relay_all, worker
from tests.helpers import add_endpoint, rows

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
GRADIENT = AdaptiveConfig(algorithm="gradient")
BASE_MS = 200.0


def answers(latency_ms: float, count: int = 4) -> Signals:
    return Signals(
        answered=count,
        fastest_ms=latency_ms,
        slowest_ms=latency_ms,
        total_ms=latency_ms * count,
        timed=count,
    )


def partner_latency(limit: int, capacity: int) -> float:
    """The bench's partner: flat up to `capacity` concurrent, slower in proportion past it."""
    return BASE_MS * max(1.0, limit / capacity)


def run(
    state: Limiter, clock: ManualClock, capacity: int, seconds: float, step: float = 0.05
) -> list[int]:
    """Feed the limiter the partner's answers at its own limit every `step` seconds."""
    limits = []
    for _ in range(round(seconds / step)):
        clock.advance(step)
        latency = partner_latency(state.limit, capacity)
        state = next_limit(state, answers(latency), maximum=64, now=clock.now(), config=GRADIENT)
        limits.append(state.limit)
    return limits


def test_it_settles_past_the_knee_below_twice_it_and_follows_a_doubled_capacity() -> None:
    clock = ManualClock(T0)
    limits = run(Limiter(4), clock, capacity=8, seconds=10)
    settled = limits[-40:]  # the last two seconds
    assert all(8 <= limit < 16 for limit in settled), settled  # full rate, no 429 (> 2N)
    state = Limiter(limits[-1], BASE_MS, clock.now(), float(limits[-1]))
    doubled = run(state, clock, capacity=16, seconds=10)
    reached = next(i for i, limit in enumerate(doubled) if limit >= 16)
    assert reached * 0.05 <= 5.0  # full rate again within five seconds
    assert all(16 <= limit < 32 for limit in doubled[-40:])


def test_small_steps_add_up_through_the_estimate() -> None:
    """Batches every 10 ms move the limit by a fraction each: the fraction is kept."""
    clock = ManualClock(T0)
    state = Limiter(4, BASE_MS, T0, 4.0)
    for _ in range(100):  # one second
        clock.advance(0.01)
        state = next_limit(state, answers(BASE_MS), maximum=64, now=clock.now(), config=GRADIENT)
    assert state.limit >= 5 and state.estimate is not None and state.estimate > 5


def test_a_rising_latency_pulls_it_down_by_at_most_half_per_update() -> None:
    state = Limiter(20, BASE_MS, T0, 20.0)
    later = T0 + dt.timedelta(seconds=5)  # nearly all the way to the target (1 s constant)
    after = next_limit(state, answers(10 * BASE_MS), maximum=64, now=later, config=GRADIENT)
    # the floor of 0.5 holds the target at 20 * 0.5 + sqrt(20)
    assert after.limit == 14


def test_overload_shrinks_it_once_per_window() -> None:
    state = Limiter(20, BASE_MS, T0, 20.9)
    burst = Signals(overloaded=3)
    for ms in (0, 100, 400):
        now = T0 + dt.timedelta(milliseconds=ms)
        state = next_limit(state, burst, maximum=32, now=now, config=GRADIENT)
    assert state.limit == 14 and state.estimate is None
    # answers during the hold do not grow it back
    now = T0 + dt.timedelta(milliseconds=450)
    held = next_limit(state, answers(BASE_MS), maximum=32, now=now, config=GRADIENT)
    assert held.limit == 14


def test_the_worker_folds_mean_latency_into_the_row() -> None:
    config = HealthConfig(adaptive=GRADIENT)
    health = Health(1, max_in_flight=32, adaptive=True, adaptive_limit=10, adaptive_estimate=10.5)
    batch = [
        Observation(1, Outcome.SUCCEEDED, 200, None, None, latency)
        for latency in (BASE_MS, 3 * BASE_MS)  # mean twice the unloaded latency
    ]
    summary = summarize(batch, config)[1]
    assert (summary.adaptive.total_ms, summary.adaptive.timed) == (4 * BASE_MS, 2)
    health = Health(
        1,
        max_in_flight=32,
        adaptive=True,
        adaptive_limit=10,
        adaptive_estimate=10.5,
        latency_baseline_ms=BASE_MS,
        adaptive_window_at=T0,
    )
    after = after_outcomes(health, summary, now=T0 + dt.timedelta(seconds=60), config=config)
    # target 10.5 * (1.25 * 200 / 400) + sqrt(10.5), reached after a minute
    assert after.adaptive_estimate is not None and abs(after.adaptive_estimate - 9.80) < 0.01
    assert after.adaptive_limit == 9


signals = st.builds(
    Signals,
    overloaded=st.integers(0, 3),
    answered=st.integers(0, 50),
    fastest_ms=st.none() | st.floats(0, 10_000),
    slowest_ms=st.none() | st.floats(0, 10_000),
    total_ms=st.floats(0, 1e6),
    timed=st.integers(0, 50),
)


@settings(max_examples=50)  # suite budget: each example runs up to 30 updates
@given(
    st.integers(-5, 10_000),
    st.none() | st.floats(-10, 1e6),
    st.none() | st.floats(0, 10_000),
    st.lists(st.tuples(signals, st.integers(0, 5_000)), max_size=30),
    st.integers(-3, 500),
)
def test_the_limit_stays_between_one_and_the_maximum(
    limit: int,
    estimate: float | None,
    baseline: float | None,
    batches: list[tuple[Signals, int]],
    maximum: int,
) -> None:
    state, now = Limiter(limit, baseline, None, estimate), T0
    for signal, step_ms in batches:
        now += dt.timedelta(milliseconds=step_ms)
        state = next_limit(state, signal, maximum=maximum, now=now, config=GRADIENT)
        assert 1 <= state.limit <= max(1, maximum)
        assert state.estimate is None or 1 <= state.estimate < state.limit + 1


async def test_the_worker_keeps_the_unrounded_limit_in_the_health_row(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    """Real worker, real receiver: the gradient's fraction survives the round trip."""
    # The partner's own 50 ms dominates every answer's latency: with instant answers, the
    # one attempt that opened the connection was several times slower than the rest, and
    # the gradient rightly stayed at 4 (a flake on a quiet box).
    partner = receiver.route("/ok", lambda _: Behaviour(delay=0.05))
    uid = add_endpoint(engine, box, partner).endpoint.uid
    with engine.begin() as conn:
        set_endpoint_limits(
            conn, uid, EndpointLimits(max_in_flight=20, adaptive=True), actor="test"
        )
        for i in range(3):
            publish(conn, "order.created", {"i": i})
    await relay_all(async_engine, clock)
    sender = worker(async_engine, http, box, clock, HealthConfig(adaptive=GRADIENT))
    for _ in range(3):
        clock.advance(0.3)
        await sender.run_once()
    limit, estimate = rows(engine, "SELECT adaptive_limit, adaptive_estimate FROM endpoint_health")[
        0
    ].values()
    assert estimate is not None and estimate > 4 and limit == int(estimate)


@pytest.mark.parametrize("hostile", ["GRADIENT", "vegas", "", "aimd "])
def test_the_setting_chooses_the_limiter_and_refuses_others(
    monkeypatch: pytest.MonkeyPatch, hostile: str
) -> None:
    monkeypatch.delenv("OUTBOX_ENV_FILE", raising=False)
    assert health_config(load_settings()).adaptive.algorithm == "gradient"
    monkeypatch.setenv("OUTBOX_ADAPTIVE_ALGORITHM", "aimd")
    assert health_config(load_settings()).adaptive.algorithm == "aimd"
    monkeypatch.setenv("OUTBOX_ADAPTIVE_ALGORITHM", hostile)
    with pytest.raises(ConfigurationError, match="OUTBOX_ADAPTIVE_ALGORITHM"):
        load_settings()


@pytest.mark.parametrize("algorithm", ["gradient", "aimd"])
def test_a_partner_answering_within_a_millisecond_gets_the_whole_maximum(algorithm: str) -> None:
    """Attempts are timed in whole milliseconds: a partner on the same network answers in
    0 ms unloaded and 1-4 ms with the worker's own loop busy. That is no queue at the
    partner, so the limit climbs to the maximum instead of sitting near ten."""
    config = AdaptiveConfig(algorithm=algorithm)  # type: ignore[arg-type]
    clock = ManualClock(T0)
    state = Limiter(4)
    for step in range(1200):  # a minute of batches every 50 ms (AIMD adds one per window)
        clock.advance(0.05)
        fast = Signals(answered=4, fastest_ms=0, slowest_ms=4, total_ms=step % 5, timed=4)
        state = next_limit(state, fast, maximum=100, now=clock.now(), config=config)
    assert state.limit == 100, state
    # and past the floor a real queue still pulls it down
    clock.advance(5)
    slow = next_limit(state, answers(60.0), maximum=100, now=clock.now(), config=config)
    assert slow.limit < 100
