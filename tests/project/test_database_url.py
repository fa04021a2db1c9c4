"""The README's publish example (also the first example of docs/publishing.md) runs as
written on a fresh machine (no OUTBOX_DATABASE_URL): `outbox.database_url()` starts and
migrates the same embedded server the CLI uses."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

import outbox
from outbox.embedded import EmbeddedPostgres
from tests.helpers import ROOT

OUTBOX = [sys.executable, "-c", "from delivery.operator.cli import main; main()"]


def publish_example(page: Path) -> str:
    section = page.read_text().split("## Publishing from application code", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match, f"the publishing section of {page.name} has no python example"
    return match.group(1)


def readme_publish_example() -> str:
    return publish_example(ROOT / "README.md")


def test_the_docs_site_opens_with_the_same_publish_example() -> None:
    """The one run below covers both places: the docs page's example is the README's."""
    assert publish_example(ROOT / "docs" / "publishing.md") == readme_publish_example()


def _env(data_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["OUTBOX_DATA_DIR"] = str(data_dir)
    return env


def _run(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(args), env=_env(data_dir), capture_output=True, text=True, timeout=120, cwd=ROOT
    )


@contextlib.contextmanager
def private_data_dir() -> Iterator[Path]:
    """A data directory whose embedded server is stopped, and which is removed, at the end.

    Not under tmp_path: see tests/operator/test_lifecycle.py's data_dir.
    """
    path = Path(tempfile.mkdtemp(prefix="outbox-readme-"))
    try:
        yield path
    finally:
        server = EmbeddedPostgres(path)
        if server.running():
            os.kill(int((server.pgdata / "postmaster.pid").read_text().split()[0]), signal.SIGINT)
            deadline = time.monotonic() + 30
            while server.running() and time.monotonic() < deadline:
                time.sleep(0.1)
        shutil.rmtree(path, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class FreshMachine:
    """The README example, run once on a machine with no data directory yet."""

    data_dir: Path
    example: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def fresh_machine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FreshMachine]:
    """Run once per module: the first test checks it, the second starts from a copy of
    the data directory it leaves (initialised, migrated, its server stopped), so the
    module pays for one initdb and one migration from scratch, not two."""
    example = tmp_path_factory.mktemp("readme") / "example.py"
    example.write_text(readme_publish_example())
    with private_data_dir() as data_dir:
        yield FreshMachine(data_dir, _run(data_dir, sys.executable, str(example)))


@pytest.fixture
def data_dir() -> Iterator[Path]:
    with private_data_dir() as path:
        yield path


@pytest.mark.slow  # a fresh embedded server
def test_the_readme_publish_example_works_as_written_on_a_fresh_machine(
    fresh_machine: FreshMachine,
) -> None:
    data_dir, first = fresh_machine.data_dir, fresh_machine.example
    assert first.returncode == 0, first.stderr
    published = re.fullmatch(r"published (msg_\S+)\n", first.stdout)
    assert published, first.stdout + first.stderr
    server = EmbeddedPostgres(data_dir)
    assert not server.running()  # the example was its only user: stopped at its exit

    # The shell finds the same server (started again, migrated, left running).
    url = _run(data_dir, *OUTBOX, "db", "url")
    assert url.returncode == 0, url.stderr
    assert url.stdout.startswith("postgresql+psycopg://")
    assert server.running()  # `db url` leaves it running for the shell's next command
    stop = _run(data_dir, *OUTBOX, "db", "stop")
    assert stop.returncode == 0, stop.stderr
    assert not server.running()


@pytest.mark.slow  # an embedded server started and stopped by real commands
def test_db_url_keeps_the_server_up_for_the_connections_of_the_code_it_was_printed_for(
    fresh_machine: FreshMachine, data_dir: Path
) -> None:
    """An application connects with the URL `outbox db url` printed; the next `outbox`
    command comes and goes without stopping the server under it (it used to, and the
    application's connections got AdminShutdown); `outbox db stop` stops it.

    On a machine where the README example ran before (a copy of its data directory, the
    server stopped): the fresh-machine start is the test above."""
    assert fresh_machine.example.returncode == 0, fresh_machine.example.stderr
    assert not EmbeddedPostgres(fresh_machine.data_dir).running()
    # cp -a: the files keep their owner (the `embedded_postgres` user when run as root).
    subprocess.run(["cp", "-a", str(fresh_machine.data_dir / "pgdata"), str(data_dir)], check=True)
    printed = _run(data_dir, *OUTBOX, "db", "url", "--libpq")
    assert printed.returncode == 0, printed.stderr
    assert "until `outbox db stop`" in printed.stderr
    server = EmbeddedPostgres(data_dir)
    with psycopg.connect(printed.stdout.strip(), autocommit=True) as app:
        assert app.execute("SELECT 1").fetchone() == (1,)
        for command in (["endpoints", "list"], ["stats"]):
            done = _run(data_dir, *OUTBOX, *command)
            assert done.returncode == 0, done.stderr
            assert app.execute("SELECT 1").fetchone() == (1,), command
        assert server.running()
        # `db stop` does not pull it from under an open connection either, unless forced.
        refused = _run(data_dir, *OUTBOX, "db", "stop")
        assert refused.returncode == 1, refused.stderr
        assert refused.stderr.count("\n") == 1, refused.stderr
        assert "has 1 open connection (server process " in refused.stderr, refused.stderr
        assert "--force" in refused.stderr
        assert app.execute("SELECT 1").fetchone() == (1,)
        assert server.running()
        forced = _run(data_dir, *OUTBOX, "db", "stop", "--force")
        assert forced.returncode == 0, forced.stderr
        assert not server.running()
        with pytest.raises(psycopg.OperationalError):
            app.execute("SELECT 1")
    # Stopped for good: the next command's server stops with it again.
    again = _run(data_dir, *OUTBOX, "endpoints", "list")
    assert again.returncode == 0, again.stderr
    assert not server.running()


def test_database_url_is_the_configured_one_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "postgresql://app:pw@db.internal:5432/shop")
    assert outbox.database_url() == "postgresql+psycopg://app:pw@db.internal:5432/shop"


def test_database_url_refuses_bad_settings_with_one_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "mysql://app@db/shop")
    with pytest.raises(outbox.ConfigurationError, match="must point at PostgreSQL"):
        outbox.database_url()
