"""Injected time.

Logic never reads the wall clock itself: services take a `Clock`, production passes
`SystemClock`, and tests pass `ManualClock` and advance it instead of sleeping.
"""

from __future__ import annotations

import datetime as dt
from typing import Protocol

UTC = dt.UTC


class Clock(Protocol):
    def now(self) -> dt.datetime:
        """The current time as an aware UTC datetime."""
        ...


class SystemClock:
    def now(self) -> dt.datetime:
        return dt.datetime.now(UTC)


class ManualClock:
    """A clock that only moves when told to."""

    def __init__(self, start: dt.datetime | None = None) -> None:
        self._now = start or dt.datetime(2030, 1, 1, tzinfo=UTC)

    def now(self) -> dt.datetime:
        return self._now

    def advance(self, seconds: float = 0.0, **delta: float) -> dt.datetime:
        self._now += dt.timedelta(seconds=seconds, **delta)
        return self._now

    def set(self, when: dt.datetime) -> None:
        self._now = when
