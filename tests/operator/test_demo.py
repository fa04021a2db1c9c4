"""`outbox demo`, the README's first command, really delivers, retries and signs; the
next steps it prints run as printed."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from delivery.operator import demo
from delivery.operator.cli import main
from outbox.crypto import generate_key

ROOT = Path(__file__).resolve().parents[2]
OUTBOX = [sys.executable, "-c", "from delivery.operator.cli import main; main()"]


@pytest.fixture(scope="module")
def tour() -> str:
    """The output of one `outbox demo` for the module: a tour starts its own embedded
    server (initdb and every migration), which its two tests can share."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(demo, "DEMO_SECONDS", 4.0)
        result = CliRunner().invoke(main, ["demo"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.slow  # its own embedded server
def test_demo_delivers_retries_and_verifies(tour: str) -> None:
    assert "the healthy partner received 4 requests" in tour
    assert "signature verifies with the endpoint secret: yes" in tour
    assert "retrying: HTTP 500" in tour
    assert "succeeded" in tour
    # Five 500s in a row open the failing partner's breaker within the tour.
    assert "circuit breaker open" in tour


def next_steps(output: str) -> list[list[str]]:
    """The commands under "Next steps", split as a shell would (comments dropped)."""
    section = output.split("\nNext steps", 1)[1].splitlines()[1:]
    return [shlex.split(line, comments=True) for line in section if line.startswith("  outbox ")]


@pytest.mark.slow  # a real `outbox run`, after the tour it shares with the test above
def test_the_demos_next_steps_run_as_printed(tour: str, database_url: str, tmp_path: Path) -> None:
    commands = next_steps(tour)
    assert len(commands) >= 6, tour
    assert any(words[1] == "replay" for words in commands), tour

    # The user's own database from here on.
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")},
        "OUTBOX_DATABASE_URL": database_url,
        "OUTBOX_SECRET_KEYS": generate_key("hints"),
    }
    for words in commands:
        assert words[0] == "outbox"
        if words[1] == "run":  # runs until Ctrl-C: start it, wait until it runs, Ctrl-C
            _run_until_running_then_interrupt(words[1:], env, tmp_path / "run.log")
            continue
        done = CliRunner().invoke(main, words[1:], env=env, catch_exceptions=False)
        assert done.exit_code == 0, f"{shlex.join(words)}:\n{done.output}"


def _run_until_running_then_interrupt(args: list[str], env: dict[str, str], log: Path) -> None:
    with log.open("wb") as out:
        process = subprocess.Popen([*OUTBOX, *args], env=env, stderr=out, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while "outbox running" not in log.read_text():
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0, log.read_text()
