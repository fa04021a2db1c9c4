"""The served console a browser test drives: its database, receiver and clock.

The server, the receiver and the delivery work run on an event loop in a background
thread, so the tests themselves can drive Playwright's synchronous API. The fixtures
that start it and Chromium are in tests/browser/conftest.py.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.receiver import Receiver
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.tenants import create_tenant
from outbox.tokens import create_token
from tests.operator_helpers import deliver

T = TypeVar("T")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


class BackgroundLoop:
    """An asyncio loop in a thread; `run` waits for a coroutine scheduled on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@dataclass
class Site:
    """The console at `base_url`, with its database, receiver and clock."""

    base_url: str
    engine: Engine
    async_engine: AsyncEngine
    receiver: Receiver
    box: SecretBox
    clock: ManualClock
    loop: BackgroundLoop

    def deliver(self) -> None:
        """Relay what was published and give every due delivery one attempt."""
        self.loop.run(deliver(self.async_engine, self.box, self.clock))

    def token(self, role: str, name: str, tenant: str | None = None) -> str:
        with self.engine.begin() as conn:
            return create_token(conn, name=name, role=role, actor="test", tenant=tenant)[1]

    def tenant(self, uid: str) -> str:
        with self.engine.begin() as conn:
            create_tenant(conn, uid, name=uid.title())
        return uid


def sign_in(page: Any, site: Site, token: str) -> None:
    """Sign in to the console with `token` and land on its overview."""
    page.goto(f"{site.base_url}/console/login")
    page.fill("input[name=token]", token)
    with page.expect_navigation():
        page.click("button[type=submit]")
    assert page.url == f"{site.base_url}/console/"
