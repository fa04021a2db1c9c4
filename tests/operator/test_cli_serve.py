"""`outbox serve` as a real process: its help and start-up line name the console and the
portal, and the link `outbox portal link` prints opens the portal on that server."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from click.testing import CliRunner

from delivery.operator.cli import main
from outbox.crypto import generate_key

ROOT = Path(__file__).resolve().parents[2]
OUTBOX = [sys.executable, "-c", "from delivery.operator.cli import main; main()"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_serve_help_names_the_console_and_the_portal() -> None:
    shown = CliRunner().invoke(main, ["serve", "--help"])
    assert shown.exit_code == 0
    words = " ".join(shown.output.split())
    assert "console (/console)" in words and "portal (/portal)" in words, words
    assert "only the admin" not in words
    top = CliRunner().invoke(main, ["--help"]).output
    assert re.search(r"serve\s+Serve the admin HTTP API, the web console", top), top


def test_serve_start_up_line_and_portal_link_lead_to_the_portal(
    database_url: str, tmp_path: Path
) -> None:
    port = _free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")},
        "OUTBOX_DATABASE_URL": database_url,
        "OUTBOX_SECRET_KEYS": generate_key("serve"),
        "OUTBOX_ADMIN_HOST": "127.0.0.1",
        "OUTBOX_ADMIN_PORT": str(port),
    }
    runner = CliRunner()
    assert runner.invoke(main, ["tenants", "add", "acme"], env=env).exit_code == 0
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        server = subprocess.Popen([*OUTBOX, "serve"], env=env, stderr=out, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while "admin API on" not in log.read_text():
            assert server.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        started = log.read_text()
        base = f"http://127.0.0.1:{port}"
        assert f"console at {base}/console" in started, started
        assert f"tenant portal at {base}/portal" in started, started

        made = runner.invoke(main, ["portal", "link", "acme"], env=env)
        assert made.exit_code == 0, made.output
        link = made.stdout.strip()
        assert link.startswith(f"{base}/portal/enter?link=obxl_"), made.output
        assert "OUTBOX_PUBLIC_URL is unset" in made.stderr
        opened = httpx.get(link, follow_redirects=False)
        assert opened.status_code == 303, opened.text
        assert opened.headers["location"].startswith("/portal")
        assert "set-cookie" in opened.headers
    finally:
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=30) == 0, log.read_text()
