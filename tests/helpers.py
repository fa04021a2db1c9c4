"""Small helpers the integration tests share."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, text

from outbox.crypto import SecretBox
from outbox.endpoints import CreatedEndpoint, create_endpoint, set_enabled

# The repository's root, for tests that read its files (README, docs, config, tools).
ROOT = Path(__file__).resolve().parent.parent

# The SSRF guard refuses loopback unless allowed; test receivers live there.
LOOPBACK = ("127.0.0.0/8",)


def add_endpoint(
    engine: Engine, box: SecretBox, url: str, events: str = "*", **kwargs: Any
) -> CreatedEndpoint:
    with engine.begin() as conn:
        return create_endpoint(conn, box, url=url, event_types=events, **kwargs)


def disable(engine: Engine, uid: str) -> None:
    with engine.begin() as conn:
        set_enabled(conn, uid, enabled=False, reason="test", actor="test")


def rows(engine: Engine, sql: str, **params: Any) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(text(sql), params).mappings())


def scalar(engine: Engine, sql: str, **params: Any) -> Any:
    with engine.connect() as conn:
        return conn.execute(text(sql), params).scalar()


async def until(
    condition: Callable[[], object], what: str = "the condition", seconds: float = 20.0
) -> None:
    """Wait until `condition()` holds, looking every 10 ms; fail naming `what` after `seconds`.

    Tests wait on the event itself, never for a fixed time: the deadline only bounds a
    hang, so a slow or loaded machine makes a test slower, not wrong.
    """
    try:
        async with asyncio.timeout(seconds):
            while not condition():
                await asyncio.sleep(0.01)
    except TimeoutError:
        pytest.fail(f"waited {seconds:g} s for {what}")
