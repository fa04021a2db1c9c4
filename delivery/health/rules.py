"""Endpoint health's decisions, pure functions of a `Health` value, a clock reading and config."""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from delivery.health.adaptive import (
    OVERLOAD_STATUSES,
    AdaptiveConfig,
    Limiter,
    Signals,
    initial_limit,
    next_limit,
)
from delivery.policy import Outcome

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
THROTTLE_STATUS = 429


@dataclass(frozen=True, slots=True)
class HealthConfig:
    """Breaker and ramp settings shared by all endpoints (limits are per endpoint)."""

    failure_threshold: int = 5
    failure_ratio: float = 0.5
    ratio_window_seconds: float = 60.0
    ratio_min_attempts: int = 20
    cooldown_seconds: float = 15.0
    cooldown_max_seconds: float = 600.0
    ramp_seconds: float = 60.0
    ramp_start_per_second: float = 1.0
    ramp_step_per_second: float = 1.0
    throttle_seconds: float = 5.0
    auto_disable_after_seconds: float = 5 * 86400.0
    probe_lease_seconds: float = 60.0
    adaptive: AdaptiveConfig = dataclasses.field(default_factory=AdaptiveConfig)


@dataclass(frozen=True, slots=True)
class Health:
    """One endpoint_health row (breaker state and limits)."""

    endpoint_id: int
    max_in_flight: int | None = None
    max_per_second: float | None = None
    breaker_state: str = CLOSED
    consecutive_failures: int = 0
    window_started_at: dt.datetime | None = None
    window_attempts: int = 0
    window_failures: int = 0
    trips: int = 0
    opened_at: dt.datetime | None = None
    open_until: dt.datetime | None = None
    probe_until: dt.datetime | None = None
    ramp_started_at: dt.datetime | None = None
    ramp_until: dt.datetime | None = None
    paused_until: dt.datetime | None = None
    tokens: float | None = None
    tokens_at: dt.datetime | None = None
    failing_since: dt.datetime | None = None
    last_failure: str | None = None
    adaptive: bool = False  # adaptive concurrency (max_in_flight, else the default, its ceiling)
    adaptive_limit: int | None = None  # the limiter's current in-flight limit
    latency_baseline_ms: float | None = None  # its decaying minimum latency
    adaptive_window_at: dt.datetime | None = None  # when its limit last moved
    adaptive_estimate: float | None = None  # the gradient limiter's unrounded limit

    @classmethod
    def from_row(cls, row: Any) -> Health:
        values = row._mapping
        return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls)})


STATE_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(Health)
    if f.name not in ("max_in_flight", "max_per_second", "adaptive")
)


def adaptive_maximum(health: Health, config: HealthConfig) -> int | None:
    """An adaptive endpoint's ceiling: its own max_in_flight, else the default maximum
    (None: not adaptive)."""
    if not health.adaptive:
        return None
    if health.max_in_flight is not None:
        return health.max_in_flight
    return config.adaptive.default_maximum


def in_flight_limit(health: Health, config: HealthConfig) -> int | None:
    """The in-flight limit the claim gate applies now: the configured maximum, or for an
    adaptive endpoint the limiter's current limit under its ceiling."""
    maximum = adaptive_maximum(health, config)
    if maximum is None:
        return health.max_in_flight
    if health.adaptive_limit is None:
        return initial_limit(maximum)
    return max(1, min(maximum, health.adaptive_limit))


# -- the claim gate ---------------------------------------------------------------------


def effective_rate(health: Health, now: dt.datetime, config: HealthConfig) -> float | None:
    """Requests per second allowed now: the endpoint's limit, lowered by a running ramp."""
    rate = health.max_per_second
    started, until = health.ramp_started_at, health.ramp_until
    if started is not None and until is not None and started <= now < until:
        elapsed = (now - started).total_seconds()
        ramp = config.ramp_start_per_second + config.ramp_step_per_second * elapsed
        rate = ramp if rate is None else min(rate, ramp)
    return rate


