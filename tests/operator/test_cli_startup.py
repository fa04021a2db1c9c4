"""The `outbox` command starts light: `--help` imports no command module, and commands
that serve no pages never import the web stack or the console. Checked on the modules a
fresh interpreter has loaded, never on the clock.

Also: the command list in `outbox --help` (kept in `COMMANDS` so that help imports
nothing) says what each command says of itself, and the admin API serves without the
'console' extra.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
from sqlalchemy.ext.asyncio import create_async_engine

import delivery.operator.cli as cli_package
from delivery.operator.cli import COMMANDS, main
from outbox.crypto import SecretBox, generate_key

ROOT = Path(__file__).resolve().parents[2]

# Runs the CLI in-process in a fresh interpreter, then reports on stderr's last line
# which modules it loaded.
_PROBE = """
import json, sys
from delivery.operator.cli import main
try:
    main(sys.argv[1:], prog_name="outbox")
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "modules": sorted(sys.modules)}), file=sys.stderr)
"""

WEB_STACK = ("starlette", "uvicorn", "jinja2", "delivery.operator.console", "delivery.operator.api")


def _loaded(*args: str, **env: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, *args],
        env={**{k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}, **env},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    report = json.loads(result.stderr.strip().splitlines()[-1])
    assert report["code"] in (0, None), result.stdout + result.stderr
    return result, set(report["modules"])


def _under(modules: set[str], packages: tuple[str, ...]) -> list[str]:
    return sorted(
        name for name in modules if any(name == p or name.startswith(p + ".") for p in packages)
    )


def test_help_imports_no_command_module_nor_what_they_need() -> None:
    result, modules = _loaded("--help")
    assert "Commands:" in result.stdout and "endpoints" in result.stdout
    heavy = (*WEB_STACK, "httpx", "sqlalchemy", "alembic", "psycopg", "pydantic")
    assert _under(modules, heavy) == []
    command_modules = {f"delivery.operator.cli.{entry.module}" for entry in COMMANDS.values()}
    assert sorted(command_modules & modules) == []


def test_a_command_without_a_database_imports_no_web_stack() -> None:
    result, modules = _loaded("keys", "generate")
    assert result.stdout.strip()
    assert "delivery.operator.cli.keys" in modules
    assert _under(modules, (*WEB_STACK, "httpx", "sqlalchemy", "alembic", "pydantic")) == []


def test_a_database_command_imports_no_web_stack(database_url: str) -> None:
    result, modules = _loaded("endpoints", "list", "--json", OUTBOX_DATABASE_URL=database_url)
    assert json.loads(result.stdout) == []
    assert "sqlalchemy" in modules
    assert _under(modules, WEB_STACK) == []


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_the_help_list_says_what_each_command_says_of_itself(name: str) -> None:
    command = main.get_command(click.Context(main), name)
    assert command is not None
    assert command.get_short_help_str(limit=10_000) == COMMANDS[name].summary


def test_every_command_module_is_reachable() -> None:
    """A command defined in a module but missing from COMMANDS could never run."""
    ctx = click.Context(main)
    listed = {id(main.get_command(ctx, name)) for name in COMMANDS}
    defined: list[click.Command] = []
    for info in pkgutil.iter_modules(cli_package.__path__):
        module = importlib.import_module(f"{cli_package.__name__}.{info.name}")
        defined += [value for value in vars(module).values() if isinstance(value, click.Command)]
    nested = {
        id(sub)
        for group in defined
        if isinstance(group, click.Group)
        for sub in group.commands.values()
    }
    assert sorted(c.name or "" for c in defined if id(c) not in nested | listed) == []


def test_endpoints_keeps_its_test_subcommand() -> None:
    group = main.get_command(click.Context(main), "endpoints")
    assert isinstance(group, click.Group)
    assert "test" in group.list_commands(click.Context(group))


def test_a_command_whose_extra_is_missing_names_it(tmp_path: Path) -> None:
    """A missing module of an extra, as an install without that extra would have it."""
    shadow = tmp_path / "shadow" / "httpx"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'httpx'\", name='httpx')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", "from delivery.operator.cli import main; main()", "stats"],
        env={**os.environ, "PYTHONPATH": str(tmp_path / "shadow")},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        "Error: outbox stats needs the 'service' extra: pip install 'webhook-outbox[service]'"
    )


def test_a_missing_module_of_no_extra_keeps_its_traceback(tmp_path: Path) -> None:
    """Only an extra's modules are explained away; anything else is a bug to see."""
    shadow = tmp_path / "shadow" / "pydantic"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'pydantic'\", name='pydantic')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", "from delivery.operator.cli import main; main()", "stats"],
        env={**os.environ, "PYTHONPATH": str(tmp_path / "shadow")},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 1
    assert "Traceback" in result.stderr
    assert "No module named 'pydantic'" in result.stderr


_ROUTES = """
import json
from sqlalchemy.ext.asyncio import create_async_engine
from delivery.operator.api import create_app
from outbox.crypto import SecretBox, generate_key

engine = create_async_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")
app = create_app(engine, SecretBox.from_setting(generate_key("test")))
print(json.dumps(sorted(getattr(route, "path", "") for route in app.routes)))
"""


def _served_paths(pythonpath: str) -> tuple[list[str], str]:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    result = subprocess.run(
        [sys.executable, "-c", _ROUTES],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout), result.stderr


def _served_paths_here() -> list[str]:
    """The same list from this interpreter, which has the console extra installed: what a
    fresh one with the extra would print, without the cost of starting one."""
    from delivery.operator.api import create_app

    app = create_app(
        create_async_engine("postgresql+psycopg://nobody@127.0.0.1:1/none"),
        SecretBox.from_setting(generate_key("test")),
    )
    return sorted(getattr(route, "path", "") for route in app.routes)


def test_the_admin_api_serves_without_the_console_extra(tmp_path: Path) -> None:
    shadow = tmp_path / "shadow" / "jinja2"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'jinja2'\", name='jinja2')\n"
    )
    with_console = _served_paths_here()
    without, stderr = _served_paths(str(tmp_path / "shadow"))
    assert any(path.startswith("/console") for path in with_console)
    assert "/openapi.json" in without
    assert [p for p in without if p.startswith(("/console", "/portal"))] == []
    assert set(without) < set(with_console)
    assert "the console and portal are off: they need the 'console' extra" in stderr
