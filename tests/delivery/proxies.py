"""Real egress proxies for the delivery tests: Debian's tinyproxy on 127.0.0.1.

The `tinyproxy` fixture (registered in tests/delivery/conftest.py) starts tinyproxy
processes from a generated configuration on free loopback ports and stops them after
the test.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass
class Tinyproxy:
    port: int
    log: Path
    user: str | None = None
    password: str | None = None

    def url(self, *, password: str | None = None, anonymous: bool = False) -> str:
        """The proxy's URL with its credentials (another `password`), or none at all."""
        credentials = f"{self.user}:{password or self.password}@" if self.user else ""
        return f"http://{'' if anonymous else credentials}127.0.0.1:{self.port}"

    def requests(self) -> list[str]:
        """The request lines the proxy logged (CONNECT host:port, or an absolute URL)."""
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        return [line.split("): ", 1)[1] for line in lines if "Request (file descriptor" in line]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


StartProxy = Callable[..., Tinyproxy]


@pytest.fixture
def tinyproxy(tmp_path: Path) -> Iterator[StartProxy]:
    """Start tinyproxy processes: `start(connect_ports=[...], user=..., password=...)`.

    Missing under CI is a failure; elsewhere a skip that says how to install it (as for
    the browser tests' Chromium), so the README's test command passes on a fresh machine.
    """
    binary = shutil.which("tinyproxy") or "/usr/bin/tinyproxy"
    if not Path(binary).exists():
        message = "tinyproxy is missing: apt-get install -y tinyproxy (.ci/run does)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    started: list[subprocess.Popen[bytes]] = []

    def start(
        connect_ports: tuple[int, ...] = (), user: str | None = None, password: str | None = None
    ) -> Tinyproxy:
        port = free_port()
        directory = tmp_path / f"tinyproxy-{port}"
        directory.mkdir()
        proxy = Tinyproxy(port, directory / "tinyproxy.log", user, password)
        lines = [
            f"Port {port}",
            "Listen 127.0.0.1",
            "Timeout 10",
            "Allow 127.0.0.1",
            "MaxClients 20",
            "LogLevel Connect",
            f'LogFile "{proxy.log}"',
            "DisableViaHeader Yes",
            # Only the listed ports may be tunnelled to (with none listed, tinyproxy allows all).
            *[f"ConnectPort {p}" for p in connect_ports or (9,)],
        ]
        if user:
            lines.append(f"BasicAuth {user} {password}")
        config = directory / "tinyproxy.conf"
        config.write_text("\n".join(lines) + "\n")
        errors = directory / "stderr"
        with errors.open("wb") as stderr:
            process = subprocess.Popen(
                [binary, "-d", "-c", str(config)], stdout=subprocess.DEVNULL, stderr=stderr
            )
        started.append(process)
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                return proxy
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"tinyproxy did not start: {errors.read_text()}")
            time.sleep(0.02)

    yield start
    for process in started:
        process.terminate()
        process.wait(10)
