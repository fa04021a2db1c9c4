"""Settings are validated once, with errors that name the variable to fix."""

from __future__ import annotations

import pytest

from outbox.crypto import SecretBox, generate_key
from outbox.errors import ConfigurationError
from outbox.settings import DEFAULT_RETRY_SCHEDULE, load_settings
from tests.helpers import ROOT

EXAMPLE = ROOT / "config" / "outbox.example.env"


def test_example_file_is_valid_and_matches_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_ENV_FILE", str(EXAMPLE))
    settings = load_settings()
    assert settings.retry_schedule == list(DEFAULT_RETRY_SCHEDULE)
    assert settings.max_attempts == 8
    assert settings.database_url is None


def test_csv_settings_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_RETRY_SCHEDULE", "1, 2.5,30")
    monkeypatch.setenv("OUTBOX_ALLOWED_NETWORKS", "127.0.0.0/8, 10.0.0.0/8")
    settings = load_settings()
    assert settings.retry_schedule == [1.0, 2.5, 30.0]
    assert settings.allowed_networks == ["127.0.0.0/8", "10.0.0.0/8"]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"OUTBOX_RETRY_SCHEDULE": ""}, "OUTBOX_RETRY_SCHEDULE"),
        ({"OUTBOX_RETRY_SCHEDULE": "5,-1"}, "OUTBOX_RETRY_SCHEDULE"),
        ({"OUTBOX_RETRY_SCHEDULE": "5,soon"}, "OUTBOX_RETRY_SCHEDULE"),
        ({"OUTBOX_MAX_ATTEMPTS": "0"}, "OUTBOX_MAX_ATTEMPTS"),
        ({"OUTBOX_REQUEST_TIMEOUT": "30", "OUTBOX_LEASE_SECONDS": "20"}, "must exceed"),
        ({"OUTBOX_WORKER_MAX_IN_FLIGHT": "many"}, "OUTBOX_WORKER_MAX_IN_FLIGHT"),
    ],
)
def test_bad_settings_name_the_variable(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigurationError, match=message):
        load_settings()


def test_missing_env_file_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_ENV_FILE", "/nonexistent/outbox.env")
    with pytest.raises(ConfigurationError, match="OUTBOX_ENV_FILE"):
        load_settings()


@pytest.mark.parametrize(
    "value", ["", "nokey", "k1:not-base64!", "k1:c2hvcnQ=", "bad id:" + "A" * 44]
)
def test_bad_secret_keys_are_explained(value: str) -> None:
    with pytest.raises(ConfigurationError, match="OUTBOX_SECRET_KEYS"):
        SecretBox.from_setting(value)


def test_secret_box_round_trip_and_rotation() -> None:
    old = generate_key("old")
    new = generate_key("new")
    sealed = SecretBox.from_setting(old).encrypt("whsec_x", context="endpoint:ep_1")
    both = SecretBox.from_setting(f"{new},{old}")
    assert both.decrypt(sealed, context="endpoint:ep_1") == "whsec_x"
    assert both.encrypt("whsec_x", context="endpoint:ep_1").startswith("v1:new:")
    # A ciphertext copied onto another endpoint row does not decrypt.
    with pytest.raises(Exception, match="did not decrypt"):
        both.decrypt(sealed, context="endpoint:ep_2")


