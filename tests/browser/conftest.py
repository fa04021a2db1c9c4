"""A real admin server, receiver and Chromium for the console and portal tests."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, make_url, text
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.operator.api import AdminConfig, create_app, serve
from delivery.operator.console.config import ConsoleConfig
from delivery.receiver import Receiver
from outbox.clock import ManualClock
from outbox.crypto import SecretBox, generate_key
from outbox.db import make_async_engine, make_engine, sqlalchemy_url
from tests.browser.site import CHROMIUM_ARGS, BackgroundLoop, Site, chromium_path


@pytest.fixture
def console_config() -> ConsoleConfig:
    """The console's settings; a test parametrizes this name to change them."""
    return ConsoleConfig()


@pytest.fixture
def admin_config(console_config: ConsoleConfig) -> AdminConfig:
    """The admin server's settings; a test parametrizes this name to change them."""
    return AdminConfig(console=console_config)


@contextmanager
def serve_site(
    engine: Engine,
    database_url: str,
    box: SecretBox,
    clock: ManualClock,
    admin_config: AdminConfig,
) -> Iterator[Site]:
    """The admin server (console and portal) and a receiver, on a background loop."""
    loop = BackgroundLoop()
    stop = asyncio.Event()
    ready = threading.Event()
    bound: list[int] = []

    async def start() -> tuple[AsyncEngine, Receiver]:
        async_engine = make_async_engine(database_url)
        receiver = await Receiver().start()
        return async_engine, receiver

    async_engine, receiver = loop.run(start())
    app = create_app(async_engine, box, clock=clock, config=admin_config)

    def started(port: int) -> None:
        bound.append(port)
        ready.set()

    served = asyncio.run_coroutine_threadsafe(
        serve(app, host="127.0.0.1", port=0, stop=stop, on_started=started), loop.loop
    )
    assert ready.wait(20), "the admin server did not start"
    try:
        yield Site(
            base_url=f"http://127.0.0.1:{bound[0]}",
            engine=engine,
            async_engine=async_engine,
            receiver=receiver,
            box=box,
            clock=clock,
            loop=loop,
        )
    finally:
        loop.loop.call_soon_threadsafe(stop.set)
        served.result(20)

        async def shutdown() -> None:
            await receiver.stop()
            await async_engine.dispose()

        loop.run(shutdown())
        loop.close()


@pytest.fixture
def site(
    engine: Engine,
    database_url: str,
    box: SecretBox,
    clock: ManualClock,
    admin_config: AdminConfig,
) -> Iterator[Site]:
    with serve_site(engine, database_url, box, clock, admin_config) as served:
        yield served


@pytest.fixture(scope="module")
def module_site(server_url: str, admin_engine: Engine, template_database: str) -> Iterator[Site]:
    """One server and database for a whole module of page tests (they share their data)."""
    name = f"outbox_pages_{uuid.uuid4().hex[:12]}"
    with admin_engine.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}" TEMPLATE "{template_database}"'))
    url = make_url(sqlalchemy_url(server_url)).set(database=name)
    database_url = url.render_as_string(hide_password=False)
    engine = make_engine(database_url)
    clock = ManualClock(dt.datetime.now(dt.UTC).replace(microsecond=0))
    box = SecretBox.from_setting(generate_key("test"))
    config = AdminConfig(console=ConsoleConfig(portal_brand="Shopfront webhooks"))
    try:
        with serve_site(engine, database_url, box, clock, config) as served:
            yield served
    finally:
        engine.dispose()
        with admin_engine.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(scope="session")
def screenshot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where page tests save their screenshots: OUTBOX_SCREENSHOT_DIR (CI keeps it as an
    artifact), else a pytest temporary directory."""
    chosen = os.environ.get("OUTBOX_SCREENSHOT_DIR")
    if chosen:
        path = Path(chosen)
        path.mkdir(parents=True, exist_ok=True)
        return path
    return tmp_path_factory.mktemp("screenshots")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Debian's Chromium driven by Playwright. Missing under CI is a failure, not a skip.

    Module-scoped: Playwright's sync API keeps an event loop running in this thread while
    it is open, and the async tests of other modules need the thread's loop free.
    """
    executable = chromium_path()
    if executable is None:
        message = "no chromium on PATH: apt-get install -y chromium (.ci/run does)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    opened = context.new_page()
    problems: list[str] = []
    # Our own pages must never trip the Content-Security-Policy or throw.
    opened.on("console", lambda msg: problems.append(msg.text) if msg.type == "error" else None)
    opened.on("pageerror", lambda exc: problems.append(str(exc)))
    opened.problems = problems
    yield opened
    context.close()
