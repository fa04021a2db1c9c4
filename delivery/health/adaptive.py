"""Adaptive concurrency: an endpoint's in-flight limit, decided from its outcomes.

Two limiters behind one function (`next_limit`), chosen by `AdaptiveConfig.algorithm`:

- **AIMD**: the limit grows by one per window while the endpoint answers without
  429/503/timeouts and its latency stays near its unloaded latency (a decaying minimum),
  and shrinks multiplicatively on a latency rise.
- **gradient** (Netflix concurrency-limits' Gradient, Vegas-like): the limit moves
  towards `limit * min(1, tolerance * unloaded / latency) + sqrt(limit)`, smoothed in
  time; below the knee the latency ratio is 1 and the queue allowance makes it grow,
  past it the ratio pulls it back to where the partner's queue stays short.

Both shrink multiplicatively on a 429, 503 or timeout, at most once per window (the
answers that arrive just after a decrease are to requests sent before it). Pure: the
state is a value; the worker folds each outcome batch into the endpoint's health row.
docs/performance.md says which one is the default and why (measured by bench/adaptive.py).
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass
from typing import Literal

OVERLOAD_STATUSES = (429, 503)
# The ceiling of an adaptive endpoint without a max_in_flight of its own
# (OUTBOX_ADAPTIVE_DEFAULT_MAX): what one worker process gives one endpoint at most with
# the default settings (OUTBOX_WORKER_MAX_IN_FLIGHT 200 * OUTBOX_WORKER_ENDPOINT_SHARE 0.5),
# so an adaptive partner is never pushed harder by the fleet than one process would.
DEFAULT_MAXIMUM = 100
Algorithm = Literal["aimd", "gradient"]
ALGORITHMS: tuple[Algorithm, ...] = ("aimd", "gradient")


@dataclass(frozen=True, slots=True)
class AdaptiveConfig:
    """The limiter's tuning, shared by all adaptive endpoints."""

    algorithm: Algorithm = "gradient"  # kept over AIMD: docs/performance.md says why
    default_maximum: int = DEFAULT_MAXIMUM  # the ceiling when max_in_flight is unset
    window_seconds: float = 0.5  # AIMD grows by at most one per window; one decrease per window
    decrease_factor: float = 0.7  # multiplied into the limit on overload
    latency_tolerance: float = 1.5  # AIMD: latency above baseline * this counts as a rise
    baseline_drift: float = 0.02  # AIMD: share of the gap the baseline climbs per batch
    # gradient: latency up to tolerance * unloaded counts as no queue at all
    gradient_tolerance: float = 1.25
    gradient_floor: float = 0.5  # one update never more than halves the target
    smoothing_seconds: float = 1.0  # time constant of the move towards the target
    # Latencies below this count as this, in both limiters: the worker times attempts in
    # whole milliseconds, so a partner on the same network reads 0 ms unloaded, and any
    # answer after that looked like an unbounded queue (the limit sat near 10 against a
    # partner that took a hundred at once). A few milliseconds of "queue" is the worker's
    # own event loop, not the partner's.
    latency_floor_ms: float = 5.0
    # the unloaded latency climbs towards a higher fastest answer with this time constant:
    # slow, so a partner that stays loaded does not become its own "unloaded" reference
    baseline_seconds: float = 30.0


@dataclass(frozen=True, slots=True)
class Signals:
    """What one outcome batch says about one adaptive endpoint."""

    overloaded: int = 0  # 429, 503 and timeouts
    answered: int = 0  # other answers (the ones that measure latency)
    fastest_ms: float | None = None  # the batch's lowest latency among answers
    slowest_ms: float | None = None  # the batch's highest latency among answers
    total_ms: float = 0.0  # the sum of the answers' latencies (their mean for the gradient)
    timed: int = 0  # how many answers carried a latency (the mean's divisor)


@dataclass(frozen=True, slots=True)
class Limiter:
    """The shared limiter state of one endpoint (its health row's adaptive columns)."""

    limit: int
    baseline_ms: float | None = None
    # the last growth (AIMD) or update (gradient), or the end of the hold after a
    # decrease (then in the future)
    window_at: dt.datetime | None = None
    estimate: float | None = None  # gradient: the limit before rounding down


def initial_limit(maximum: int) -> int:
    """Where a new limiter starts: low, so an overloaded partner is not hit at full load."""
    return max(1, min(maximum, 4))


