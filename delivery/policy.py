"""What an HTTP attempt's result means, and when to try again.

Pure functions of their inputs (time and randomness are passed in), so every rule
is unit-testable without a server or a clock. The default rules:

| response                                   | outcome                                      |
|--------------------------------------------|----------------------------------------------|
| 2xx                                        | succeeded                                    |
| 3xx                                        | permanent; never followed, Location recorded |
| 408, 425, 429, 5xx                         | retryable (429/503 honour Retry-After)       |
| 410                                        | permanent, and the endpoint is disabled      |
| other 4xx (and anything outside 100-599)   | permanent                                    |
| connect error / connect timeout            | retryable: nothing was sent                  |
| timeout or reset after sending began       | ambiguous (retried): it may have arrived     |

An endpoint may override the outcome of single status codes (`404` is transient
for a partner whose routes appear late, `409` means "already have it").
"""

from __future__ import annotations

import datetime as dt
import email.utils
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

T = TypeVar("T")


class Outcome(StrEnum):
    SUCCEEDED = "succeeded"
    RETRYABLE = "retryable"
    PERMANENT = "permanent"
    AMBIGUOUS = "ambiguous"  # may have arrived: timeout or reset after the request was sent


RETRYABLE_4XX = frozenset({408, 425, 429})
GONE = 410
RETRY_AFTER_STATUSES = frozenset({429, 503})
# Retry-After is honoured, but within these bounds: a partner cannot make us retry in a
# tight loop (minimum) nor park a delivery for days (maximum; OUTBOX_RETRY_AFTER_MAX).
RETRY_AFTER_MIN_SECONDS = 1.0
RETRY_AFTER_MAX_SECONDS = 3600.0
DEFAULT_JITTER = 0.2

# Outcomes an endpoint may assign to a status code. 'ambiguous' is not one of them: it
# describes what the transport saw, not what the receiver said.
OVERRIDABLE_OUTCOMES = frozenset({Outcome.SUCCEEDED, Outcome.RETRYABLE, Outcome.PERMANENT})

StatusOverrides = Mapping[int, Outcome]


@dataclass(frozen=True, slots=True)
class Classification:
    """What a status code means for this delivery and, for 410, for its endpoint."""

    outcome: Outcome
    disables_endpoint: bool = False


def classify_status(status: int, overrides: StatusOverrides | None = None) -> Classification:
    """The outcome of one HTTP status under the default table and the endpoint's overrides.

    An override wins over every default, including 410: an endpoint whose 410 is
    configured as retryable is not disabled.
    """
    if overrides and status in overrides:
        return Classification(overrides[status])
    if 200 <= status < 300:
        return Classification(Outcome.SUCCEEDED)
    if 300 <= status < 400:
        # Redirects are never followed: the endpoint URL needs fixing by a person.
        return Classification(Outcome.PERMANENT)
    if status == GONE:
        return Classification(Outcome.PERMANENT, disables_endpoint=True)
    if status in RETRYABLE_4XX or 500 <= status < 600:
        return Classification(Outcome.RETRYABLE)
    return Classification(Outcome.PERMANENT)


