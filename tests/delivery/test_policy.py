"""The delivery rules as pure functions: no server, no database, no clock."""

from __future__ import annotations

import datetime as dt
import email.utils
import random

import pytest

from delivery.policy import (
    RETRY_AFTER_MIN_SECONDS,
    Classification,
    Decision,
    Outcome,
    RetryPolicy,
    classify_status,
    decide,
    exhausted_reason,
    format_duration,
    matching_rule,
    parse_retry_after,
    parse_status_overrides,
    permanent_reason,
)

NOW = dt.datetime(2030, 1, 1, 12, 0, tzinfo=dt.UTC)


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (200, Classification(Outcome.SUCCEEDED)),
        (204, Classification(Outcome.SUCCEEDED)),
        (299, Classification(Outcome.SUCCEEDED)),
        (300, Classification(Outcome.PERMANENT)),
        (301, Classification(Outcome.PERMANENT)),
        (308, Classification(Outcome.PERMANENT)),
        (400, Classification(Outcome.PERMANENT)),
        (404, Classification(Outcome.PERMANENT)),
        (408, Classification(Outcome.RETRYABLE)),
        (410, Classification(Outcome.PERMANENT, disables_endpoint=True)),
        (425, Classification(Outcome.RETRYABLE)),
        (429, Classification(Outcome.RETRYABLE)),
        (451, Classification(Outcome.PERMANENT)),
        (500, Classification(Outcome.RETRYABLE)),
        (503, Classification(Outcome.RETRYABLE)),
        (599, Classification(Outcome.RETRYABLE)),
        (101, Classification(Outcome.PERMANENT)),
        (600, Classification(Outcome.PERMANENT)),
    ],
)
def test_default_status_table(status: int, expected: Classification) -> None:
    assert classify_status(status) == expected


def test_endpoint_overrides_win_over_the_table_including_410() -> None:
    overrides = parse_status_overrides(
        {"404": "retryable", "410": "retryable", "409": "succeeded", "500": "permanent"}
    )
    assert classify_status(404, overrides) == Classification(Outcome.RETRYABLE)
    assert classify_status(410, overrides) == Classification(Outcome.RETRYABLE)
    assert classify_status(409, overrides) == Classification(Outcome.SUCCEEDED)
    assert classify_status(500, overrides) == Classification(Outcome.PERMANENT)
    assert classify_status(400, overrides) == Classification(Outcome.PERMANENT)


def test_hand_edited_junk_in_stored_overrides_is_ignored() -> None:
    parsed = parse_status_overrides({"abc": "retryable", "404": "maybe", "418": "ambiguous"})
    assert parsed == {}
    # A junk entry skips itself only: the valid entries after it still apply.
    parsed = parse_status_overrides({"abc": "retryable", "404": "retryable"})
    assert parsed == {404: Outcome.RETRYABLE}


def test_retry_after_seconds_and_http_date() -> None:
    assert parse_retry_after("120", NOW) == 120.0
    in_five_minutes = email.utils.format_datetime(NOW + dt.timedelta(minutes=5), usegmt=True)
    assert parse_retry_after(in_five_minutes, NOW) == 300.0
    # '-0000' (no zone given) parses to a naive time; it is read as UTC.
    naive = email.utils.format_datetime((NOW + dt.timedelta(minutes=5)).replace(tzinfo=None))
    assert naive.endswith("-0000")
    assert parse_retry_after(naive, NOW) == 300.0


def test_retry_after_is_clamped_when_parsed() -> None:
    assert parse_retry_after(" 0 ", NOW) == RETRY_AFTER_MIN_SECONDS
    an_hour_ago = email.utils.format_datetime(NOW - dt.timedelta(hours=1), usegmt=True)
    assert parse_retry_after(an_hour_ago, NOW) == RETRY_AFTER_MIN_SECONDS
    assert parse_retry_after("99999999", NOW) == 3600.0
    assert parse_retry_after("99999999", NOW, maximum=7200.0) == 7200.0
    assert parse_retry_after("9" * 400, NOW) == 3600.0


@pytest.mark.parametrize("garbage", [None, "", "soon", "-5", "1.5", "12abc", "٣", "Mon, 99 Foo"])
def test_retry_after_garbage_is_ignored(garbage: str | None) -> None:
    assert parse_retry_after(garbage, NOW) is None


def test_retry_after_is_clamped_and_never_earlier_than_asked() -> None:
    policy = RetryPolicy(schedule=(5.0,), max_attempts=8, jitter=0.2, retry_after_max=3600)
    rng = random.Random(1)
    delays = [policy.delay_for_retry_after(120, rng) for _ in range(500)]
    assert min(delays) >= 120 and max(delays) <= 144
    assert policy.delay_for_retry_after(0, rng) >= RETRY_AFTER_MIN_SECONDS
    assert policy.delay_for_retry_after(10**9, rng) <= 3600 * 1.2


