"""`outbox run` defaults: one process per core, and uvloop when it is installed."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from click.testing import CliRunner

from delivery.operator import cli
from delivery.operator.cli import service
from delivery.operator.loop import run_loop, uvloop_available
from delivery.operator.supervisor import ProcessSpec, default_processes
from outbox.crypto import generate_key
from outbox.errors import ConfigurationError


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_auto_runs_on_uvloop_when_installed_and_asyncio_on_request() -> None:
    assert uvloop_available()  # installed with the test extra (pgqueuer depends on it)
    assert run_loop(_loop_module(), "auto").startswith("uvloop")
    assert run_loop(_loop_module(), "uvloop").startswith("uvloop")
    assert run_loop(_loop_module(), "asyncio").startswith("asyncio")


def test_auto_falls_back_to_asyncio_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("delivery.operator.loop.uvloop_available", lambda: False)
    assert run_loop(_loop_module(), "auto").startswith("asyncio")
    with pytest.raises(ConfigurationError, match="uvloop is not installed: pip install uvloop"):
        run_loop(_loop_module(), "uvloop")
    with pytest.raises(ConfigurationError, match="set OUTBOX_EVENT_LOOP to auto, uvloop"):
        run_loop(_loop_module(), "trio")


def test_run_starts_one_process_per_core_by_default(
    monkeypatch: pytest.MonkeyPatch, database_url: str
) -> None:
    started: list[tuple[ProcessSpec, int]] = []

    def fake_supervised(
        spec: ProcessSpec, processes: int, grace: float, on_ready: object = None
    ) -> int:
        started.append((spec, processes))
        return 0

    monkeypatch.setattr("delivery.operator.supervisor.run_supervised", fake_supervised)
    monkeypatch.setattr(service, "default_processes", lambda: 3)
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    monkeypatch.setenv("OUTBOX_SECRET_KEYS", generate_key("k1"))
    monkeypatch.setenv("OUTBOX_EVENT_LOOP", "asyncio")
    monkeypatch.delenv("OUTBOX_PROCESSES", raising=False)
    result = CliRunner().invoke(cli.main, ["run"])
    assert result.exit_code == 0, result.output
    [(spec, processes)] = started
    assert processes == 3
    assert spec.event_loop == "asyncio"  # the children run on the loop the settings chose

    started.clear()
    result = CliRunner().invoke(cli.main, ["run", "--processes", "1", "--help"])
    assert "one per core" in result.output


def test_default_processes_counts_the_cores_this_process_may_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    assert default_processes() == 5

    def missing(pid: int) -> Any:
        raise AttributeError

    monkeypatch.setattr("os.sched_getaffinity", missing)
    monkeypatch.setattr("os.cpu_count", lambda: None)
    assert default_processes() == 1


def test_settle_heap_leaves_a_full_collection_only_what_came_after_start_up() -> None:
    """`outbox run` freezes what start-up built before its loop starts: the service's
    modules and objects leave the collector's generations (a full collection walks what
    is left), and a cycle made afterwards is still collected."""
    import gc

    import delivery.operator.app  # noqa: F401  (what `outbox run` has imported by then)
    from delivery.operator.loop import settle_heap

    tracked = len(gc.get_objects())
    try:
        settle_heap()
        assert gc.get_freeze_count() >= tracked // 2
        assert len(gc.get_objects()) < tracked // 20

        class Node:
            other: object = None

        first, second = Node(), Node()
        first.other, second.other = second, first
        del first, second
        assert gc.collect() >= 2  # the new cycle is found: only start-up is frozen
    finally:
        gc.unfreeze()  # the rest of this test process collects as before
