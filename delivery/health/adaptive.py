"""Adaptive concurrency (AIMD): an endpoint's in-flight limit, decided from its outcomes.

The limit grows by one per window while the endpoint answers without 429/503/timeouts
and its latency stays near its unloaded latency (a decaying minimum), and shrinks
multiplicatively on a 429, 503, timeout or a latency rise, at most once per window (the
answers that arrive just after a decrease are to requests sent before it). Pure: the
state is a value; the worker folds each outcome batch into the endpoint's health row.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass

OVERLOAD_STATUSES = (429, 503)


@dataclass(frozen=True, slots=True)
class AdaptiveConfig:
    """The limiter's tuning, shared by all adaptive endpoints."""

    window_seconds: float = 0.5  # the limit grows by at most one per window
    decrease_factor: float = 0.7  # multiplied into the limit on overload
    latency_tolerance: float = 1.5  # latency above baseline * this counts as a rise
    baseline_drift: float = 0.02  # share of the gap the baseline climbs per batch


@dataclass(frozen=True, slots=True)
class Signals:
    """What one outcome batch says about one adaptive endpoint."""

    overloaded: int = 0  # 429, 503 and timeouts
    answered: int = 0  # other answers (the ones that measure latency)
    fastest_ms: float | None = None  # the batch's lowest latency among answers
    slowest_ms: float | None = None  # the batch's highest latency among answers


@dataclass(frozen=True, slots=True)
class Limiter:
    """The shared limiter state of one endpoint (its health row's adaptive columns)."""

    limit: int
    baseline_ms: float | None = None
    # the last growth, or the end of the hold after a decrease (then in the future)
    window_at: dt.datetime | None = None


def initial_limit(maximum: int) -> int:
    """Where a new limiter starts: low, so an overloaded partner is not hit at full load."""
    return max(1, min(maximum, 4))


def next_limit(
    state: Limiter, signals: Signals, *, maximum: int, now: dt.datetime, config: AdaptiveConfig
) -> Limiter:
    """The limiter after one outcome batch: always within [1, maximum]."""
    maximum = max(1, maximum)
    limit = min(max(1, state.limit), maximum)
    baseline = state.baseline_ms
    if signals.fastest_ms is not None:
        if baseline is None or signals.fastest_ms <= baseline:
            baseline = signals.fastest_ms
        else:
            # Decay towards what the endpoint answers now, so a lasting change of its
            # unloaded latency is accepted instead of shrinking the limit forever.
            baseline += config.baseline_drift * (signals.fastest_ms - baseline)
    rose = (
        baseline is not None
        and signals.slowest_ms is not None
        and signals.slowest_ms > baseline * config.latency_tolerance
    )
    window = dt.timedelta(seconds=config.window_seconds)
    if signals.overloaded or rose:
        if state.window_at is not None and now < state.window_at:
            # Shrunk less than a window ago: these answers are to requests sent at the old
            # limit, so shrinking again would punish one overload several times.
            return Limiter(limit, baseline, state.window_at)
        shrunk = min(limit - 1, math.floor(limit * config.decrease_factor))
        # Hold for a window: no second decrease until then, no growth for one more.
        return Limiter(max(1, shrunk), baseline, now + window)
    if not signals.answered:
        return Limiter(limit, baseline, state.window_at)
    if state.window_at is None or now - state.window_at >= window:
        return Limiter(min(maximum, limit + 1), baseline, now)
    return Limiter(limit, baseline, state.window_at)
