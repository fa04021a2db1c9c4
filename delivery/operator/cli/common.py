"""What the command modules share.

Errors as one line, settings and the database, tables and JSON, and the duration,
time and endpoint-health formatting that more than one command group prints.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import getpass
import json
import re
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

import click

from outbox.errors import OutboxError

if TYPE_CHECKING:  # loaded by the commands that use them: `keys generate` needs none
    from delivery.operator import app
    from outbox.settings import Settings
    from outbox.stats import Breaker, Stats

F = TypeVar("F", bound=Callable[..., Any])

json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
# Every operator action is audited: who (default: the login name) and, where it matters, why.
actor_option = click.option("--actor", default=None, help="Who is acting, for the audit log.")
reason_option = click.option("--reason", required=True, help="Why, for the audit log.")
tenant_option = click.option(
    "--tenant", default=None, help="Only this tenant's (a customer id; `outbox tenants list`)."
)


def tenant_filter(conn: Any, tenant: str | None) -> str | None:
    """A --tenant filter checked up front: a malformed or unknown id is a one-line error."""
    from outbox.tenants import require_tenant

    return None if tenant is None else require_tenant(conn, tenant)


def friendly_errors(func: F) -> F:
    """Turn the project's own errors into one readable line and exit status 1."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except OutboxError as exc:
            raise click.ClickException(str(exc)) from exc

    return wrapper  # type: ignore[return-value]


def settings() -> Settings:
    from outbox.settings import load_settings  # pydantic: a quarter of a second to import

    return load_settings()


