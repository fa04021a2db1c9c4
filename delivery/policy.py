"""What an HTTP attempt's result means, and when to try again.

Pure functions of their inputs (time and randomness are passed in), so every rule
is unit-testable without a server or a clock.
"""

from __future__ import annotations

import datetime as dt
import email.utils
import random
from dataclasses import dataclass
from enum import StrEnum


class Outcome(StrEnum):
    SUCCEEDED = "succeeded"
    RETRYABLE = "retryable"
    PERMANENT = "permanent"
    AMBIGUOUS = "ambiguous"  # may have arrived: timeout or reset after the request was sent


RETRYABLE_4XX = frozenset({408, 425, 429})
RETRY_AFTER_STATUSES = frozenset({429, 503})
RETRY_AFTER_MIN_SECONDS = 1.0
RETRY_AFTER_MAX_SECONDS = 3600.0


def classify_status(status: int) -> Outcome:
    if 200 <= status < 300:
        return Outcome.SUCCEEDED
    if 300 <= status < 400:
        # Redirects are never followed: the endpoint URL needs fixing by a person.
        return Outcome.PERMANENT
    if status in RETRYABLE_4XX:
        return Outcome.RETRYABLE
    if 400 <= status < 500:
        return Outcome.PERMANENT
    return Outcome.RETRYABLE


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Delays between attempts (the last delay repeats) and the total attempts allowed."""

    schedule: tuple[float, ...]
    max_attempts: int
    jitter: float = 0.2

    def delay_after(self, attempts_made: int, rng: random.Random) -> float:
        base = self.schedule[min(attempts_made, len(self.schedule)) - 1]
        return base * rng.uniform(1 - self.jitter, 1 + self.jitter)


def parse_retry_after(value: str | None, now: dt.datetime) -> float | None:
    """Seconds to wait from a Retry-After header (delta-seconds or HTTP date); None if unusable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        seconds = float(value)
    else:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=dt.UTC)
        seconds = (when - now).total_seconds()
    return min(max(seconds, RETRY_AFTER_MIN_SECONDS), RETRY_AFTER_MAX_SECONDS)


@dataclass(frozen=True, slots=True)
class Decision:
    state: str  # 'succeeded' | 'scheduled' | 'dead'
    next_attempt_at: dt.datetime | None
    final_reason: str | None


def decide(
    outcome: Outcome,
    *,
    attempts_made: int,
    policy: RetryPolicy,
    now: dt.datetime,
    rng: random.Random,
    last_error: str,
    retry_after: float | None = None,
) -> Decision:
    """The delivery's next state after an attempt with this outcome."""
    if outcome is Outcome.SUCCEEDED:
        return Decision("succeeded", None, None)
    if outcome is Outcome.PERMANENT:
        return Decision("dead", None, f"permanent failure: {last_error}")
    if attempts_made >= policy.max_attempts:
        return Decision("dead", None, f"{attempts_made} attempts used up, last: {last_error}")
    delay = retry_after if retry_after is not None else policy.delay_after(attempts_made, rng)
    return Decision("scheduled", now + dt.timedelta(seconds=delay), None)
