"""A rolling upgrade from the previous release, as docs/operating.md's "Upgrading" tells it.

The previous release (the commit in PREVIOUS_RELEASE) runs from its own checkout: it
migrates the database, publishes continuously and delivers with two `outbox run`
processes. This release's `outbox migrate` runs under them; then the workers are
replaced one at a time with this release's. A real receiver on loopback sees every
event exactly once (by webhook-id), and no process logs an error.
"""

from __future__ import annotations

import asyncio
import collections
import json
import signal
import sys
from functools import partial
from pathlib import Path

import pytest

from delivery.receiver import Receiver
from outbox.crypto import generate_key
from outbox.db import make_engine
from tests.helpers import rows, scalar, until
from tools import previous_release
from tools.previous_release import OUTBOX, ROOT

# The previous release's publish(), as application code would call it: one event per
# transaction, its message id printed once committed, until SIGTERM.
PUBLISHER = """
import signal, sys, time
from outbox import publish
from outbox.db import make_engine

stopping = []
signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
engine = make_engine(sys.argv[1])
i = 0
while not stopping:
    with engine.begin() as conn:
        message_id = publish(conn, "order.created", {"i": i})
    print(message_id, flush=True)
    i += 1
    time.sleep(0.02)
"""


@pytest.fixture(scope="module")
def old_checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The previous release's source, imported instead of this checkout's; its
    dependencies are this venv's (tools/previous_release.py)."""
    try:
        return previous_release.checkout(tmp_path_factory.mktemp("previous-release"))
    except previous_release.PreviousReleaseError as exc:
        pytest.fail(str(exc))


class Fleet:
    """The processes of one test, each logging to its own file; all stopped at the end."""

    def __init__(self, database_url: str, key: str, logs: Path) -> None:
        self.env = previous_release.base_env(
            OUTBOX_DATABASE_URL=database_url,
            OUTBOX_SECRET_KEYS=key,
            OUTBOX_ALLOWED_NETWORKS="127.0.0.0/8",
            OUTBOX_PROCESSES="1",
            OUTBOX_WORKER_POLL_INTERVAL="0.1",
            OUTBOX_RELAY_POLL_INTERVAL="0.1",
            OUTBOX_LOG_SUMMARY_INTERVAL="0",
        )
        self.logs = logs
        self.running: dict[str, asyncio.subprocess.Process] = {}

    def _env(self, release: Path) -> dict[str, str]:
        return previous_release.env(release, self.env)

    async def run(self, release: Path, *args: str) -> tuple[int, str]:
        """A command to completion: exit status and everything it printed."""
        process = await asyncio.create_subprocess_exec(
            *OUTBOX,
            *args,
            cwd=release,
            env=self._env(release),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        output, _ = await asyncio.wait_for(process.communicate(), timeout=120)
        assert process.returncode is not None
        return process.returncode, output.decode()

    async def start(self, name: str, release: Path, *argv: str) -> None:
        with (
            (self.logs / f"{name}.out").open("wb") as out,
            (self.logs / f"{name}.err").open("wb") as err,
        ):
            self.running[name] = await asyncio.create_subprocess_exec(
                *argv, cwd=release, env=self._env(release), stdout=out, stderr=err
            )

    async def stop(self, name: str) -> int:
        process = self.running.pop(name)
        process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(process.wait(), timeout=60)
        assert process.returncode is not None
        return process.returncode

    def err(self, name: str) -> str:
        return (self.logs / f"{name}.err").read_text()

    def out(self, name: str) -> str:
        return (self.logs / f"{name}.out").read_text()

    async def kill_all(self) -> None:
        for process in self.running.values():
            if process.returncode is None:
                process.kill()
                await process.wait()


# Old and new releases start and deliver as real processes: up to 90 s on a busy box.
_wait_for = partial(until, seconds=90)


@pytest.mark.slow
async def test_rolling_upgrade_from_the_previous_release_loses_and_doubles_nothing(
    old_checkout: Path,
    empty_database_url: str,
    receiver: Receiver,
    tmp_path: Path,
) -> None:
    fleet = Fleet(empty_database_url, generate_key("upgrade"), tmp_path)
    delivered = lambda: len(receiver.requests)  # noqa: E731
    try:
        # The previous release's schema, by the previous release's own `outbox migrate`.
        status, output = await fleet.run(old_checkout, "migrate")
        assert status == 0, output
        status, output = await fleet.run(
            old_checkout, "endpoints", "add", receiver.route("/hooks"), "--events", "order.*",
            "--json",
        )  # fmt: skip
        assert status == 0, output
        assert json.loads(output)["id"].startswith("ep_")

        publisher = [sys.executable, "-c", PUBLISHER, empty_database_url]
        await fleet.start("old-publisher", old_checkout, *publisher)
        await fleet.start("old-worker-1", old_checkout, *OUTBOX, "run")
        await fleet.start("old-worker-2", old_checkout, *OUTBOX, "run")
        for n in (1, 2):
            await _wait_for(
                lambda n=n: "outbox running" in fleet.err(f"old-worker-{n}"),  # type: ignore[misc]
                f"old worker {n} to start",
            )
        await _wait_for(lambda: delivered() >= 30, "the previous release to deliver")

        # This release's migration, under load.
        status, migrated = await fleet.run(ROOT, "migrate")
        assert status == 0, migrated
        assert any(line.startswith("0020 ") for line in migrated.splitlines()), migrated
        after_migrate = delivered()
        await _wait_for(
            lambda: delivered() >= after_migrate + 30,
            "the previous release to go on delivering on the new schema",
        )

        # Workers replaced one at a time; the old publisher keeps publishing throughout.
        for n in (1, 2):
            assert await fleet.stop(f"old-worker-{n}") == 0, fleet.err(f"old-worker-{n}")
            await fleet.start(f"new-worker-{n}", ROOT, *OUTBOX, "run")
            await _wait_for(
                lambda n=n: "outbox running" in fleet.err(f"new-worker-{n}"),  # type: ignore[misc]
                f"new worker {n} to start",
            )
            mark = delivered()
            await _wait_for(lambda m=mark: delivered() >= m + 30, f"new worker {n} to deliver")  # type: ignore[misc]

        assert await fleet.stop("old-publisher") == 0, fleet.err("old-publisher")
        published = fleet.out("old-publisher").split()
        assert len(published) >= 150
        await _wait_for(
            lambda: {r.headers["webhook-id"] for r in receiver.requests} >= set(published),
            "every published event to arrive",
        )
        for n in (1, 2):
            assert await fleet.stop(f"new-worker-{n}") == 0, fleet.err(f"new-worker-{n}")
    finally:
        await fleet.kill_all()

    arrivals = collections.Counter(r.headers["webhook-id"] for r in receiver.requests)
    assert set(arrivals) == set(published)
    doubled = {message: n for message, n in arrivals.items() if n > 1}
    assert not doubled, f"delivered more than once: {doubled}"
    engine = make_engine(empty_database_url)
    try:
        states = rows(engine, "SELECT state, count(*) AS n FROM deliveries GROUP BY state")
        assert [(s["state"], s["n"]) for s in states] == [("succeeded", len(published))]
        assert scalar(engine, "SELECT count(*) FROM delivery_attempts") == len(published)
    finally:
        engine.dispose()
    for name in ("old-publisher", "old-worker-1", "old-worker-2", "new-worker-1", "new-worker-2"):
        log = fleet.err(name)
        assert " ERROR " not in log and "Traceback" not in log, f"{name} logged:\n{log}"