@contextlib.contextmanager
def database(
    auto_migrate: bool | None = None,
    current: Settings | None = None,
    *,
    check_schema: bool = True,
) -> Iterator[tuple[Settings, app.Database]]:
    """Settings and the database; SIGTERM unwinds this (the embedded server stops)."""
    from delivery.operator import app  # the wiring imports the whole send path

    current = current or settings()
    with (
        terminate_as_exit(),
        app.open_database(current, auto_migrate=auto_migrate, check_schema=check_schema) as db,
    ):
        yield current, db


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def terminate_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit while a command holds the database.

    By default they end the process on the spot, skipping every `finally`, which
    would leave the embedded PostgreSQL running. asyncio's own handlers (`outbox
    run`) take over while the service runs; `rearm_terminate()` puts these back.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {
        signum: signal.signal(signum, _exit_on_signal)
        for signum in _EXIT_SIGNALS
        # A signal the caller ignores (SIG_IGN) stays ignored.
        if signal.getsignal(signum) is not signal.SIG_IGN
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def rearm_terminate() -> None:
    """After asyncio.run (which resets SIGTERM to the default), exit cleanly on it again."""
    if threading.current_thread() is threading.main_thread():
        for signum in _EXIT_SIGNALS:
            if signal.getsignal(signum) is not signal.SIG_IGN:
                signal.signal(signum, _exit_on_signal)


# Not SIGHUP: during `outbox run` it would unwind the event loop mid-attempt. A hangup
# still ends the process at once, and the next command reuses the server it left.
_EXIT_SIGNALS = (signal.SIGTERM,)


def default_actor() -> str:
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):
        return "cli:unknown"


def printable(value: object) -> str:
    """`value` as text a terminal shows as is: control characters (an ANSI escape in a
    hostile receiver's error text, say) become `?`, so output cannot rewrite the screen."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() or ch == " " else "?" for ch in text)


def print_table(rows: Sequence[Sequence[object]], headers: Sequence[str]) -> None:
    cells = [[printable(cell) for cell in row] for row in rows]
    widths = [
        max(len(header), *(len(row[i]) for row in cells)) if cells else len(header)
        for i, header in enumerate(headers)
    ]
    click.echo("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for row in cells:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


# ASCII digits only: `\d` would also take full-width and other scripts' digits.
_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([smhd]?)\s*$")
# A duration longer than this is a typo (and would overflow a timedelta).
MAX_DURATION = dt.timedelta(days=3650)
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: str) -> dt.timedelta:
    """'90', '90s', '15m', '24h', '7d' -> a timedelta."""
    match = _DURATION.match(value)
    if match is None:
        raise click.BadParameter(f"{value!r} is not a duration: use e.g. 90s, 15m, 24h or 7d")
    seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if seconds > MAX_DURATION.total_seconds():
        raise click.BadParameter(f"{value!r} is longer than {MAX_DURATION.days} days")
    return dt.timedelta(seconds=seconds)


def parse_when(value: str | None, now: dt.datetime) -> dt.datetime | None:
    """An ISO time, or a duration meaning that long ago ('2h' = two hours ago)."""
    if value is None:
        return None
    if _DURATION.match(value):
        return now - parse_duration(value)
    try:
        parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as exc:
        raise click.BadParameter(
            f"{value!r} is neither an ISO time (2026-11-29T03:00:00Z) nor an age like 2h"
        ) from exc
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


def ago(value: dt.datetime | None, now: dt.datetime) -> str:
    if value is None:
        return "-"
    seconds = (now - value).total_seconds()
    if seconds < 0:
        return f"in {span(-seconds)}"
    return f"{span(seconds)} ago"


def span(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def short(text: str | None, width: int = 60) -> str:
    if not text:
        return "-"
    flat = printable(" ".join(text.split()))
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


HEALTH_HEADERS = [
    "ENDPOINT", "STATE", "BREAKER", "ATTEMPTS", "SUCCESS", "P50", "P99", "PENDING", "DEAD",
]  # fmt: skip


def _breaker_cell(breaker: Breaker) -> str:
    """The state first (what a grep or an eye looks for), then when it changes next."""
    text = breaker.state
    if breaker.state == "open":
        text += f" (since {_clock_time(breaker.opened_at)}, probe in "
        text += f"{span(breaker.cooldown_remaining_seconds)})"
    elif breaker.state == "half_open":
        text += f" (probe out until {_clock_time(breaker.probe_until)})"
    if breaker.paused:
        text += f", paused by 429 until {_clock_time(breaker.paused_until)}"
    return text


def _clock_time(at: dt.datetime | None) -> str:
    return "-" if at is None else at.astimezone(dt.UTC).strftime("%H:%M:%SZ")


def health_rows(stats: Stats) -> list[list[object]]:
    return [
        [
            e.uid,
            "enabled"
            if e.enabled
            else ("auto-disabled" if e.auto_disabled else "disabled") + f" ({e.disabled_reason})",
            _breaker_cell(e.breaker),
            e.attempts,
            pct(e.success_rate),
            "-" if e.p50_ms is None else f"{e.p50_ms:.0f}ms",
            "-" if e.p99_ms is None else f"{e.p99_ms:.0f}ms",
            e.pending,
            e.dead,
        ]
        for e in stats.endpoints
    ]


# -- signing secrets (HMAC v1 or ed25519 v1a) -------------------------------------------

signature_option = click.option(
    "--signature",
    type=click.Choice(["hmac", "ed25519"]),
    default=None,
    help="Signature scheme: hmac (v1, shared whsec_ secret; the default) or ed25519 (v1a: "
    "the receiver verifies with a whpk_ public key and holds no secret).",
)


def secret_json(endpoint: Any, secret: str) -> dict[str, Any]:
    """What a new secret shows: the HMAC secret itself, or only the ed25519 public key."""
    if endpoint.signature_scheme == "ed25519":
        return {"public_key": endpoint.public_key}
    return {"secret": secret}


def print_secret(endpoint: Any, secret: str, as_json: bool, *, with_id: bool = True) -> None:
    if as_json:
        echo_json({**endpoint.as_json(), **secret_json(endpoint, secret)})
        return
    if with_id:
        click.echo(f"id:     {endpoint.uid}")
    if endpoint.signature_scheme == "ed25519":
        click.echo(f"public key: {endpoint.public_key}")
        click.echo("signature:  ed25519 (v1a); the whsk_ secret key stays encrypted here")
    else:
        click.echo(f"secret: {secret}")


def admin_base_url(host: str, port: int) -> str:
    """The base URL of the admin server (API, console, portal) on `host`:`port`."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