def test_schedule_jitter_bounds_and_the_last_delay_repeats() -> None:
    policy = RetryPolicy(schedule=(10.0, 100.0), max_attempts=8, jitter=0.2)
    rng = random.Random(7)
    first = [policy.delay_after(1, rng) for _ in range(500)]
    later = [policy.delay_after(6, rng) for _ in range(500)]
    assert 8 <= min(first) < 8.5 and 11.5 < max(first) <= 12
    assert min(later) >= 80 and max(later) <= 120
    no_jitter = RetryPolicy(schedule=(10.0,), max_attempts=8, jitter=0.0)
    assert no_jitter.delay_after(3, rng) == 10.0


def test_decide_covers_every_outcome() -> None:
    policy = RetryPolicy(schedule=(10.0,), max_attempts=3, jitter=0.0)
    rng = random.Random(0)

    def run(outcome: Outcome, attempts: int, retry_after: float | None = None) -> Decision:
        return decide(
            outcome,
            attempts_made=attempts,
            policy=policy,
            now=NOW,
            rng=rng,
            last_error="HTTP 503 Service Unavailable",
            retry_after=retry_after,
        )

    succeeded = run(Outcome.SUCCEEDED, 1)
    assert succeeded.state == "succeeded"
    retry = run(Outcome.RETRYABLE, 1)
    assert retry.state == "scheduled"
    assert retry.next_attempt_at == NOW + dt.timedelta(seconds=10)
    ambiguous = run(Outcome.AMBIGUOUS, 2)
    assert ambiguous.state == "scheduled"
    told = run(Outcome.RETRYABLE, 1, retry_after=300.0)
    assert told.next_attempt_at == NOW + dt.timedelta(seconds=300)
    exhausted = run(Outcome.RETRYABLE, 3)
    assert (exhausted.state, exhausted.exhausted) == ("dead", True)
    permanent = run(Outcome.PERMANENT, 1)
    assert (permanent.state, permanent.final_reason) == (
        "dead",
        "503 Service Unavailable: permanent failure, not retried",
    )
    gone = decide(
        Outcome.PERMANENT,
        attempts_made=1,
        policy=policy,
        now=NOW,
        rng=rng,
        last_error="HTTP 410 Gone",
        disables_endpoint=True,
    )
    assert (gone.state, gone.final_reason) == ("dead", "410 Gone: endpoint disabled")


def test_reasons_read_like_sentences() -> None:
    assert permanent_reason("HTTP 410 Gone", disables_endpoint=True) == (
        "410 Gone: endpoint disabled"
    )
    assert permanent_reason("HTTP 404 Not Found") == "404 Not Found: permanent failure, not retried"
    first = NOW - dt.timedelta(hours=17, minutes=3)
    assert exhausted_reason(8, first, NOW, 503, "HTTP 503 Service Unavailable") == (
        "8 attempts over 17 h, last: 503"
    )
    assert exhausted_reason(1, NOW, NOW, None, "connect failed: ConnectError: refused") == (
        "1 attempt, last: connect failed: ConnectError: refused"
    )
    # A status whose body was cut by the deadline: the error says more than "200".
    cut = "deadline of 0.5s passed reading the response body after status 200; may have arrived"
    assert exhausted_reason(2, first, NOW, 200, cut).endswith("last: " + cut)
    # Long errors are cut: 200 characters in an exhausted reason, 300 in a permanent one.
    long_error = "x" * 500
    assert exhausted_reason(2, first, NOW, None, long_error) == (
        "2 attempts over 17 h, last: " + "x" * 200
    )
    assert permanent_reason(long_error) == "x" * 300 + ": permanent failure, not retried"
    assert permanent_reason("  ") == "unknown error: permanent failure, not retried"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0 s"),
        (45, "45 s"),
        (89, "89 s"),
        (90, "2 min"),
        (600, "10 min"),
        (3000, "50 min"),
        (5399, "90 min"),
        (5400, "2 h"),
        (3 * 3600, "3 h"),
        (61200, "17 h"),
        (171000, "48 h"),
        (172800, "2 d"),
        (302400, "4 d"),
        (5e5, "6 d"),
    ],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_most_specific_event_type_rule_wins() -> None:
    rules = {"*": "any", "order.*": "orders", "order.refund.*": "refunds", "order.paid": "paid"}
    assert matching_rule(rules, "order.paid") == "paid"
    assert matching_rule(rules, "order.refund.created") == "refunds"
    assert matching_rule(rules, "order.created") == "orders"
    assert matching_rule(rules, "invoice.paid") == "any"
    assert matching_rule({"order.*": 1}, "orders.created") is None
    assert matching_rule({}, "x") is None


def test_one_thousand_retries_due_together_spread_over_the_jitter_window() -> None:
    policy = RetryPolicy(schedule=(60.0,), max_attempts=8, jitter=0.2)
    rng = random.Random()
    delays = [policy.delay_after(1, rng) for _ in range(1000)]
    assert min(delays) >= 48 and max(delays) <= 72
    buckets = [0] * 24
    for delay in delays:
        buckets[min(int(delay - 48), 23)] += 1
    assert all(count > 0 for count in buckets), buckets
    assert max(buckets) < 100, buckets  # about 42 each; never a spike