def test_console_settings_reach_the_console_config(monkeypatch: pytest.MonkeyPatch) -> None:
    # Imported here: the operator side is not what this module is about.
    from delivery.operator.app import admin_config

    monkeypatch.setenv("OUTBOX_CONSOLE_APP_NAME", "Acme Hooks")
    monkeypatch.setenv("OUTBOX_CONSOLE_BRAND_COLOR", "#112233")
    monkeypatch.setenv("OUTBOX_PORTAL_BRAND", "Acme partner hooks")
    monkeypatch.setenv(
        "OUTBOX_PORTAL_FRAME_ORIGINS", "https://app.acme.example, http://localhost:3000"
    )
    monkeypatch.setenv("OUTBOX_PUBLIC_URL", "https://hooks.acme.example/")
    console = admin_config(load_settings()).console
    assert console.app_name == "Acme Hooks"
    assert console.brand_color == "#112233"
    assert console.portal_brand == "Acme partner hooks"
    assert console.frame_origins == ("https://app.acme.example", "http://localhost:3000")
    assert console.public_url == "https://hooks.acme.example"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("OUTBOX_CONSOLE_BRAND_COLOR", "red; } body { display: none"),
        ("OUTBOX_CONSOLE_APP_NAME", "bad\nname"),
        ("OUTBOX_PORTAL_BRAND", "bad\x1bbrand"),
        ("OUTBOX_PORTAL_FRAME_ORIGINS", "https://app.example/path"),
        ("OUTBOX_PORTAL_FRAME_ORIGINS", "*"),
        ("OUTBOX_PUBLIC_URL", "hooks.example.com"),
        ("OUTBOX_PUBLIC_URL", "https://hooks.example.com/?x=1"),
    ],
)
def test_bad_console_settings_are_one_clear_line(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigurationError, match=name) as raised:
        load_settings()
    assert "must" in str(raised.value)


def test_trusted_proxies_are_networks_and_reach_the_admin_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from delivery.operator.app import admin_config

    assert load_settings().trusted_proxies == []  # by default nobody's X-Forwarded-For counts
    assert admin_config(load_settings()).trusted_proxies == ()
    monkeypatch.setenv("OUTBOX_TRUSTED_PROXIES", " 10.0.0.5, 192.168.1.0/24 ,::1,")
    assert admin_config(load_settings()).trusted_proxies == (
        "10.0.0.5/32",
        "192.168.1.0/24",
        "::1/128",
    )


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("proxy.internal", "not an IP address or network"),
        ("*", "not an IP address or network"),
        ("10.0.0.1/8", "has host bits set"),
        ("10.0.0.5/33", "not an IP address or network"),
    ],
)
def test_a_bad_trusted_proxy_is_one_clear_line(
    monkeypatch: pytest.MonkeyPatch, value: str, why: str
) -> None:
    monkeypatch.setenv("OUTBOX_TRUSTED_PROXIES", value)
    with pytest.raises(ConfigurationError, match="OUTBOX_TRUSTED_PROXIES") as raised:
        load_settings()
    message = str(raised.value)
    assert why in message and "CIDRs like" in message and "\n" not in message


def test_the_adaptive_default_maximum_reaches_the_worker_and_the_admin_api(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from delivery.health import MAX_IN_FLIGHT
    from delivery.operator.app import admin_config, worker_config
    from outbox.settings import MAX_ADAPTIVE_DEFAULT_MAX

    # the default: one worker process's share for one endpoint (200 slots * 0.5)
    settings = load_settings()
    assert settings.adaptive_default_max == 100
    assert settings.adaptive_default_max == int(
        settings.worker_max_in_flight * settings.worker_endpoint_share
    )
    assert MAX_ADAPTIVE_DEFAULT_MAX == MAX_IN_FLIGHT  # the largest ceiling an endpoint may have
    monkeypatch.setenv("OUTBOX_ADAPTIVE_DEFAULT_MAX", "16")
    settings = load_settings()
    assert worker_config(settings).health.adaptive.default_maximum == 16
    assert admin_config(settings).adaptive_default_max == 16


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("0", "from 1 to 100,000"),
        ("-5", "from 1 to 100,000"),
        ("100001", "from 1 to 100,000"),
        (str(10**30), "from 1 to 100,000"),
        ("many", "valid integer"),
        ("2.5", "valid integer"),
        ("1e3", "valid integer"),
        ("", "valid integer"),
    ],
)
def test_a_bad_adaptive_default_maximum_is_one_clear_line(
    monkeypatch: pytest.MonkeyPatch, value: str, says: str
) -> None:
    monkeypatch.setenv("OUTBOX_ADAPTIVE_DEFAULT_MAX", value)
    with pytest.raises(ConfigurationError, match="OUTBOX_ADAPTIVE_DEFAULT_MAX") as raised:
        load_settings()
    assert says in str(raised.value)