def next_limit(
    state: Limiter, signals: Signals, *, maximum: int, now: dt.datetime, config: AdaptiveConfig
) -> Limiter:
    """The limiter after one outcome batch: always within [1, maximum]."""
    maximum = max(1, maximum)
    limit = min(max(1, state.limit), maximum)
    if config.algorithm == "gradient":
        elapsed = _since(state.window_at, now)
        drift = 1.0 - math.exp(-elapsed / max(config.baseline_seconds, 1e-9))
    else:
        drift = config.baseline_drift
    baseline = _baseline(state.baseline_ms, signals, drift)
    if signals.overloaded:
        if state.window_at is not None and now < state.window_at:
            # Shrunk less than a window ago: these answers are to requests sent at the old
            # limit, so shrinking again would punish one overload several times.
            return Limiter(limit, baseline, state.window_at, _kept(state.estimate, limit))
        return _shrink(limit, baseline, now, config)
    if config.algorithm == "gradient":
        return _gradient(state, signals, limit, baseline, maximum=maximum, now=now, config=config)
    return _aimd(state, signals, limit, baseline, maximum=maximum, now=now, config=config)


def _since(then: dt.datetime | None, now: dt.datetime) -> float:
    return 0.0 if then is None else max(0.0, (now - then).total_seconds())


def _baseline(baseline: float | None, signals: Signals, drift: float) -> float | None:
    """The unloaded latency: the lowest seen, climbing slowly towards the fastest answer now
    (by `drift`, the share of the gap)."""
    if signals.fastest_ms is None:
        return baseline
    if baseline is None or signals.fastest_ms <= baseline:
        return signals.fastest_ms
    # Decay towards what the endpoint answers now, so a lasting change of its unloaded
    # latency is accepted instead of shrinking the limit forever.
    return baseline + drift * (signals.fastest_ms - baseline)


def _shrink(
    limit: int, baseline: float | None, now: dt.datetime, config: AdaptiveConfig
) -> Limiter:
    """Multiplicative decrease, then a hold of one window (no second decrease, no growth)."""
    shrunk = max(1, min(limit - 1, math.floor(limit * config.decrease_factor)))
    return Limiter(shrunk, baseline, now + dt.timedelta(seconds=config.window_seconds))


def _kept(estimate: float | None, limit: int) -> float | None:
    return None if estimate is None else min(max(1.0, estimate), float(limit) + 0.999)


def _aimd(
    state: Limiter,
    signals: Signals,
    limit: int,
    baseline: float | None,
    *,
    maximum: int,
    now: dt.datetime,
    config: AdaptiveConfig,
) -> Limiter:
    rose = (
        baseline is not None
        and signals.slowest_ms is not None
        and signals.slowest_ms > max(baseline, config.latency_floor_ms) * config.latency_tolerance
    )
    if rose:
        if state.window_at is not None and now < state.window_at:
            return Limiter(limit, baseline, state.window_at)
        return _shrink(limit, baseline, now, config)
    window = dt.timedelta(seconds=config.window_seconds)
    if signals.answered and (state.window_at is None or now - state.window_at >= window):
        return Limiter(min(maximum, limit + 1), baseline, now)
    return Limiter(limit, baseline, state.window_at)


def _gradient(
    state: Limiter,
    signals: Signals,
    limit: int,
    baseline: float | None,
    *,
    maximum: int,
    now: dt.datetime,
    config: AdaptiveConfig,
) -> Limiter:
    """Move the estimate towards `limit * gradient + sqrt(limit)` by the time elapsed."""
    estimate = _kept(state.estimate, limit)
    if estimate is None:
        estimate = float(limit)
    if not signals.timed or baseline is None or signals.total_ms < 0:
        return Limiter(limit, baseline, state.window_at, estimate)
    if state.window_at is not None and now < state.window_at:
        return Limiter(limit, baseline, state.window_at, estimate)  # holding after a decrease
    floor = config.latency_floor_ms
    mean_ms = max(signals.total_ms / signals.timed, floor)
    ratio = config.gradient_tolerance * max(baseline, floor) / mean_ms
    gradient = max(config.gradient_floor, min(1.0, ratio))
    target = estimate * gradient + math.sqrt(estimate)
    # A new limiter's first update moves as if a whole window had passed.
    elapsed = config.window_seconds if state.window_at is None else _since(state.window_at, now)
    weight = 1.0 - math.exp(-elapsed / max(config.smoothing_seconds, 1e-9))
    estimate += weight * (target - estimate)
    if not math.isfinite(estimate):
        estimate = float(limit)
    estimate = min(float(maximum), max(1.0, estimate))
    return Limiter(max(1, min(maximum, math.floor(estimate))), baseline, now, estimate)
