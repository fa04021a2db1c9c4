"""Chart buckets and axes (delivery.operator.console.charts): one point, a gap, a full day.

Pure code on plain rows, plus the bucketing SQL on a real database: the x axis always spans
the whole range, each range has its own bucket, and a bucket without attempts is a gap.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.operator.console import charts, queries
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.relay import Relay
from tests.helpers import add_endpoint
from tests.operator_helpers import publish_many

NOW = dt.datetime(2026, 12, 1, 17, 42, 30, tzinfo=dt.UTC)
HOUR, DAY = charts.RANGES["hour"], charts.RANGES["day"]


def _row(bucket: dt.datetime, succeeded: int = 1, failed: int = 0) -> dict[str, Any]:
    return {
        "bucket": bucket,
        "succeeded": succeeded,
        "retryable": failed,
        "permanent": 0,
        "ambiguous": 0,
        "p50_ms": 12.0,
        "p99_ms": 40.0,
    }


def _ts(moment: dt.datetime) -> int:
    return int(moment.timestamp())


def test_one_point_sits_in_an_axis_spanning_the_whole_hour() -> None:
    point = dt.datetime(2026, 12, 1, 17, 40, tzinfo=dt.UTC)
    data = charts.series([_row(point, succeeded=3)], HOUR, NOW)
    assert (data["from"], data["to"]) == (_ts(NOW - dt.timedelta(hours=1)), _ts(NOW))
    assert data["bucket_seconds"] == 60
    # A minute per bucket from the first whole minute in the range to now.
    assert data["buckets"][0] == _ts(dt.datetime(2026, 12, 1, 16, 43, tzinfo=dt.UTC))
    assert data["buckets"][-1] == _ts(dt.datetime(2026, 12, 1, 17, 42, tzinfo=dt.UTC))
    assert len(data["buckets"]) == 60
    assert data["points"] == 1
    assert [v for v in data["succeeded"] if v is not None] == [3]
    assert data["succeeded"][data["buckets"].index(_ts(point))] == 3
    # Ticks every ten minutes on round times, labelled in UTC, all inside the range.
    assert data["labels"] == ["16:50", "17:00", "17:10", "17:20", "17:30", "17:40"]
    assert all(data["from"] <= tick <= data["to"] for tick in data["ticks"])


def test_a_gap_is_none_not_a_line_across_it() -> None:
    before = dt.datetime(2026, 12, 1, 17, 10, tzinfo=dt.UTC)
    after = dt.datetime(2026, 12, 1, 17, 20, tzinfo=dt.UTC)
    data = charts.series([_row(before, failed=2), _row(after)], HOUR, NOW)
    first, last = data["buckets"].index(_ts(before)), data["buckets"].index(_ts(after))
    assert data["failed"][first] == 2 and data["failed"][last] == 0
    assert data["succeeded"][first + 1 : last] == [None] * (last - first - 1)
    assert data["p99_ms"][first + 1 : last] == [None] * (last - first - 1)
    assert data["points"] == 2


def test_a_full_day_has_ten_minute_buckets_and_its_own_axis() -> None:
    first, _ = charts.bounds(DAY, NOW)
    rows = [_row(first + n * DAY.bucket, succeeded=n) for n in range(144)]
    data = charts.series(rows, DAY, NOW)
    assert data["bucket_seconds"] == 600
    assert len(data["buckets"]) == 144 and data["points"] == 144
    assert None not in data["succeeded"]
    assert (data["from"], data["to"]) == (_ts(NOW - dt.timedelta(days=1)), _ts(NOW))
    assert data["buckets"][0] == _ts(dt.datetime(2026, 11, 30, 17, 50, tzinfo=dt.UTC))
    assert data["labels"] == [
        "18:00",
        "21:00",
        "00:00",
        "03:00",
        "06:00",
        "09:00",
        "12:00",
        "15:00",
    ]


def test_no_data_is_an_empty_series_over_the_same_axis() -> None:
    data = charts.series([], DAY, NOW)
    assert data["points"] == 0
    assert set(data["succeeded"]) == {None}
    assert (data["from"], data["to"]) == (_ts(NOW - dt.timedelta(days=1)), _ts(NOW))


def test_an_unknown_range_is_refused_by_name() -> None:
    assert charts.chart_range(None) is HOUR
    with pytest.raises(ValueError, match="range must be one of hour, day, not 'week'"):
        charts.chart_range("week")


async def test_the_sql_buckets_match_and_read_only_the_range(
    engine: Engine, async_engine: AsyncEngine, box: SecretBox
) -> None:
    """Attempts before the range and after now are left out; the rest land in the buckets
    charts.bucket_starts counts (date_bin from the same origin), and the plan reads the
    range by the started_at index rather than scanning the history."""
    add_endpoint(engine, box, "http://127.0.0.1:9/never", "*")
    publish_many(engine, "order.created", 1)
    await Relay(async_engine, ManualClock(NOW)).run_until_idle()
    offsets = {"too_old": -3700, "first": -3540, "gap_before": -600, "gap_after": -60, "ahead": 5}
    with engine.begin() as conn:
        for number, seconds in enumerate(offsets.values(), 1):
            conn.execute(
                text(
                    "INSERT INTO delivery_attempts (delivery_id, attempt_number, started_at,"
                    " duration_ms, outcome, worker_id)"
                    " SELECT min(id), :n, :at, 20, 'succeeded', 'w' FROM deliveries"
                ),
                {"n": number, "at": NOW + dt.timedelta(seconds=seconds)},
            )
    since, until = charts.bounds(HOUR, NOW)
    params = {"since": since, "until": until, "bucket_seconds": 60.0, "tenant_uid": None}
    with engine.connect() as conn:
        found = list(conn.execute(queries.ATTEMPT_SERIES, params).mappings())
        conn.execute(text("SET enable_seqscan = off"))
        plan = "\n".join(
            str(r[0]) for r in conn.execute(text(f"EXPLAIN {queries.ATTEMPT_SERIES.text}"), params)
        )
    # SQL itself leaves out what is before the range and after now (not only the series).
    assert [int(row["succeeded"]) for row in found] == [1, 1, 1]
    data = charts.series(found, HOUR, NOW)
    assert data["points"] == 3
    landed = [data["buckets"][i] for i, v in enumerate(data["succeeded"]) if v is not None]
    expected = [NOW + dt.timedelta(seconds=s) for s in (-3540, -600, -60)]
    assert landed == [_ts(m.replace(second=0)) for m in expected]
    assert "ix_delivery_attempts_started_at" in plan
