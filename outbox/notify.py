"""LISTEN/NOTIFY wake-ups, with polling as the safety net.

A notification only shortens a wait: services poll anyway, so a lost notification
or a dropped listener connection delays work by at most one poll interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import psycopg

from outbox.db import libpq_url
from outbox.outage import OUTAGE

log = logging.getLogger(__name__)


class Listener:
    """Owns one autocommit connection that LISTENs and sets an asyncio.Event per channel."""

    def __init__(self, url: str, channels: list[str]) -> None:
        self._dsn = libpq_url(url)
        self.events = {channel: asyncio.Event() for channel in channels}
        self.ready = asyncio.Event()  # set once LISTEN is in place (tests wait on it)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._listen_forever(), name="outbox-listener")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _listen_forever(self) -> None:
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(
                    self._dsn, autocommit=True
                ) as conn:
                    for channel in self.events:
                        await conn.execute(f'LISTEN "{channel}"')
                    self.ready.set()
                    OUTAGE.succeeded()
                    async for notification in conn.notifies():
                        event = self.events.get(notification.channel)
                        if event is not None:
                            event.set()
            except psycopg.Error as exc:
                self.ready.clear()
                # Services poll meanwhile; the outage log says when the server is back.
                OUTAGE.failed("LISTEN connection", exc)
                await asyncio.sleep(1.0)


async def wait_for_any(*events: asyncio.Event, timeout: float) -> None:  # noqa: ASYNC109
    """Return when any event is set or the timeout passes, whichever comes first."""
    waiters = [asyncio.create_task(event.wait()) for event in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
