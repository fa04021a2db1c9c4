"""Log redaction and log-injection defence, through the real logging machinery."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from delivery.signing import generate_secret
from outbox.crypto import generate_key
from outbox.errors import ConfigurationError
from outbox.logging_setup import RedactingFilter, configure_logging, one_line, redact

log = logging.getLogger("outbox.test_redaction")


@pytest.fixture
def root_restored() -> Iterator[logging.Logger]:
    """Put the root logger back as it was: handlers, their filters and the level."""
    root = logging.getLogger()
    handlers = list(root.handlers)
    level = root.level
    yield root
    for handler in set(root.handlers) | set(handlers):
        for existing in list(handler.filters):
            if isinstance(existing, RedactingFilter):
                handler.removeFilter(existing)
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)


@pytest.fixture
def redacting(root_restored: logging.Logger, caplog: pytest.LogCaptureFixture) -> None:
    # caplog's handler is on the root logger while the test runs, so it gets the filter.
    configure_logging("DEBUG")
    assert any(isinstance(f, RedactingFilter) for f in caplog.handler.filters)


def logged(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(record.getMessage() for record in caplog.records) + "\n" + caplog.text


# ---------------------------------------------------------------------------- secrets


@pytest.mark.usefixtures("redacting")
def test_signing_secrets_are_masked_in_arguments_and_messages(
    caplog: pytest.LogCaptureFixture,
) -> None:
    secret = generate_secret()
    log.info("endpoint created with secret %s", secret)
    log.info(f"f-string slip: {secret}")
    log.info("as a dict %r", {"secret": secret})
    text = logged(caplog)
    assert secret not in text
    assert secret.removeprefix("whsec_") not in text
    assert caplog.records[0].getMessage() == "endpoint created with secret whsec_***"


@pytest.mark.usefixtures("redacting")
def test_bearer_tokens_and_authorization_headers_are_masked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log.warning("request headers %s", {"authorization": "Bearer eyJhbGciOi.J9.sig-_x"})
    log.warning("retrying with Bearer abcdefgh12345678")
    log.warning("Authorization: Basic dXNlcjpwYXNzd29yZA==")
    text = logged(caplog)
    for leaked in ("eyJhbGciOi", "abcdefgh12345678", "dXNlcjpwYXNzd29yZA"):
        assert leaked not in text
    assert "Bearer ***" in caplog.records[1].getMessage()


@pytest.mark.usefixtures("redacting")
def test_outbox_secret_keys_are_masked(caplog: pytest.LogCaptureFixture) -> None:
    first, second = generate_key("k1"), generate_key()
    log.error("OUTBOX_SECRET_KEYS=%s,%s is invalid", first, second)
    log.error("environment: {'OUTBOX_SECRET_KEYS': '%s'}", first)
    log.error("loaded key %s", second)
    text = logged(caplog)
    for key in (first, second):
        assert key.split(":", 1)[1] not in text
    assert caplog.records[0].getMessage() == "OUTBOX_SECRET_KEYS=*** is invalid"
    kid = second.split(":", 1)[0]
    assert caplog.records[2].getMessage() == f"loaded key {kid}:***"  # the key id is kept


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://app:s3cr3t@db:5432/outbox", "postgresql://app:***@db:5432/outbox"),
        ("postgres://app:s3cr3t@db/outbox?sslmode=require", "postgres://app:***@db/outbox"),
        ("postgresql+psycopg://app:s3cr%40t@db/outbox", "postgresql+psycopg://app:***@db/"),
        ("postgresql://app:s3c@r3t@db/outbox", "postgresql://app:***@db/outbox"),
    ],
)
@pytest.mark.usefixtures("redacting")
def test_database_passwords_are_masked(
    url: str, shown: str, caplog: pytest.LogCaptureFixture
) -> None:
    log.info("connecting to %s", url)
    text = logged(caplog)
    assert "s3c" not in text
    assert shown in text


@pytest.mark.usefixtures("redacting")
def test_keyword_passwords_and_query_tokens_are_masked(caplog: pytest.LogCaptureFixture) -> None:
    log.info("dsn host=db password=s3cr3t user=app")
    log.info("PGPASSWORD=s3cr3t")
    log.info("HTTP Request: POST https://hooks.example.com/in?token=tok123&x=1 200")
    text = logged(caplog)
    assert "s3cr3t" not in text
    assert "tok123" not in text
    assert "https://hooks.example.com/in?token=***&x=1" in text


@pytest.mark.usefixtures("redacting")
def test_ordinary_messages_are_untouched(caplog: pytest.LogCaptureFixture) -> None:
    message = (
        "delivered 5 of 5 to https://example.com:8443/hook?page=2 in 0.21s; "
        "basic retry policy; the bearer of news; 100% done"
    )
    log.info(message)
    log.info("%s deliveries, %d%% ok", "12", 99)
    assert [r.getMessage() for r in caplog.records] == [message, "12 deliveries, 99% ok"]


# ---------------------------------------------------------------------- log injection


@pytest.mark.usefixtures("redacting")
def test_line_breaks_in_arguments_cannot_forge_records(caplog: pytest.LogCaptureFixture) -> None:
    forged = "ok\n2030-01-01 00:00:00 INFO outbox.cli: admin login succeeded\r"
    log.warning("receiver answered %s", forged)
    log.warning("url was " + "http://x/\u2028fake\x1b[31mred\x85")
    assert len(caplog.text.splitlines()) == 2
    first, second = (r.getMessage() for r in caplog.records)
    assert first == (
        "receiver answered ok\\n2030-01-01 00:00:00 INFO outbox.cli: admin login succeeded\\r"
    )
    assert second == "url was http://x/\\u2028fake\\x1b[31mred\\x85"


@pytest.mark.usefixtures("redacting")
def test_tracebacks_are_redacted_but_keep_their_lines(caplog: pytest.LogCaptureFixture) -> None:
    secret = generate_secret()
    try:
        raise RuntimeError(f"could not decrypt {secret}\x1b[2J")
    except RuntimeError:
        log.exception("decrypt failed")
    text = caplog.text
    assert secret not in text
    assert "could not decrypt whsec_***\\x1b[2J" in text
    assert "Traceback (most recent call last):\n" in text


@pytest.mark.usefixtures("redacting")
def test_unformattable_records_are_kept_and_redacted(caplog: pytest.LogCaptureFixture) -> None:
    secret = generate_secret()
    log.info("%d attempts for %s", "not-a-number", secret)
    log.info({"a dict": "as the message"})
    first, second = (r.getMessage() for r in caplog.records)
    assert "unformattable log arguments" in first
    assert secret not in first
    assert second == "{'a dict': 'as the message'}"


@pytest.mark.usefixtures("redacting")
def test_child_loggers_are_covered_and_records_rewritten_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logging.getLogger("delivery.worker.deep").error("secret=%s", "hunter2")
    record = caplog.records[0]
    assert record.getMessage() == "secret=***"
    assert record.args is None
    assert RedactingFilter().filter(record) is True  # running again changes nothing
    assert record.getMessage() == "secret=***"


# ------------------------------------------------------------------ configure_logging


def test_configure_logging_adds_a_stderr_style_handler_when_none_exists(
    root_restored: logging.Logger,
) -> None:
    for handler in list(root_restored.handlers):
        root_restored.removeHandler(handler)
    stream = io.StringIO()
    configure_logging("warning", stream=stream)
    configure_logging("WARNING", stream=stream)  # idempotent
    assert root_restored.level == logging.WARNING
    assert len(root_restored.handlers) == 1
    assert len(root_restored.handlers[0].filters) == 1
    log.info("below the level")
    log.warning("Bearer %s", "abcdefgh12345678\nforged")
    output = stream.getvalue()
    assert output.count("\n") == 1
    assert "WARNING outbox.test_redaction: Bearer ***\\nforged" in output


@pytest.mark.parametrize(("level", "number"), [("debug", 10), (" Info ", 20), (30, 30)])
def test_levels_by_name_or_number(
    level: int | str, number: int, root_restored: logging.Logger
) -> None:
    configure_logging(level)
    assert root_restored.level == number


@pytest.mark.parametrize("level", ["LOUD", "", True])
def test_unknown_levels_say_what_to_use(level: object, root_restored: logging.Logger) -> None:
    with pytest.raises(ConfigurationError, match=r"OUTBOX_LOG_LEVEL.*use DEBUG, INFO"):
        configure_logging(level)  # type: ignore[arg-type]


def test_helpers_are_usable_outside_logging() -> None:
    secret = generate_secret()
    assert redact(f"stored {secret}") == "stored whsec_***"
    assert one_line("a\r\nb\tc") == "a\\r\\nb\tc"
