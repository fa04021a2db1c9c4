"""The operator commands for limits, breaker state and priorities, against a real database."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from sqlalchemy import Engine

from delivery.operator.cli import main
from outbox.crypto import SecretBox
from tests.helpers import add_endpoint, rows, scalar


@pytest.fixture
def cli(database_url: str, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    monkeypatch.delenv("OUTBOX_ENV_FILE", raising=False)
    return CliRunner()


def run_json(cli: CliRunner, *args: str) -> object:
    result = cli.invoke(main, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_limits_change_only_what_is_given_and_are_audited(
    cli: CliRunner, engine: Engine, box: SecretBox
) -> None:
    uid = add_endpoint(engine, box, "http://127.0.0.1:9/hook").endpoint.uid
    assert run_json(cli, "endpoints", "limits", uid, "--max-in-flight", "3", "--ordered") == {
        "id": uid,
        "max_in_flight": 3,
        "max_per_second": None,
        "ordered": True,
        "dead_head": "block",
        "adaptive": False,
    }
    changed = run_json(cli, "endpoints", "limits", uid, "--max-per-second", "2.5")
    assert changed == {**changed, "max_in_flight": 3, "max_per_second": 2.5, "ordered": True}
    cleared = run_json(cli, "endpoints", "limits", uid, "--max-in-flight", "0")
    assert cleared == {**cleared, "max_in_flight": None, "max_per_second": 2.5}
    assert run_json(cli, "endpoints", "limits", uid) == cleared  # no option: just show

    bad = cli.invoke(main, ["endpoints", "limits", uid, "--max-per-second", "-1"])
    assert bad.exit_code == 1 and "positive" in bad.output
    missing = cli.invoke(main, ["endpoints", "limits", "ep_nope", "--ordered"])
    assert missing.exit_code == 1 and "outbox endpoints list" in missing.output
    audit = rows(engine, "SELECT action, target_id FROM audit_log ORDER BY id")
    assert audit == [{"action": "endpoint.limits", "target_id": uid}] * 3


def test_health_report_shows_breaker_and_backlog(
    cli: CliRunner, engine: Engine, box: SecretBox
) -> None:
    uid = add_endpoint(engine, box, "http://127.0.0.1:9/hook").endpoint.uid
    report = run_json(cli, "endpoints", "health")
    assert isinstance(report, list) and len(report) == 1
    assert report[0]["endpoint"] == uid
    assert (report[0]["breaker_state"], report[0]["in_flight"], report[0]["scheduled"]) == (
        "closed",
        0,
        0,
    )
    text = cli.invoke(main, ["endpoints", "health"])
    assert text.exit_code == 0 and uid in text.output and "closed" in text.output


def test_event_type_priority_is_the_default_for_publish(cli: CliRunner, engine: Engine) -> None:
    assert cli.invoke(main, ["priorities", "set", "password.reset", "50"]).exit_code == 0
    assert run_json(cli, "priorities", "list") == {"password.reset": 50}
    run_json(cli, "publish", "password.reset", '{"user": 1}')
    run_json(cli, "publish", "password.reset", '{"user": 2}', "--priority", "-5")
    run_json(cli, "publish", "export.row", '{"row": 1}')
    assert [
        r["priority"] for r in rows(engine, "SELECT priority FROM outbox_events ORDER BY id")
    ] == [
        50,
        -5,
        0,
    ]
    assert cli.invoke(main, ["priorities", "set", "x", "500"]).exit_code == 2
    assert cli.invoke(main, ["priorities", "clear", "password.reset"]).exit_code == 0
    assert scalar(engine, "SELECT count(*) FROM event_type_priorities") == 0
