"""The breaker, ramp and limit rules as pure functions: no database, no server."""

from __future__ import annotations

import dataclasses
import datetime as dt

import pytest

from delivery.health import (
    CLOSED,
    HALF_OPEN,
    OPEN,
    Health,
    HealthConfig,
    Observation,
    after_claim,
    after_outcomes,
    claim_budget,
    cooldown,
    disable_reason,
    summarize,
)
from delivery.operator.app import worker_config
from delivery.policy import Outcome
from outbox.errors import ConfigurationError
from outbox.settings import load_settings

T0 = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
CONFIG = HealthConfig(
    failure_threshold=3,
    failure_ratio=0.5,
    ratio_window_seconds=60,
    ratio_min_attempts=10,
    cooldown_seconds=10,
    cooldown_max_seconds=35,
    ramp_seconds=10,
    ramp_start_per_second=1,
    ramp_step_per_second=1,
    throttle_seconds=5,
    auto_disable_after_seconds=86400,
    probe_lease_seconds=30,
)


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def ok() -> Observation:
    return Observation(1, Outcome.SUCCEEDED, 200, None, None)


def fail(error: str = "HTTP 503") -> Observation:
    return Observation(1, Outcome.RETRYABLE, 503, None, error)


def apply(health: Health, *observations: Observation, now: dt.datetime) -> Health:
    return after_outcomes(health, summarize(observations, CONFIG)[1], now=now, config=CONFIG)


def test_consecutive_failures_open_the_breaker_at_the_threshold() -> None:
    health = apply(Health(1), fail(), fail(), now=at(0))
    assert health.breaker_state == CLOSED and health.consecutive_failures == 2
    health = apply(health, fail(), now=at(1))
    assert health.breaker_state == OPEN
    assert health.open_until == at(11) and health.trips == 1


def test_a_success_resets_the_run_but_failures_after_it_count() -> None:
    health = apply(Health(1), fail(), fail(), ok(), fail(), now=at(0))
    assert health.breaker_state == CLOSED and health.consecutive_failures == 1


def test_failure_ratio_over_the_window_opens_it_with_successes_in_between() -> None:
    health = Health(1)
    for second in range(5):  # fail, ok alternating: never 3 in a row, but 50%
        health = apply(health, fail(), ok(), now=at(second))
    assert health.breaker_state == OPEN
    # The same ratio spread over separate windows never reaches the minimum attempts.
    health = Health(1)
    for second in range(5):
        health = apply(health, fail(), ok(), now=at(second * 61))
    assert health.breaker_state == CLOSED


def test_open_breaker_claims_nothing_then_exactly_one_probe() -> None:
    health = apply(Health(1), fail(), fail(), fail(), now=at(0))
    assert claim_budget(health, in_flight=0, now=at(5), config=CONFIG) == 0
    assert claim_budget(health, in_flight=0, now=at(10), config=CONFIG) == 1
    probing = after_claim(health, 1, now=at(10), config=CONFIG)
    assert probing.breaker_state == HALF_OPEN and probing.probe_until == at(40)
    assert claim_budget(probing, in_flight=1, now=at(11), config=CONFIG) == 0
    # The probe's worker died: after its lease another probe may go.
    assert claim_budget(probing, in_flight=0, now=at(40), config=CONFIG) == 1


def test_failed_probes_grow_the_cooldown_up_to_the_cap() -> None:
    assert [cooldown(trips, CONFIG) for trips in (1, 2, 3, 4)] == [10, 20, 35, 35]
    health = apply(Health(1), fail(), fail(), fail(), now=at(0))
    health = after_claim(health, 1, now=at(10), config=CONFIG)
    health = apply(health, fail(), now=at(11))
    assert health.breaker_state == OPEN and health.trips == 2 and health.open_until == at(31)


def test_a_good_probe_closes_and_the_rate_ramps_up() -> None:
    health = apply(Health(1), fail(), fail(), fail(), now=at(0))
    health = after_claim(health, 1, now=at(10), config=CONFIG)
    health = apply(health, ok(), now=at(11))
    assert health.breaker_state == CLOSED and health.ramp_until == at(21)
    taken = []
    for second in range(11, 23):
        budget = claim_budget(health, in_flight=0, now=at(second), config=CONFIG)
        assert budget is not None or second >= 21
        taken.append(budget)
        health = after_claim(health, budget or 0, now=at(second), config=CONFIG)
    # 1 + t per second, then unlimited once the ramp is over.
    assert taken == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, None, None]


def test_rate_limit_is_a_token_bucket_of_one_second() -> None:
    health = Health(1, max_per_second=4)
    assert claim_budget(health, in_flight=0, now=at(0), config=CONFIG) == 4
    health = after_claim(health, 4, now=at(0), config=CONFIG)
    assert claim_budget(health, in_flight=0, now=at(0.2), config=CONFIG) == 0
    assert claim_budget(health, in_flight=0, now=at(0.5), config=CONFIG) == 2
    assert claim_budget(health, in_flight=0, now=at(30), config=CONFIG) == 4  # no hoarding


def test_in_flight_limit_counts_everything_leased() -> None:
    health = Health(1, max_in_flight=3)
    assert claim_budget(health, in_flight=1, now=at(0), config=CONFIG) == 2
    assert claim_budget(health, in_flight=5, now=at(0), config=CONFIG) == 0
    assert claim_budget(Health(1), in_flight=500, now=at(0), config=CONFIG) is None


