"""Chart series for the console and the portal: buckets, gaps and axes, as pure code.

Each range has its own bucket (a minute for the hour, ten minutes for the day) and its x
axis always spans the whole range, from `now - span` to `now`, whatever the data: one
point sits where it happened instead of stretching over the chart. A bucket without
attempts is a gap (None), drawn as a break in the line, never as a line across it.
The SQL (queries.ATTEMPT_SERIES) reads only the range's rows, by the started_at index.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

_EPOCH = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)


@dataclass(frozen=True, slots=True)
class ChartRange:
    """A chart's period: how far back it reaches, its bucket and its axis tick step."""

    name: str
    span: dt.timedelta
    bucket: dt.timedelta
    tick: dt.timedelta


RANGES = {
    "hour": ChartRange(
        "hour", dt.timedelta(hours=1), dt.timedelta(minutes=1), dt.timedelta(minutes=10)
    ),
    "day": ChartRange("day", dt.timedelta(days=1), dt.timedelta(minutes=10), dt.timedelta(hours=3)),
}


def chart_range(name: str | None) -> ChartRange:
    """The range a request names; anything else is refused by name, not guessed."""
    chosen = RANGES.get(name or "hour")
    if chosen is None:
        raise ValueError(f"range must be one of {', '.join(RANGES)}, not {name!r}")
    return chosen


def _ceil(moment: dt.datetime, step: dt.timedelta) -> dt.datetime:
    """The first multiple of `step` (counted from 2000-01-01 UTC) at or after `moment`."""
    steps = -((_EPOCH - moment) // step)
    return _EPOCH + steps * step


def bounds(rng: ChartRange, now: dt.datetime) -> tuple[dt.datetime, dt.datetime]:
    """The first bucket's start and the end of the range: what the SQL reads, no more."""
    return _ceil(now - rng.span, rng.bucket), now


def bucket_starts(rng: ChartRange, now: dt.datetime) -> list[dt.datetime]:
    first, end = bounds(rng, now)
    count = (end - first) // rng.bucket + 1
    return [first + n * rng.bucket for n in range(count)]


def axis_ticks(rng: ChartRange, now: dt.datetime) -> list[tuple[int, str]]:
    """Tick positions (epoch seconds) and their UTC labels, on round times in the range."""
    start = now - rng.span
    tick = _ceil(start, rng.tick)
    ticks: list[tuple[int, str]] = []
    while tick <= now:
        ticks.append((int(tick.timestamp()), tick.astimezone(dt.UTC).strftime("%H:%M")))
        tick += rng.tick
    return ticks


def series(rows: Iterable[Mapping[Any, Any]], rng: ChartRange, now: dt.datetime) -> dict[str, Any]:
    """The chart's JSON: every bucket of the range, None where nothing was attempted."""
    by_bucket = {row["bucket"]: row for row in rows}
    starts = bucket_starts(rng, now)
    found = [by_bucket.get(start) for start in starts]

    def column(read: Any) -> list[Any]:
        return [None if row is None else read(row) for row in found]

    ticks = axis_ticks(rng, now)
    return {
        "range": rng.name,
        "bucket_seconds": int(rng.bucket.total_seconds()),
        "from": int((now - rng.span).timestamp()),
        "to": int(now.timestamp()),
        "buckets": [int(start.timestamp()) for start in starts],
        "points": sum(row is not None for row in found),
        "succeeded": column(lambda r: int(r["succeeded"])),
        "failed": column(lambda r: int(r["retryable"] + r["permanent"] + r["ambiguous"])),
        "p50_ms": column(lambda r: round(float(r["p50_ms"]), 1)),
        "p99_ms": column(lambda r: round(float(r["p99_ms"]), 1)),
        "ticks": [position for position, _ in ticks],
        "labels": [label for _, label in ticks],
    }