def available_tokens(health: Health, now: dt.datetime, rate: float) -> float:
    """Token bucket refill; the bucket holds one second's worth (at least one request)."""
    burst = max(1.0, rate)
    if health.tokens is None or health.tokens_at is None:
        return burst
    elapsed = max(0.0, (now - health.tokens_at).total_seconds())
    return min(burst, health.tokens + rate * elapsed)


def claim_budget(
    health: Health, *, in_flight: int, now: dt.datetime, config: HealthConfig
) -> int | None:
    """How many deliveries of this endpoint one claim may take right now (None: no limit)."""
    if health.paused_until is not None and now < health.paused_until:
        return 0
    budget = math.inf
    limit = in_flight_limit(health, config)
    if limit is not None:
        budget = max(0, limit - in_flight)
    if health.breaker_state == OPEN:
        if health.open_until is not None and now < health.open_until:
            return 0
        return int(min(budget, 1))  # cooldown over: one probe
    if health.breaker_state == HALF_OPEN:
        if health.probe_until is not None and now < health.probe_until:
            return 0  # the probe is still out
        return int(min(budget, 1))  # the probe's worker vanished: probe again
    rate = effective_rate(health, now, config)
    if rate is not None:
        budget = min(budget, math.floor(available_tokens(health, now, rate)))
    return None if budget == math.inf else int(budget)


def after_claim(health: Health, claimed: int, *, now: dt.datetime, config: HealthConfig) -> Health:
    """The row after a claim took `claimed` deliveries of this endpoint."""
    changes: dict[str, Any] = {}
    if health.breaker_state in (OPEN, HALF_OPEN):
        if claimed:
            changes.update(
                breaker_state=HALF_OPEN,
                probe_until=now + dt.timedelta(seconds=config.probe_lease_seconds),
            )
        return dataclasses.replace(health, **changes)
    rate = effective_rate(health, now, config)
    if rate is None:
        changes.update(tokens=None, tokens_at=None)
    else:
        changes.update(tokens=available_tokens(health, now, rate) - claimed, tokens_at=now)
    if health.ramp_until is not None and now >= health.ramp_until:
        changes.update(ramp_started_at=None, ramp_until=None)
    if health.paused_until is not None and now >= health.paused_until:
        changes.update(paused_until=None)
    return dataclasses.replace(health, **changes)


# -- outcomes ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Observation:
    """What one attempt says about its endpoint's health."""

    endpoint_id: int
    outcome: Outcome
    status_code: int | None
    retry_after: float | None
    error: str | None
    latency_ms: float | None = None


@dataclass(slots=True)
class Summary:
    """One endpoint's attempts from one outcome batch, in the order they finished."""

    answered: int = 0  # the endpoint responded (2xx, or a definite 3xx/4xx rejection)
    failures: int = 0  # 5xx, 408/425, connect errors, timeouts
    trailing_failures: int = 0  # failures after the last answer
    throttled_for: float | None = None  # 429: seconds to pause
    retry_after_given: bool = False  # a 429 said how long (adaptive endpoints pause only then)
    last_error: str | None = None
    adaptive: Signals = dataclasses.field(
        default_factory=Signals
    )  # what the adaptive limiter learns from this batch


def is_failure(observation: Observation) -> bool:
    return observation.outcome in (Outcome.RETRYABLE, Outcome.AMBIGUOUS) and (
        observation.status_code != THROTTLE_STATUS
    )


def is_good_news(observation: Observation) -> bool:
    """An answer (not a failure, not a 429): for a spotless endpoint it changes nothing."""
    return good_news(observation.outcome, observation.status_code)


def good_news(outcome: Outcome, status_code: int | None) -> bool:
    """`is_good_news` of an outcome before its Observation is built (the worker skips
    building one for a spotless endpoint's good news)."""
    return status_code != THROTTLE_STATUS and outcome not in (Outcome.RETRYABLE, Outcome.AMBIGUOUS)