def test_429_pauses_for_retry_after_then_ramps_without_counting_as_failure() -> None:
    throttled = Observation(1, Outcome.RETRYABLE, 429, 30.0, "HTTP 429")
    health = apply(Health(1), throttled, throttled, throttled, now=at(0))
    assert health.breaker_state == CLOSED and health.consecutive_failures == 0
    assert health.paused_until == at(30)
    assert claim_budget(health, in_flight=0, now=at(29), config=CONFIG) == 0
    assert claim_budget(health, in_flight=0, now=at(30), config=CONFIG) == 1
    no_header = Observation(1, Outcome.RETRYABLE, 429, None, "HTTP 429")
    assert apply(Health(1), no_header, now=at(0)).paused_until == at(5)


def test_timeouts_count_as_failures_and_4xx_answers_as_alive() -> None:
    hang = Observation(1, Outcome.AMBIGUOUS, None, None, "deadline passed")
    assert apply(Health(1), hang, hang, hang, now=at(0)).breaker_state == OPEN
    rejected = Observation(1, Outcome.PERMANENT, 400, None, "HTTP 400")
    health = apply(Health(1), fail(), fail(), rejected, now=at(0))
    assert health.consecutive_failures == 0 and health.failing_since is None
    refused = Observation(1, Outcome.PERMANENT, None, None, "address not allowed")
    after = apply(Health(1), refused, now=at(0))
    assert (after.window_attempts, after.consecutive_failures, after.failing_since) == (0, 0, None)


def test_auto_disable_after_an_unbroken_run_of_failures() -> None:
    health = apply(Health(1), fail(), now=at(0))
    assert health.failing_since == at(0)
    health = apply(health, fail("connect failed"), now=at(86399))
    assert disable_reason(health, now=at(86399), config=CONFIG) is None
    reason = disable_reason(health, now=at(86400), config=CONFIG)
    assert reason is not None and "1 days" in reason and "connect failed" in reason
    # One success anywhere in between resets the clock.
    healed = apply(dataclasses.replace(health), ok(), now=at(86000))
    assert healed.failing_since is None
    assert disable_reason(healed, now=at(90000), config=CONFIG) is None


def test_answers_alone_leave_a_spotless_row_untouched() -> None:
    # The worker skips writing them, so they must not matter to the rules either.
    assert apply(Health(1), ok(), ok(), now=at(0)) == Health(1)
    # The ratio window opens with the first failure and counts answers from then on.
    health = apply(Health(1), fail(), ok(), ok(), now=at(0))
    assert (health.window_started_at, health.window_attempts, health.window_failures) == (
        at(0),
        3,
        1,
    )
    expired = apply(health, ok(), now=at(61))
    assert (expired.window_started_at, expired.window_attempts) == (None, 0)


def test_settings_reach_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_BREAKER_FAILURE_THRESHOLD", "7")
    monkeypatch.setenv("OUTBOX_AUTO_DISABLE_AFTER_DAYS", "0.5")
    monkeypatch.setenv("OUTBOX_WORKER_ENDPOINT_SHARE", "0.25")
    monkeypatch.setenv("OUTBOX_LEASE_SECONDS", "90")
    config = worker_config(load_settings())
    assert config.health.failure_threshold == 7
    assert config.health.auto_disable_after_seconds == 43200
    assert config.health.probe_lease_seconds == 90
    assert config.endpoint_slots == 50  # a quarter of the default 200
    assert HealthConfig().auto_disable_after_seconds == 5 * 86400  # the documented default


def test_health_settings_are_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_WORKER_ENDPOINT_SHARE", "1.5")
    with pytest.raises(ConfigurationError, match="OUTBOX_WORKER_ENDPOINT_SHARE"):
        load_settings()


def test_an_adaptive_endpoint_without_a_maximum_is_bounded_by_the_default_maximum() -> None:
    """New endpoints are adaptive without a max_in_flight of their own: the limiter's
    ceiling is then OUTBOX_ADAPTIVE_DEFAULT_MAX (here 8), never unlimited."""
    config = dataclasses.replace(
        CONFIG, adaptive=dataclasses.replace(CONFIG.adaptive, default_maximum=8)
    )
    fresh = Health(1, adaptive=True)
    assert claim_budget(fresh, in_flight=0, now=at(0), config=config) == 4  # starts low
    runaway = Health(1, adaptive=True, adaptive_limit=500)  # e.g. a ceiling lowered since
    assert claim_budget(runaway, in_flight=0, now=at(0), config=config) == 8
    assert claim_budget(runaway, in_flight=3, now=at(0), config=config) == 5
    # its own maximum wins over the default
    own = Health(1, adaptive=True, max_in_flight=20, adaptive_limit=15)
    assert claim_budget(own, in_flight=0, now=at(0), config=config) == 15
    # fast answers for a long time: the limit grows up to the default maximum, not past it
    health = fresh
    for second in range(1, 120):
        fast = [dataclasses.replace(ok(), latency_ms=10.0)] * 20
        summary = summarize(fast, config)[1]
        health = after_outcomes(health, summary, now=at(second), config=config)
    assert health.adaptive_limit == 8
    assert claim_budget(health, in_flight=0, now=at(120), config=config) == 8
