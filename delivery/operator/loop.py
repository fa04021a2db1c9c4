"""The event loop `outbox run` uses: uvloop when it is installed, else asyncio's own.

Why: the event loop's own socket handling and callbacks are a visible share of a
worker's profile, and uvloop does that part in C. Measured on the backlog drain its
effect on worker CPU per delivery was within the shared box's noise (docs/performance.md,
performance; docs/performance-history.md), so it is optional, not a dependency:
without it (or with OUTBOX_EVENT_LOOP=asyncio) the standard loop runs the same code.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
from collections.abc import Coroutine
from typing import Any, TypeVar

from outbox.errors import ConfigurationError

T = TypeVar("T")


def uvloop_available() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def settle_heap() -> None:
    """Put what start-up built (the modules, the service's objects) out of the cyclic
    collector's reach, once, before the loop starts. Why: a full collection walks every
    tracked object, about 130,000 after `outbox run`'s imports, and stops the event
    loop while it does (115 to 307 ms measured on this 2-core box under load), which
    lands in the latency of every delivery behind it. Start-up alone triggers such
    collections; a long-running service meets them whenever its long-lived objects grow
    by a quarter. Frozen objects are still freed by reference counting; only cycles among
    them are never collected. No collection first: it would cost every start a full walk,
    and start-up's own collections have already run."""
    gc.freeze()


def run_loop(main: Coroutine[Any, Any, T], choice: str = "auto") -> T:
    """asyncio.run(main) on the chosen loop: 'auto', 'uvloop' or 'asyncio'."""
    if choice not in ("auto", "uvloop", "asyncio"):
        main.close()
        raise ConfigurationError(
            f"unknown event loop {choice!r}: set OUTBOX_EVENT_LOOP to auto, uvloop or asyncio"
        )
    if choice == "asyncio" or (choice == "auto" and not uvloop_available()):
        return asyncio.run(main)
    if not uvloop_available():
        main.close()
        raise ConfigurationError(
            "OUTBOX_EVENT_LOOP=uvloop but uvloop is not installed: pip install uvloop, "
            "or set OUTBOX_EVENT_LOOP=auto"
        )
    import uvloop

    return uvloop.run(main)
