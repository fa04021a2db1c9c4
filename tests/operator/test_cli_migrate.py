"""`outbox migrate` shows before it runs (--sql, --check), times each step, and says which
release needs which schema (`outbox --version`, /readyz)."""

from __future__ import annotations

import json
import tomllib
import uuid
from collections.abc import Iterator

import httpx
import pytest
from click.testing import CliRunner, Result
from sqlalchemy import Engine, make_url, text

from delivery.operator.api import create_app
from delivery.operator.app import open_database
from delivery.operator.cli import main
from outbox.crypto import SecretBox, generate_key
from outbox.db import make_async_engine, make_engine, sqlalchemy_url
from outbox.errors import ConfigurationError
from outbox.migrate import current_revision, head_revision, release_version, upgrade
from outbox.settings import load_settings
from tests.helpers import ROOT

VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


@pytest.fixture(scope="module")
def template_0019(server_url: str, admin_engine: Engine) -> Iterator[str]:
    """A database where the previous release (0.1.0) left it, migrated once per module."""
    name = f"outbox_at_0019_{uuid.uuid4().hex[:8]}"
    with admin_engine.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    engine = make_engine(_named(server_url, name))
    upgrade(engine, "0019")
    engine.dispose()  # a template may have no connections when it is copied
    yield name
    with admin_engine.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def database_0019_url(server_url: str, admin_engine: Engine, template_0019: str) -> Iterator[str]:
    """A copy of the 0019 template for one test (the migrations run once, not per test)."""
    name = f"outbox_0019_{uuid.uuid4().hex[:12]}"
    with admin_engine.connect() as conn:
        conn.execute(
            text(f'CREATE DATABASE "{name}" TEMPLATE "{template_0019}" STRATEGY FILE_COPY')
        )
    yield _named(server_url, name)
    with admin_engine.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def _named(server_url: str, database: str) -> str:
    return (
        make_url(sqlalchemy_url(server_url))
        .set(database=database)
        .render_as_string(hide_password=False)
    )


@pytest.fixture
def at_0019(database_0019_url: str) -> Iterator[Engine]:
    """The engine of this test's database at 0019 (the one `cli` runs on)."""
    engine = make_engine(database_0019_url)
    yield engine
    engine.dispose()


@pytest.fixture
def cli(database_0019_url: str, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_0019_url)
    monkeypatch.setenv("OUTBOX_SECRET_KEYS", generate_key("cli"))
    return CliRunner()


def invoke(cli: CliRunner, *args: str) -> Result:
    return cli.invoke(main, list(args), catch_exceptions=False)


def test_version_names_the_release_and_its_schema(cli: CliRunner) -> None:
    result = invoke(cli, "--version")
    assert result.exit_code == 0
    assert result.output == f"outbox {VERSION} (schema {head_revision()})\n"
    # One source: pyproject.toml's version, as installed (after a bump: pip install -e .).
    assert release_version() == VERSION


def test_check_fails_while_migrations_are_pending_and_changes_nothing(
    cli: CliRunner, at_0019: Engine
) -> None:
    checked = invoke(cli, "migrate", "--check")
    assert checked.exit_code == 1, checked.output
    assert "schema:  0019" in checked.output
    assert f"needs:   {head_revision()} (webhook-outbox {VERSION})" in checked.output
    assert "pending: 0020" in checked.output
    as_json = json.loads(invoke(cli, "migrate", "--check", "--json").output)
    assert as_json["schema"] == "0019" and as_json["needs"] == head_revision()
    assert as_json["state"] == "pending" and as_json["pending"][0] == "0020"
    assert current_revision(at_0019) == "0019"


def test_sql_prints_what_would_run_and_runs_nothing(cli: CliRunner, at_0019: Engine) -> None:
    printed = invoke(cli, "migrate", "--sql", "--lock-timeout", "3s")
    assert printed.exit_code == 0, printed.output
    assert printed.output.startswith("SET lock_timeout = 3000;")
    assert "Running upgrade 0019 -> 0020" in printed.output
    assert "Running upgrade 0018" not in printed.output  # only what is pending here
    assert "CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_deliveries_due_ranked" in printed.output
    assert "DROP INDEX CONCURRENTLY IF EXISTS ix_deliveries_due;" in printed.output
    assert current_revision(at_0019) == "0019"


def test_sql_from_base_needs_no_database(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "postgresql://nobody@127.0.0.1:1/none")
    printed = invoke(CliRunner(), "migrate", "--sql", "--from", "base")
    assert printed.exit_code == 0, printed.output
    assert "CREATE TABLE outbox_events" in printed.output
    assert "Running upgrade 0019 -> 0020" in printed.output