def summarize(observations: Iterable[Observation], config: HealthConfig) -> dict[int, Summary]:
    summaries: dict[int, Summary] = {}
    for item in observations:
        summary = summaries.setdefault(item.endpoint_id, Summary())
        summary.adaptive = _signal(summary.adaptive, item)
        if item.status_code == THROTTLE_STATUS:
            pause = item.retry_after if item.retry_after is not None else config.throttle_seconds
            summary.throttled_for = max(summary.throttled_for or 0.0, pause)
            summary.retry_after_given = summary.retry_after_given or item.retry_after is not None
        elif is_failure(item):
            summary.failures += 1
            summary.trailing_failures += 1
            summary.last_error = item.error
        elif item.outcome is Outcome.SUCCEEDED or item.status_code is not None:
            summary.answered += 1
            summary.trailing_failures = 0
        # A permanent refusal without a response (the SSRF guard) says nothing about health.
    return summaries


def _signal(signals: Signals, item: Observation) -> Signals:
    """Fold one attempt into the limiter's signals: overload (429, 503, no answer in time)
    or an answer with its latency."""
    if item.status_code in OVERLOAD_STATUSES or (is_failure(item) and item.status_code is None):
        return dataclasses.replace(signals, overloaded=signals.overloaded + 1)
    if item.status_code is None:
        return signals
    latency = item.latency_ms
    return Signals(
        signals.overloaded,
        signals.answered + 1,
        _extreme(min, signals.fastest_ms, latency),
        _extreme(max, signals.slowest_ms, latency),
        signals.total_ms + (latency or 0.0),
        signals.timed + (latency is not None),
    )


def _extreme(pick: Any, current: float | None, value: float | None) -> float | None:
    if value is None:
        return current
    return value if current is None else float(pick(current, value))


def after_adaptive(
    health: Health, signals: Signals, *, now: dt.datetime, config: HealthConfig
) -> Health:
    """The row's limiter after a batch (unchanged unless the endpoint opted in)."""
    maximum = adaptive_maximum(health, config)
    if maximum is None:
        return health
    current = health.adaptive_limit or initial_limit(maximum)
    state = Limiter(
        current, health.latency_baseline_ms, health.adaptive_window_at, health.adaptive_estimate
    )
    after = next_limit(state, signals, maximum=maximum, now=now, config=config.adaptive)
    return dataclasses.replace(
        health,
        adaptive_limit=after.limit,
        latency_baseline_ms=after.baseline_ms,
        adaptive_window_at=after.window_at,
        adaptive_estimate=after.estimate,
    )


def cooldown(trips: int, config: HealthConfig) -> float:
    """Open time after the `trips`-th consecutive trip: doubling from the base, capped."""
    return min(config.cooldown_max_seconds, config.cooldown_seconds * 2.0 ** max(0, trips - 1))


def _trip(health: Health, now: dt.datetime, config: HealthConfig) -> Health:
    trips = health.trips + 1
    return dataclasses.replace(
        health,
        breaker_state=OPEN,
        trips=trips,
        opened_at=now,
        open_until=now + dt.timedelta(seconds=cooldown(trips, config)),
        probe_until=None,
        window_started_at=None,
        window_attempts=0,
        window_failures=0,
        ramp_started_at=None,
        ramp_until=None,
        tokens=None,
        tokens_at=None,
    )


def _close(health: Health, now: dt.datetime, config: HealthConfig) -> Health:
    return dataclasses.replace(
        health,
        breaker_state=CLOSED,
        consecutive_failures=0,
        open_until=None,
        probe_until=None,
        window_started_at=now,
        window_attempts=0,
        window_failures=0,
        ramp_started_at=now,
        ramp_until=now + dt.timedelta(seconds=config.ramp_seconds),
        tokens=None,
        tokens_at=None,
    )


