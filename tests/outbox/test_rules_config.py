"""Configuring the delivery rules: settings validated at start-up, endpoint rules, the CLI."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import Engine

from delivery.operator import app
from delivery.operator.cli import main
from outbox.crypto import SecretBox, generate_key
from outbox.endpoint_rules import (
    DeliveryRules,
    get_delivery_rules,
    parse_status_override,
    set_delivery_rules,
    validate_delivery_rules,
)
from outbox.errors import ConfigurationError, EndpointError
from outbox.settings import EventTypeRetry, load_settings
from tests.helpers import add_endpoint, rows, scalar


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "OUTBOX_RETRY_SCHEDULE",
        "OUTBOX_MAX_ATTEMPTS",
        "OUTBOX_REQUEST_TIMEOUT",
        "OUTBOX_LEASE_SECONDS",
        "OUTBOX_EVENT_TYPE_RETRY",
        "OUTBOX_RETRY_JITTER",
        "OUTBOX_RETRY_AFTER_MAX",
        "OUTBOX_MAX_RESCUES",
        "OUTBOX_ENV_FILE",
    ):
        monkeypatch.delenv(name, raising=False)


def settings_error(monkeypatch: pytest.MonkeyPatch, **env: str) -> str:
    for name, value in env.items():
        monkeypatch.setenv(f"OUTBOX_{name.upper()}", value)
    with pytest.raises(ConfigurationError) as raised:
        load_settings()
    return str(raised.value)


def test_defaults_are_the_documented_ones() -> None:
    settings = load_settings()
    assert settings.retry_schedule == [5, 60, 300, 1800, 7200, 18000, 36000]
    assert settings.max_attempts == 8
    assert settings.request_timeout == 10
    assert settings.lease_seconds == 60
    assert (settings.retry_jitter, settings.retry_after_max, settings.max_rescues) == (
        0.2,
        3600,
        3,
    )
    assert settings.event_type_retry == {}


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"retry_schedule": ""}, "OUTBOX_RETRY_SCHEDULE: Value error, must list at least one"),
        ({"retry_schedule": " , "}, "OUTBOX_RETRY_SCHEDULE: Value error, must list at least one"),
        ({"retry_schedule": "5,-1"}, "delays must be zero or positive seconds"),
        ({"retry_schedule": "5,inf"}, "delays must be finite numbers of seconds"),
        ({"retry_schedule": "5,nan"}, "delays must be finite numbers of seconds"),
        ({"retry_schedule": "5,36000000"}, "almost certainly a typo"),
        ({"retry_schedule": "5,soon"}, "OUTBOX_RETRY_SCHEDULE.1"),
        ({"max_attempts": "0"}, "OUTBOX_MAX_ATTEMPTS"),
        ({"retry_jitter": "1.5"}, "OUTBOX_RETRY_JITTER"),
        ({"retry_after_max": "0"}, "OUTBOX_RETRY_AFTER_MAX"),
        ({"max_rescues": "0"}, "OUTBOX_MAX_RESCUES"),
        (
            {"request_timeout": "60", "lease_seconds": "30"},
            "OUTBOX_LEASE_SECONDS (30) must exceed OUTBOX_REQUEST_TIMEOUT (60) by at least 5s",
        ),
        ({"request_timeout": "58", "lease_seconds": "60"}, "raise the lease or lower the timeout"),
        ({"event_type_retry": "not json"}, "OUTBOX_EVENT_TYPE_RETRY"),
        ({"event_type_retry": '{"order.*": {}}'}, "give 'schedule', 'max_attempts' or both"),
        ({"event_type_retry": '{"order.*": {"tries": 3}}'}, "tries"),
        ({"event_type_retry": '{"order.*": {"schedule": []}}'}, "must list at least one"),
        ({"event_type_retry": '{"order.*": {"max_attempts": 0}}'}, "greater than 0"),
        ({"event_type_retry": '{"ord er": {"max_attempts": 2}}'}, "event pattern 'ord er'"),
    ],
)
def test_bad_settings_fail_at_start_up_with_a_clear_message(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str
) -> None:
    assert message in settings_error(monkeypatch, **env)


def test_event_type_rules_reach_the_relay_and_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "OUTBOX_EVENT_TYPE_RETRY",
        '{"invoice.*": {"schedule": "60,600", "max_attempts": 4},'
        ' "order.paid": {"max_attempts": 20}, "*": {"schedule": [1]}}',
    )
    monkeypatch.setenv("OUTBOX_RETRY_JITTER", "0.1")
    settings = load_settings()
    assert settings.event_type_retry["invoice.*"] == EventTypeRetry(
        schedule=[60, 600], max_attempts=4
    )
    relay = app.relay_config(settings)
    assert dict(relay.max_attempts_by_event_type) == {"invoice.*": 4, "order.paid": 20}
    worker = app.worker_config(settings)
    assert dict(worker.retry_schedule_by_event_type) == {"invoice.*": (60, 600), "*": (1,)}
    assert worker.retry_jitter == 0.1
    assert app.reaper_config(settings).max_rescues == 3


def test_endpoint_rules_round_trip_with_an_audit_entry(engine: Engine, box: SecretBox) -> None:
    uid = add_endpoint(engine, box, "https://example.com/hook").endpoint.uid
    with engine.begin() as conn:
        assert get_delivery_rules(conn, uid) == DeliveryRules()
        saved = set_delivery_rules(
            conn,
            uid,
            DeliveryRules(
                timeout_seconds=2.5,
                max_attempts=4,
                retry_schedule=(1.0, 30.0),
                status_overrides={404: "retryable", 409: "succeeded"},
            ),
            actor="ops",
            reason="partner deploys take a minute",
        )
    assert saved == DeliveryRules(
        timeout_seconds=2.5,
        max_attempts=4,
        retry_schedule=(1.0, 30.0),
        status_overrides={404: "retryable", 409: "succeeded"},
    )
    audit = rows(engine, "SELECT * FROM audit_log WHERE action = 'endpoint.rules'")[0]
    assert (audit["actor"], audit["reason"]) == ("ops", "partner deploys take a minute")
    assert (audit["target_type"], audit["target_id"]) == ("endpoint", uid)
    assert audit["details"]["status_overrides"] == {"404": "retryable", "409": "succeeded"}


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        (DeliveryRules(timeout_seconds=0), "timeout must be more than 0"),
        (DeliveryRules(timeout_seconds=301), "at most 300 seconds"),
        (DeliveryRules(max_attempts=0), "max attempts must be between 1 and 100"),
        (DeliveryRules(retry_schedule=()), "retry schedule: must list at least one"),
        (DeliveryRules(retry_schedule=(5, -1)), "retry schedule: delays must be zero or positive"),
        (DeliveryRules(status_overrides={404: "ambiguous"}), "status override 404=ambiguous"),
        (DeliveryRules(status_overrides={700: "retryable"}), "the status must be 100-599"),
    ],
)
def test_invalid_endpoint_rules_are_refused(
    engine: Engine, box: SecretBox, rules: DeliveryRules, message: str
) -> None:
    uid = add_endpoint(engine, box, "https://example.com/hook").endpoint.uid
    with engine.begin() as conn, pytest.raises(EndpointError, match=message):
        set_delivery_rules(conn, uid, rules, actor="ops")


def test_endpoint_rule_limits_are_inclusive() -> None:
    for rules in (
        DeliveryRules(timeout_seconds=0.5),
        DeliveryRules(timeout_seconds=300),
        DeliveryRules(max_attempts=1),
        DeliveryRules(max_attempts=100),
        DeliveryRules(status_overrides={100: "retryable", 599: "permanent"}),
    ):
        assert validate_delivery_rules(rules) is rules
    with pytest.raises(EndpointError) as caught:
        validate_delivery_rules(DeliveryRules(max_attempts=101))
    assert str(caught.value) == "max attempts must be between 1 and 100"
    for status in (99, 600):
        with pytest.raises(EndpointError) as caught:
            validate_delivery_rules(DeliveryRules(status_overrides={status: "retryable"}))
        assert str(caught.value) == (
            f"status override {status}=retryable is invalid: the status must be 100-599 "
            "and the outcome one of succeeded, retryable, permanent"
        )


@pytest.mark.parametrize("text", ["404=maybe", "abc=retryable", "=retryable", "404"])
def test_a_status_override_needs_a_number_and_a_known_outcome(text: str) -> None:
    with pytest.raises(EndpointError) as caught:
        parse_status_override(text)
    assert str(caught.value) == (
        f"status override {text!r} is invalid: write STATUS=OUTCOME, e.g. 404=retryable, "
        "with OUTCOME one of succeeded, retryable, permanent"
    )
    assert parse_status_override(" 404 = Retryable ") == (404, "retryable")


def test_rules_of_an_unknown_endpoint_say_where_to_find_the_ids(engine: Engine) -> None:
    message = "no endpoint 'ep_nope'; `outbox endpoints list` shows the ids"
    with engine.begin() as conn:
        with pytest.raises(EndpointError) as caught:
            get_delivery_rules(conn, "ep_nope")
        assert str(caught.value) == message
        with pytest.raises(EndpointError) as caught:
            set_delivery_rules(conn, "ep_nope", DeliveryRules(max_attempts=2), actor="ops")
        assert str(caught.value) == message


def test_no_status_overrides_are_stored_as_null(engine: Engine, box: SecretBox) -> None:
    """NULL is "the default status table applies" (the module's convention)."""
    uid = add_endpoint(engine, box, "https://example.com/hook").endpoint.uid
    with engine.begin() as conn:
        set_delivery_rules(conn, uid, DeliveryRules(max_attempts=3), actor="ops")
    assert scalar(engine, "SELECT status_overrides IS NULL FROM endpoints WHERE uid = :u", u=uid)


@pytest.fixture
def cli(database_url: str, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    monkeypatch.setenv("OUTBOX_SECRET_KEYS", generate_key("cli"))
    return CliRunner()


def invoke(cli: CliRunner, *args: str) -> Result:
    return cli.invoke(main, list(args), catch_exceptions=False)


def test_cli_shows_and_changes_endpoint_rules(cli: CliRunner, engine: Engine) -> None:
    added = json.loads(
        invoke(cli, "endpoints", "add", "https://example.com/h", "--events", "*", "--json").output
    )
    uid = added["id"]
    shown = json.loads(invoke(cli, "endpoints", "rules", uid, "--json").output)
    assert shown == {
        "id": uid,
        "timeout_seconds": None,
        "max_attempts": None,
        "retry_schedule": None,
        "status_overrides": {},
    }
    changed = invoke(
        cli,
        "endpoints",
        "rules",
        uid,
        "--timeout",
        "3",
        "--schedule",
        "5, 60",
        "--status",
        "404=retryable",
        "--status",
        "409=succeeded",
        "--json",
    )
    assert changed.exit_code == 0, changed.output
    assert json.loads(changed.output)["retry_schedule"] == [5.0, 60.0]
    # Options not given stay; one override can be dropped; 'default' clears a field.
    again = json.loads(
        invoke(
            cli,
            "endpoints",
            "rules",
            uid,
            "--clear-status",
            "409",
            "--timeout",
            "default",
            "--max-attempts",
            "3",
            "--json",
        ).output
    )
    assert again == {
        "id": uid,
        "timeout_seconds": None,
        "max_attempts": 3,
        "retry_schedule": [5.0, 60.0],
        "status_overrides": {"404": "retryable"},
    }
    text = invoke(cli, "endpoints", "rules", uid).output
    assert "retry_schedule:   5,60" in text and "timeout_seconds:  (global default)" in text
    reset = json.loads(invoke(cli, "endpoints", "rules", uid, "--reset", "--json").output)
    assert reset["status_overrides"] == {} and reset["max_attempts"] is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--status", "404:retryable"], "write STATUS=OUTCOME, e.g. 404=retryable"),
        (["--schedule", "5,soon"], "--schedule takes seconds separated by commas"),
        (["--max-attempts", "many"], "--max-attempts must be a number or 'default'"),
        (["--timeout", "900"], "timeout must be more than 0 and at most 300 seconds"),
    ],
)
def test_cli_rejects_bad_rules_in_one_line(
    cli: CliRunner, engine: Engine, args: list[str], message: str
) -> None:
    added = json.loads(
        invoke(cli, "endpoints", "add", "https://example.com/h", "--events", "*", "--json").output
    )
    result = cli.invoke(main, ["endpoints", "rules", added["id"], *args])
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output
