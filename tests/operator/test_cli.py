"""The `outbox` command against a real database: JSON output, clear errors, nothing half-written."""

from __future__ import annotations

import json
import shlex

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import Engine

from delivery.operator.cli import main
from outbox.crypto import generate_key
from tests.helpers import rows, scalar


@pytest.fixture
def cli(database_url: str, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    monkeypatch.setenv("OUTBOX_SECRET_KEYS", generate_key("cli"))
    return CliRunner()


def invoke(cli: CliRunner, *args: str) -> Result:
    return cli.invoke(main, list(args), catch_exceptions=False)


def test_endpoint_lifecycle_with_json(cli: CliRunner, engine: Engine) -> None:
    added = invoke(
        cli,
        "endpoints",
        "add",
        "https://example.com/hook",
        "--events",
        "order.*, invoice.paid",
        "--json",
    )
    assert added.exit_code == 0, added.output
    created = json.loads(added.output)
    assert created["id"].startswith("ep_")
    assert created["secret"].startswith("whsec_")
    assert created["event_types"] == ["order.*", "invoice.paid"]
    # The secret is stored encrypted, never as plaintext.
    stored = scalar(engine, "SELECT signing_secret FROM endpoints")
    assert created["secret"] not in stored and stored.startswith("v1:cli:")

    listed = json.loads(invoke(cli, "endpoints", "list", "--json").output)
    assert [item["id"] for item in listed] == [created["id"]]
    assert "secret" not in listed[0]

    disabled = invoke(
        cli, "endpoints", "disable", created["id"], "--reason", "partner asked", "--json"
    )
    assert json.loads(disabled.output)["enabled"] is False
    enabled = invoke(cli, "endpoints", "enable", created["id"], "--json")
    assert json.loads(enabled.output)["enabled"] is True
    audit = rows(engine, "SELECT action, target_id, reason FROM audit_log ORDER BY id")
    assert [(a["action"], a["reason"]) for a in audit] == [
        ("endpoint.create", None),
        ("endpoint.disable", "partner asked"),
        ("endpoint.enable", None),
    ]
    text_listing = invoke(cli, "endpoints", "list").output
    assert created["id"] in text_listing and "https://example.com/hook" in text_listing


def test_given_secret_is_used(cli: CliRunner) -> None:
    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    result = invoke(
        cli,
        "endpoints",
        "add",
        "https://example.com/h",
        "--events",
        "*",
        "--secret",
        secret,
        "--json",
    )
    assert json.loads(result.output)["secret"] == secret


def test_publish_from_the_shell(cli: CliRunner, engine: Engine) -> None:
    result = invoke(
        cli, "publish", "order.created", '{"id": 1}', "--idempotency-key", "k1", "--json"
    )
    assert result.exit_code == 0, result.output
    first = json.loads(result.output)["message_id"]
    again = invoke(cli, "publish", "order.created", '{"id": 1}', "--idempotency-key", "k1")
    assert again.output.strip() == first
    assert scalar(engine, "SELECT count(*) FROM outbox_events") == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("publish", "order created", "{}"), "event type"),
        (("publish", "order.created", "{not json"), "not valid JSON"),
        (("publish", "order.created", "[1, 2]"), "JSON object"),
        (("endpoints", "add", "https://example.com/h", "--events", "order..x"), "pattern"),
        (("endpoints", "add", "https://example.com/h", "--events", " , "), "at least one"),
        (
            ("endpoints", "add", "https://example.com/h", "--events", "*", "--secret", "nope"),
            "whsec_",
        ),
        (("endpoints", "add", "ftp://example.com/h", "--events", "*"), "http:// or https://"),
        (("endpoints", "add", "https://user:pw@example.com/h", "--events", "*"), "credentials"),
        (("endpoints", "add", "not a url", "--events", "*"), "whitespace"),
        (("endpoints", "disable", "ep_missing", "--reason", "x"), "no endpoint"),
        (("endpoints", "enable", "ep_missing"), "no endpoint"),
    ],
)
def test_bad_input_gets_a_clear_error_and_writes_nothing(
    cli: CliRunner, engine: Engine, args: tuple[str, ...], message: str
) -> None:
    result = cli.invoke(main, list(args))
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output
    assert scalar(engine, "SELECT count(*) FROM outbox_events") == 0
    assert scalar(engine, "SELECT count(*) FROM endpoints") == 0
    assert scalar(engine, "SELECT count(*) FROM audit_log") == 0


def test_unreachable_database_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "postgresql://nobody:secret@127.0.0.1:1/none")
    result = CliRunner().invoke(main, ["endpoints", "list"])
    assert result.exit_code == 1
    assert "cannot reach PostgreSQL" in result.output
    assert "secret" not in result.output  # the password is masked


def test_bad_setting_is_explained(cli: CliRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_RETRY_SCHEDULE", "5,-1")
    result = cli.invoke(main, ["endpoints", "list"])
    assert result.exit_code == 1
    assert "OUTBOX_RETRY_SCHEDULE" in result.output


def test_missing_encryption_key_is_explained(
    cli: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OUTBOX_SECRET_KEYS")
    result = cli.invoke(main, ["endpoints", "add", "https://example.com/h", "--events", "*"])
    assert result.exit_code == 1
    assert "OUTBOX_SECRET_KEYS" in result.output


def test_unmigrated_database_is_explained(
    cli: CliRunner, monkeypatch: pytest.MonkeyPatch, empty_database_url: str
) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", empty_database_url)
    result = cli.invoke(main, ["endpoints", "list"])
    assert result.exit_code == 1
    assert "outbox migrate" in result.output
    assert invoke(cli, "migrate").exit_code == 0
    assert invoke(cli, "migrate").exit_code == 0
    assert invoke(cli, "endpoints", "list", "--json").output.strip() == "[]"


def test_endpoints_add_says_how_to_reveal_the_secret_and_the_printed_command_works(
    cli: CliRunner, engine: Engine
) -> None:
    """The secret can be revealed later (audited), so `add` says how instead of "not shown
    again"; the command it prints runs as printed, with a reason filled in."""
    added = invoke(cli, "endpoints", "add", "https://example.com/hook", "--events", "*")
    assert added.exit_code == 0, added.output
    assert "not shown again" not in added.output
    secret = next(
        line.split()[1] for line in added.output.splitlines() if line.startswith("secret:")
    )
    hint = next(line for line in added.output.splitlines() if "reveal-secret" in line)
    assert "audit log" in added.output
    words = shlex.split(hint)
    assert words[:3] == ["outbox", "endpoints", "reveal-secret"]
    words[words.index("--reason") + 1] = "the receiver lost it"
    revealed = invoke(cli, *words[1:])
    assert revealed.exit_code == 0, revealed.output
    assert revealed.output.strip() == secret
    audit = rows(engine, "SELECT action, reason FROM audit_log ORDER BY id")
    assert (audit[-1]["action"], audit[-1]["reason"]) == (
        "endpoint.reveal_secret",
        "the receiver lost it",
    )