def test_migrate_prints_each_step_with_its_duration(cli: CliRunner, at_0019: Engine) -> None:
    migrated = invoke(cli, "migrate")
    assert migrated.exit_code == 0, migrated.output
    lines = migrated.output.splitlines()
    step = next(line for line in lines if line.startswith("0020 "))
    seconds = step.split()[1]
    assert seconds.endswith("s") and float(seconds[:-1]) >= 0
    assert "claim order" in step
    assert lines[-1] == f"schema is at revision {head_revision()}"
    again = invoke(cli, "migrate", "--check")
    assert again.exit_code == 0 and "up to date" in again.output
    assert "schema is at revision" in invoke(cli, "migrate").output  # nothing to run


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["--lock-timeout", "0"], "above 0"),
        (["--lock-timeout", "11m"], "at most 10m"),
        (["--lock-timeout", "soon"], "not a duration"),
        (["--lock-retries", "-1"], "-1"),
        (["--sql", "--check"], "pick one"),
        (["--from", "0018"], "only goes with --sql"),
    ],
)
def test_bad_options_are_one_clear_line(cli: CliRunner, args: list[str], complaint: str) -> None:
    result = cli.invoke(main, ["migrate", *args])
    assert result.exit_code == 2
    assert complaint in result.output


def test_sql_from_an_unknown_revision_is_refused(cli: CliRunner) -> None:
    result = cli.invoke(main, ["migrate", "--sql", "--from", "'; DROP TABLE x; --"])
    assert result.exit_code == 1
    assert "is not a revision of this release: give 'base' or one of 0001.." in result.output
    assert "Traceback" not in result.output and "SET lock_timeout" not in result.output


def _stamp(engine: Engine, revision: str) -> None:
    with engine.begin() as conn:
        conn.execute(text("UPDATE outbox_alembic_version SET version_num = :r"), {"r": revision})


def test_a_newer_schema_is_usable_and_a_pending_one_is_not(cli: CliRunner, at_0019: Engine) -> None:
    settings = load_settings()
    refused = pytest.raises(ConfigurationError, match=rf"at 0019, this version \({VERSION}\) needs")
    with refused, open_database(settings):
        pass
    upgrade(at_0019)
    _stamp(at_0019, "9999")  # what a later release's migration leaves
    with open_database(settings) as db:
        assert db.url
    checked = invoke(cli, "migrate", "--check")
    assert checked.exit_code == 0 and "newer than this release" in checked.output
    assert "nothing to do" in invoke(cli, "migrate").output


async def _readyz(url: str) -> httpx.Response:
    engine = make_async_engine(url)
    try:
        app = create_app(engine, SecretBox.from_setting(generate_key("r")))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get("/readyz")
    finally:
        await engine.dispose()


async def test_readyz_shows_the_release_and_the_schema_it_needs(
    at_0019: Engine, database_0019_url: str
) -> None:
    pending = await _readyz(database_0019_url)
    assert pending.status_code == 503
    assert pending.json() == {
        "status": "unavailable",
        "error": f"schema at 0019, needs {head_revision()}: run `outbox migrate`",
        "schema": "0019",
        "version": VERSION,
        "needs": head_revision(),
    }
    upgrade(at_0019)
    ready = await _readyz(database_0019_url)
    assert ready.status_code == 200
    assert ready.json() == {
        "status": "ready",
        "schema": head_revision(),
        "schema_state": "current",
        "version": VERSION,
        "needs": head_revision(),
    }
    _stamp(at_0019, "9999")
    newer = await _readyz(database_0019_url)
    assert newer.status_code == 200 and newer.json()["schema_state"] == "newer"


def test_to_rolls_back_to_the_previous_release_schema_and_forward_again(
    cli: CliRunner, at_0019: Engine
) -> None:
    """0.1.0 starts only on 0019: `--to 0019` puts its indexes back, online."""
    assert invoke(cli, "migrate").exit_code == 0
    back = invoke(cli, "migrate", "--to", "0019")
    assert back.exit_code == 0, back.output
    assert "undone" in back.output and back.output.splitlines()[-1] == (
        "schema is at revision 0019"
    )
    assert current_revision(at_0019) == "0019"
    with at_0019.connect() as conn:
        names = set(
            conn.execute(
                text("SELECT indexname FROM pg_indexes WHERE indexname LIKE 'ix_deliveries_due%'")
            ).scalars()
        )
    assert names == {"ix_deliveries_due", "ix_deliveries_due_per_endpoint"}
    assert invoke(cli, "migrate", "--check").exit_code == 1
    assert invoke(cli, "migrate").exit_code == 0
    assert current_revision(at_0019) == head_revision()
    refused = cli.invoke(main, ["migrate", "--to", "base"])
    assert refused.exit_code == 1 and "is not a revision of this release" in refused.output
