"""The reaper's own account of what it did, and its loop (fast: no HTTP, no worker).

What a rescue does to a delivery is pinned in test_fencing and test_rules; here: the
operator's log lines (count, ids capped at 20, the poison line with the rescue limit)
and the loop around `run_once` (runs every interval, survives a failing pass, stops).
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.reaper import Reaper, ReaperConfig
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.relay import Relay
from tests.helpers import add_endpoint, rows
from tests.operator_helpers import publish_many


async def expired_leases(
    engine: Engine, async_engine: AsyncEngine, box: SecretBox, clock: ManualClock, count: int
) -> list[int]:
    """`count` deliveries whose worker died holding the lease (expired a minute ago)."""
    add_endpoint(engine, box, "http://127.0.0.1:1/hook", "order.*")
    publish_many(engine, "order.created", count)
    await Relay(async_engine, clock).run_until_idle()
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE deliveries SET state = 'in_flight', locked_by = 'gone', "
                "claims = claims + 1, lease_expires_at = :expired"
            ),
            {"expired": clock.now()},
        )
    clock.advance(60)
    return [r["id"] for r in rows(engine, "SELECT id FROM deliveries ORDER BY id")]


def reaper_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "delivery.reaper"]


async def test_rescues_and_poisons_are_logged_with_counts_and_the_first_20_ids(
    engine: Engine,
    async_engine: AsyncEngine,
    box: SecretBox,
    clock: ManualClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ids = await expired_leases(engine, async_engine, box, clock, 23)
    # The last 21 were rescued once before: with max_rescues=2 this rescue makes them dead.
    poisons = ids[2:]
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE deliveries SET rescues = 1 WHERE id = ANY(:ids)"), {"ids": poisons}
        )
    caplog.set_level(logging.INFO, logger="delivery.reaper")
    reaper = Reaper(async_engine, clock, ReaperConfig(max_rescues=2))
    assert sorted(await reaper.run_once()) == ids
    states = {r["id"]: r["state"] for r in rows(engine, "SELECT id, state FROM deliveries")}
    assert {i for i, state in states.items() if state == "dead"} == set(poisons)
    (warning_level, rescued), (error_level, dead) = reaper_lines(caplog)
    assert warning_level == logging.WARNING
    assert rescued.startswith(
        "lease expired, 23 deliveries rescued (their worker stopped without recording an "
        "outcome); due again, no attempt spent: ["
    )
    assert listed(rescued) <= set(ids) and len(listed(rescued)) == 20
    assert error_level == logging.ERROR
    assert dead.startswith(
        "21 deliveries were rescued 2 times and are now dead (possible poison): ["
    )
    assert listed(dead) <= set(poisons) and len(listed(dead)) == 20


def listed(line: str) -> set[int]:
    """The ids a log line lists at its end (`[1, 2, 3]`), each once."""
    assert line.endswith("]")
    ids = [int(i) for i in line[line.rindex("[") + 1 : -1].split(",")]
    assert len(set(ids)) == len(ids)
    return set(ids)


async def test_a_poison_made_dead_is_reported_like_any_dead_delivery(
    engine: Engine, async_engine: AsyncEngine, box: SecretBox, clock: ManualClock
) -> None:
    first, poison = await expired_leases(engine, async_engine, box, clock, 2)
    with engine.begin() as conn:
        conn.execute(text("UPDATE deliveries SET rescues = 1 WHERE id = :id"), {"id": poison})
    assert sorted(await Reaper(async_engine, clock, ReaperConfig(max_rescues=2)).run_once()) == [
        first,
        poison,
    ]
    reports = rows(
        engine, "SELECT payload FROM outbox_events WHERE event_type = 'delivery.dead' ORDER BY id"
    )
    assert [r["payload"]["delivery_id"] for r in reports] == [poison]


async def test_a_pass_with_nothing_expired_logs_nothing(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="delivery.reaper")
    assert await Reaper(async_engine, clock).run_once() == []
    assert reaper_lines(caplog) == []


class RanPastItsStop(BaseException):
    pass


class ScriptedReaper(Reaper):
    """The real loop around a scripted pass: the loop is what is under test here."""

    def __init__(self, script: list[BaseException | None], stop: asyncio.Event) -> None:
        super().__init__(None, ManualClock(), ReaperConfig(interval=0.01))  # type: ignore[arg-type]
        self.script = script
        self.passes = 0
        self.stop = stop

    async def run_once(self) -> list[int]:
        if not self.script:
            raise RanPastItsStop  # not an Exception: the loop must not swallow it
        self.passes += 1
        step = self.script.pop(0)
        if not self.script:
            self.stop.set()
        if step is not None:
            raise step
        return []


async def test_the_loop_runs_every_interval_survives_failures_and_stops(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stop = asyncio.Event()
    lost = ConnectionError("server closed the connection")
    reaper = ScriptedReaper([None, RuntimeError("a bug"), lost, None], stop)
    caplog.set_level(logging.WARNING, logger="outbox.database")
    # Each pass after the first comes only when the interval's wait times out.
    await asyncio.wait_for(reaper.run(stop), 5)
    assert reaper.passes == 4
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "outbox.database"]
    assert lines[0] == (logging.ERROR, "reaper failed; retrying")
    assert lines[1][0] == logging.ERROR
    assert lines[1][1].startswith("PostgreSQL unreachable (reaper: server closed the connection)")
    # The next successful pass ends the outage (one line), so nothing stays "down".
    assert lines[2][0] == logging.WARNING and "reachable again" in lines[2][1]
    assert len(lines) == 3


async def test_a_stopped_loop_does_not_run() -> None:
    stop = asyncio.Event()
    stop.set()
    reaper = ScriptedReaper([None], stop)
    await asyncio.wait_for(reaper.run(stop), 5)
    assert reaper.passes == 0