def after_outcomes(
    health: Health, summary: Summary, *, now: dt.datetime, config: HealthConfig
) -> Health:
    """The row after a batch of this endpoint's outcomes was recorded."""
    h = after_adaptive(health, summary.adaptive, now=now, config=config)
    if summary.throttled_for is not None and (not h.adaptive or summary.retry_after_given):
        # Slow down: pause, then ramp up again from the end of the pause.
        until = now + dt.timedelta(seconds=summary.throttled_for)
        if h.paused_until is not None:
            until = max(until, h.paused_until)
        h = dataclasses.replace(
            h,
            paused_until=until,
            ramp_started_at=until,
            ramp_until=until + dt.timedelta(seconds=config.ramp_seconds),
            tokens=None,
            tokens_at=None,
        )
    # The failure streak that auto-disable measures.
    if summary.answered:
        failing_since = now if summary.trailing_failures else None
        h = dataclasses.replace(h, failing_since=failing_since)
    elif summary.failures and h.failing_since is None:
        h = dataclasses.replace(h, failing_since=now)
    if summary.failures:
        h = dataclasses.replace(h, last_failure=summary.last_error)

    if h.breaker_state == HALF_OPEN:
        if summary.answered and not summary.trailing_failures:
            return _close(h, now, config)
        if summary.failures:
            return _trip(h, now, config)
        if summary.throttled_for is not None:
            # The probe was throttled: probe again when the pause ends, no longer cooldown.
            return dataclasses.replace(
                h, breaker_state=OPEN, open_until=h.paused_until, probe_until=None
            )
        return h
    if h.breaker_state == OPEN:
        return h  # stragglers claimed before the trip; the probe decides

    # Closed: count, and trip on a run of failures or a bad ratio over the window.
    attempts = summary.answered + summary.failures
    window_started_at, window_attempts, window_failures = (
        h.window_started_at,
        h.window_attempts,
        h.window_failures,
    )
    if window_started_at is None or (now - window_started_at).total_seconds() >= (
        config.ratio_window_seconds
    ):
        # A window opens with a failure: answers while nothing fails are not written
        # at all (the worker skips them), so the ratio counts from the first failure.
        window_started_at, window_attempts, window_failures = now, 0, 0
        if not summary.failures:
            window_started_at = None
    if window_started_at is not None:
        window_attempts += attempts
        window_failures += summary.failures
    consecutive = (
        summary.trailing_failures if summary.answered else h.consecutive_failures + summary.failures
    )
    h = dataclasses.replace(
        h,
        consecutive_failures=consecutive,
        window_started_at=window_started_at,
        window_attempts=window_attempts,
        window_failures=window_failures,
    )
    ratio_tripped = (
        window_attempts >= config.ratio_min_attempts
        and window_failures >= config.failure_ratio * window_attempts
    )
    if consecutive >= config.failure_threshold or ratio_tripped:
        return _trip(h, now, config)
    if summary.answered and h.trips and (h.ramp_until is None or now >= h.ramp_until):
        h = dataclasses.replace(h, trips=0)  # healthy through a whole ramp: forgive old trips
    return h


def disable_reason(health: Health, *, now: dt.datetime, config: HealthConfig) -> str | None:
    """Why the endpoint should be disabled now, or None while it still has a chance."""
    if health.failing_since is None:
        return None
    failing_for = (now - health.failing_since).total_seconds()
    if failing_for < config.auto_disable_after_seconds:
        return None
    since = health.failing_since.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"auto-disabled: every attempt failed for {_duration(failing_for)} (since {since}); "
        f"last error: {health.last_failure or 'unknown'}. Pending deliveries are kept: fix the "
        "endpoint, then enable it again"
    )


def _duration(seconds: float) -> str:
    if seconds >= 86400:
        return f"{seconds / 86400:g} days"
    if seconds >= 3600:
        return f"{seconds / 3600:g} hours"
    return f"{seconds:g} seconds"


def next_opening(health: Health, *, now: dt.datetime, config: HealthConfig) -> dt.datetime | None:
    """When an endpoint that may take nothing right now may take one again, if time alone
    decides it (None: it is not gated now, or an outcome must arrive first: a probe's answer,
    a slot under its in-flight limit)."""
    if health.paused_until is not None and now < health.paused_until:
        return health.paused_until
    if health.breaker_state == OPEN:
        if health.open_until is not None and now < health.open_until:
            return health.open_until
        return None
    if health.breaker_state == HALF_OPEN:
        return None
    rate = effective_rate(health, now, config)
    if rate is None or rate <= 0:
        return None
    tokens = available_tokens(health, now, rate)
    if tokens >= 1:
        return None
    return now + dt.timedelta(seconds=(1 - tokens) / rate)