def parse_status_overrides(raw: Mapping[str, str] | None) -> dict[int, Outcome]:
    """Stored overrides ({"404": "retryable"}) as typed values; unknown entries are ignored.

    The endpoint API validates what it stores, so ignoring here only matters for
    rows edited by hand: a typo never stops deliveries.
    """
    parsed: dict[int, Outcome] = {}
    for key, value in (raw or {}).items():
        try:
            status, outcome = int(key), Outcome(value)
        except ValueError:
            continue
        if outcome in OVERRIDABLE_OUTCOMES:
            parsed[status] = outcome
    return parsed


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Delays between attempts (the last delay repeats) and the total attempts allowed.

    `schedule[n - 1]` is the pause after the n-th attempt, scaled by a uniform factor
    in [1 - jitter, 1 + jitter] so deliveries that failed together do not all come
    back in the same instant.
    """

    schedule: tuple[float, ...]
    max_attempts: int
    jitter: float = DEFAULT_JITTER
    retry_after_max: float = RETRY_AFTER_MAX_SECONDS

    def delay_after(self, attempts_made: int, rng: random.Random) -> float:
        base = self.schedule[min(max(attempts_made, 1), len(self.schedule)) - 1]
        return base * rng.uniform(1 - self.jitter, 1 + self.jitter)

    def delay_for_retry_after(self, seconds: float, rng: random.Random) -> float:
        """A server-given wait, clamped, with jitter upwards only (never earlier than asked)."""
        clamped = min(max(seconds, RETRY_AFTER_MIN_SECONDS), self.retry_after_max)
        return clamped * rng.uniform(1, 1 + self.jitter)


def parse_retry_after(
    value: str | None, now: dt.datetime, maximum: float = RETRY_AFTER_MAX_SECONDS
) -> float | None:
    """Seconds to wait from a Retry-After header (delta-seconds or HTTP date); None if unusable.

    Clamped to [RETRY_AFTER_MIN_SECONDS, maximum], so every consumer of the value (the
    retry policy, a breaker's pause) sees a bounded number; a date in the past gives
    the minimum.
    """
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        seconds = float(value)
    else:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=dt.UTC)
        seconds = (when - now).total_seconds()
    if math.isnan(seconds):
        return None
    return min(max(seconds, RETRY_AFTER_MIN_SECONDS), maximum)


@dataclass(frozen=True, slots=True)
class Decision:
    state: str  # 'succeeded' | 'scheduled' | 'dead'
    next_attempt_at: dt.datetime | None
    final_reason: str | None
    # Exhausted retries get their final reason once the first attempt's time is known.
    exhausted: bool = False


def decide(
    outcome: Outcome,
    *,
    attempts_made: int,
    policy: RetryPolicy,
    now: dt.datetime,
    rng: random.Random,
    last_error: str,
    retry_after: float | None = None,
    disables_endpoint: bool = False,
) -> Decision:
    """The delivery's next state after an attempt with this outcome."""
    if outcome is Outcome.SUCCEEDED:
        return Decision("succeeded", None, None)
    if outcome is Outcome.PERMANENT:
        return Decision("dead", None, permanent_reason(last_error, disables_endpoint))
    if attempts_made >= policy.max_attempts:
        return Decision("dead", None, None, exhausted=True)
    if retry_after is not None:
        delay = policy.delay_for_retry_after(retry_after, rng)
    else:
        delay = policy.delay_after(attempts_made, rng)
    return Decision("scheduled", now + dt.timedelta(seconds=delay), None)


def permanent_reason(last_error: str, disables_endpoint: bool = False) -> str:
    """'410 Gone: endpoint disabled', '404 Not Found: permanent failure, not retried'."""
    what = _short(last_error)
    if disables_endpoint:
        return f"{what}: endpoint disabled"
    return f"{what}: permanent failure, not retried"


def exhausted_reason(
    attempts_made: int,
    first_attempt_at: dt.datetime | None,
    last_attempt_at: dt.datetime,
    last_status: int | None,
    last_error: str,
) -> str:
    """'8 attempts over 17 h, last: 503' (or 'last: connect failed ...' without an answer).

    The status alone is enough when the receiver answered; when the attempt ended
    otherwise (a deadline cut a trickling body, say) the error says more than its status.
    """
    answered = last_status is not None and last_error.startswith("HTTP ")
    last = str(last_status) if answered else _short(last_error, 200)
    noun = "attempt" if attempts_made == 1 else "attempts"
    if first_attempt_at is None or attempts_made == 1:
        return f"{attempts_made} {noun}, last: {last}"
    span = (last_attempt_at - first_attempt_at).total_seconds()
    return f"{attempts_made} {noun} over {format_duration(span)}, last: {last}"


def format_duration(seconds: float) -> str:
    """A short human span: '45 s', '12 min', '17 h', '3 d'."""
    seconds = max(seconds, 0.0)
    if seconds < 90:
        return f"{round(seconds)} s"
    if seconds < 90 * 60:
        return f"{round(seconds / 60)} min"
    if seconds < 48 * 3600:
        return f"{round(seconds / 3600)} h"
    return f"{round(seconds / 86400)} d"


def _short(error: str, limit: int = 300) -> str:
    """'HTTP 410 Gone' -> '410 Gone'; anything else as it is, on one line."""
    text = " ".join(error.split()) or "unknown error"
    if text.startswith("HTTP "):
        text = text[5:]
    return text[:limit]


def matching_rule(rules: Mapping[str, T], event_type: str) -> T | None:
    """The rule of the most specific pattern matching `event_type`.

    Patterns are those of endpoint subscriptions: an exact type beats the longest
    matching 'prefix.*', which beats '*'.
    """
    if event_type in rules:
        return rules[event_type]
    best: tuple[int, T] | None = None
    for pattern, rule in rules.items():
        if pattern == "*":
            rank = 0
        elif pattern.endswith(".*") and event_type.startswith(pattern[:-1]):
            rank = len(pattern)
        else:
            continue
        if best is None or rank > best[0]:
            best = (rank, rule)
    return best[1] if best else None
