"""The `outbox` command: the one composition root of the project.

Every command that prints data takes `--json`. Errors the user can fix are printed
as one clear line (exit status 1), never as a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import getpass
import json
import re
import signal
import sys
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import click

from delivery import admin, app
from delivery.loop import run_loop
from delivery.supervisor import default_processes
from outbox import migrate as migrations
from outbox import operations
from outbox.clock import SystemClock
from outbox.crypto import SecretBox, generate_key
from outbox.db import make_async_engine
from outbox.endpoint_rules import (
    DeliveryRules,
    get_delivery_rules,
    parse_status_override,
    set_delivery_rules,
)
from outbox.endpoints import (
    Endpoint,
    list_endpoints,
    reencrypt_secrets,
    reveal_secret,
    set_enabled,
)
from outbox.errors import OutboxError
from outbox.headers import get_headers, parse_header_argument, set_headers
from outbox.logging_setup import configure_logging
from outbox.publish import publish as publish_event
from outbox.settings import Settings, load_settings
from outbox.stats import Breaker, Stats, collect_stats
from outbox.tokens import ROLES, create_token, list_tokens, revoke_token

F = TypeVar("F", bound=Callable[..., Any])

json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")


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
    return load_settings()


@contextlib.contextmanager
def database(auto_migrate: bool | None = None) -> Iterator[tuple[Settings, app.Database]]:
    current = settings()
    with app.open_database(current, auto_migrate=auto_migrate) as db:
        yield current, db


def default_actor() -> str:
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):
        return "cli:unknown"


def print_table(rows: Sequence[Sequence[object]], headers: Sequence[str]) -> None:
    cells = [[str(cell) for cell in row] for row in rows]
    widths = [
        max(len(header), *(len(row[i]) for row in cells)) if cells else len(header)
        for i, header in enumerate(headers)
    ]
    click.echo("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for row in cells:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


@click.group()
@click.version_option(package_name="webhook-outbox")
def main() -> None:
    """Reliable webhooks from a transactional outbox in PostgreSQL.

    With OUTBOX_DATABASE_URL unset, commands use an embedded PostgreSQL kept in
    OUTBOX_DATA_DIR (default ~/.local/share/webhook-outbox).
    """
    configure_logging("WARNING")


@main.command()
@friendly_errors
def migrate() -> None:
    """Create or upgrade the outbox tables (safe to run again)."""
    with database(auto_migrate=True):
        click.echo(f"schema is at revision {migrations.head_revision()}")


@main.command()
@click.argument("event_type")
@click.argument("payload")
@click.option("--idempotency-key", default=None, help="Publishing the same key again is a no-op.")
@click.option("--ordering-key", default=None, help="Events with one key are delivered in order.")
@click.option(
    "--priority",
    type=int,
    default=None,
    help="-100..100, higher first; default: the event type's (outbox priorities).",
)
@json_option
@friendly_errors
def publish(
    event_type: str,
    payload: str,
    idempotency_key: str | None,
    ordering_key: str | None,
    priority: int | None,
    as_json: bool,
) -> None:
    """Publish an event: outbox publish order.created '{"id": 42}'."""
    try:
        data = json.loads(payload)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not valid JSON: {exc}", param_hint="PAYLOAD") from exc
    with database() as (current, db), db.engine.begin() as conn:
        message_id = publish_event(
            conn,
            event_type,
            data,
            idempotency_key=idempotency_key,
            ordering_key=ordering_key,
            priority=priority,
            max_payload_bytes=current.max_payload_bytes,
        )
    if as_json:
        echo_json({"message_id": message_id, "event_type": event_type})
    else:
        click.echo(message_id)


@main.group()
def endpoints() -> None:
    """Add, list, enable and disable endpoints."""


def _endpoint_rows(items: Sequence[Endpoint]) -> list[list[object]]:
    return [
        [
            item.uid,
            "enabled" if item.enabled else f"disabled ({item.disabled_reason})",
            ",".join(item.event_types),
            item.url,
        ]
        for item in items
    ]


@endpoints.command("add")
@click.argument("url")
@click.option("--events", required=True, help="Comma-separated patterns: 'order.*,invoice.paid'.")
@click.option("--secret", default=None, help="A whsec_ secret to use instead of a generated one.")
@click.option("--description", default="", help="A note for operators.")
@json_option
@friendly_errors
def endpoints_add(
    url: str, events: str, secret: str | None, description: str, as_json: bool
) -> None:
    """Add an endpoint; prints its id and its signing secret (shown only now)."""
    with database() as (current, db):
        box = app.secret_box(current, db)
        with db.engine.begin() as conn:
            created = operations.add_endpoint(
                conn,
                box,
                actor=default_actor(),
                url=url,
                event_types=events,
                secret=secret,
                description=description,
                https_only=current.https_only,
            )
    if as_json:
        echo_json({**created.endpoint.as_json(), "secret": created.secret})
    else:
        click.echo(f"id:     {created.endpoint.uid}")
        click.echo(f"secret: {created.secret}")
        click.echo("Give the secret to the receiver; it is stored encrypted and not shown again.")


@endpoints.command("list")
@json_option
@friendly_errors
def endpoints_list(as_json: bool) -> None:
    """List endpoints."""
    with database() as (_, db), db.engine.connect() as conn:
        items = list_endpoints(conn)
    if as_json:
        echo_json([item.as_json() for item in items])
    elif not items:
        click.echo("no endpoints yet: outbox endpoints add URL --events 'order.*'")
    else:
        print_table(_endpoint_rows(items), ["ID", "STATE", "EVENTS", "URL"])


def _show_endpoint(item: Endpoint, as_json: bool) -> None:
    if as_json:
        echo_json(item.as_json())
    else:
        print_table(_endpoint_rows([item]), ["ID", "STATE", "EVENTS", "URL"])


def _set_enabled(uid: str, enabled: bool, reason: str | None, actor: str, as_json: bool) -> None:
    with database() as (_, db), db.engine.begin() as conn:
        item = set_enabled(conn, uid, enabled=enabled, reason=reason, actor=actor)
    _show_endpoint(item, as_json)


@endpoints.command("enable")
@click.argument("endpoint_id")
@click.option("--actor", default=None, help="Who is acting, for the audit log.")
@json_option
@friendly_errors
def endpoints_enable(endpoint_id: str, actor: str | None, as_json: bool) -> None:
    """Enable an endpoint; its waiting deliveries resume."""
    _set_enabled(endpoint_id, True, None, actor or default_actor(), as_json)


@endpoints.command("disable")
@click.argument("endpoint_id")
@click.option("--reason", required=True, help="Why, for operators and the audit log.")
@click.option("--actor", default=None, help="Who is acting, for the audit log.")
@json_option
@friendly_errors
def endpoints_disable(endpoint_id: str, reason: str, actor: str | None, as_json: bool) -> None:
    """Disable an endpoint; its pending deliveries wait, nothing is dropped."""
    _set_enabled(endpoint_id, False, reason, actor or default_actor(), as_json)


def _rule_number(value: str | None, kind: type[float] | type[int], what: str) -> Any:
    """'default' (or '') means "use the global default"; anything else must be a number."""
    if value is None or value.strip().lower() in {"", "default"}:
        return None
    try:
        return kind(value)
    except ValueError as exc:
        raise click.BadParameter(f"{what} must be a number or 'default', not {value!r}") from exc


def _parse_schedule(value: str) -> tuple[float, ...] | None:
    if value.strip().lower() in {"", "default"}:
        return None
    try:
        return tuple(float(part) for part in value.split(",") if part.strip())
    except ValueError as exc:
        raise click.BadParameter(
            f"--schedule takes seconds separated by commas, e.g. '5,60,300', not {value!r}"
        ) from exc


@endpoints.command("rules")
@click.argument("endpoint_id")
@click.option("--timeout", default=None, help="Attempt deadline in seconds, or 'default'.")
@click.option("--max-attempts", default=None, help="Attempts per delivery, or 'default'.")
@click.option(
    "--schedule", default=None, help="Seconds between attempts: '5,60,300', or 'default'."
)
@click.option(
    "--status",
    "statuses",
    multiple=True,
    help="Override one status: '404=retryable' (succeeded|retryable|permanent); repeatable.",
)
@click.option("--clear-status", "cleared", multiple=True, type=int, help="Drop one override.")
@click.option("--reset", is_flag=True, help="Drop every endpoint rule first (global defaults).")
@click.option("--reason", default=None, help="Why, for the audit log.")
@click.option("--actor", default=None, help="Who is acting, for the audit log.")
@json_option
@friendly_errors
def endpoints_rules(
    endpoint_id: str,
    timeout: str | None,
    max_attempts: str | None,
    schedule: str | None,
    statuses: tuple[str, ...],
    cleared: tuple[int, ...],
    reset: bool,
    reason: str | None,
    actor: str | None,
    as_json: bool,
) -> None:
    """Show or change an endpoint's delivery rules; options not given stay as they are."""
    changing = any((timeout, max_attempts, schedule, statuses, cleared, reset))
    with database() as (_, db), db.engine.begin() as conn:
        rules = DeliveryRules() if reset else get_delivery_rules(conn, endpoint_id)
        if changing:
            overrides = dict(rules.status_overrides)
            for code in cleared:
                overrides.pop(code, None)
            overrides.update(parse_status_override(item) for item in statuses)
            rules = DeliveryRules(
                timeout_seconds=rules.timeout_seconds
                if timeout is None
                else _rule_number(timeout, float, "--timeout"),
                max_attempts=rules.max_attempts
                if max_attempts is None
                else _rule_number(max_attempts, int, "--max-attempts"),
                retry_schedule=rules.retry_schedule
                if schedule is None
                else _parse_schedule(schedule),
                status_overrides=overrides,
            )
            rules = set_delivery_rules(
                conn, endpoint_id, rules, actor=actor or default_actor(), reason=reason
            )
    shown = rules.as_json()
    if as_json:
        echo_json({"id": endpoint_id, **shown})
        return
    for name, value in shown.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items()) or None
        elif isinstance(value, list):
            value = ",".join(f"{v:g}" for v in value)
        click.echo(f"{name + ':':18}{'(global default)' if value is None else value}")


@main.command()
@click.option(
    "--admin", is_flag=True, help="Also serve the admin HTTP API (OUTBOX_ADMIN_HOST/PORT)."
)
@click.option(
    "--processes",
    type=click.IntRange(min=1),
    default=None,
    envvar="OUTBOX_PROCESSES",
    help="Service processes on this host; env OUTBOX_PROCESSES. [default: one per core; "
    "1 with --admin]",
)
@friendly_errors
def run(admin: bool, processes: int | None) -> None:
    """Run the relay, the delivery workers and the reaper until SIGINT or SIGTERM."""
    if processes is None:
        # One per core: a process delivers on one core (the GIL). --admin serves from one.
        processes = 1 if admin else default_processes()
    if admin and processes > 1:
        raise click.UsageError(
            "--admin serves from one process: with --processes > 1 run `outbox serve` beside it"
        )
    with database() as (current, db):
        configure_logging(current.log_level)
        if processes > 1:
            from delivery.supervisor import ProcessSpec, run_supervised

            spec = ProcessSpec(
                url=db.url,
                secret_keys=app.secret_keys_setting(current, db),
                relay=app.relay_config(current),
                worker=app.worker_config(current),
                reaper=app.reaper_config(current),
                retention=app.retention_config(current),
                allowed_networks=tuple(current.allowed_networks),
                https_only=current.https_only,
                http_transport=current.http_transport,
                log_level=current.log_level,
                event_loop=current.event_loop,
            )
            app.secret_box(current, db)  # refuse to start children that could not sign
            click.echo(
                f"outbox running {processes} processes; Ctrl-C (SIGINT) or SIGTERM stops them",
                err=True,
            )
            status = run_supervised(spec, processes, grace=spec.worker.shutdown_grace + 5)
            click.echo("outbox stopped", err=True)
            sys.exit(status)
        box = app.secret_box(current, db)
        service = app.Service(
            db.url,
            box,
            relay=app.relay_config(current),
            worker=app.worker_config(current),
            allowed_networks=tuple(current.allowed_networks),
            https_only=current.https_only,
            retention=app.retention_config(current),
            reaper=app.reaper_config(current),
            http_transport=current.http_transport,
        )
        click.echo("outbox running; Ctrl-C (SIGINT) or SIGTERM stops it cleanly", err=True)
        if admin:
            run_loop(
                _run_all_until_signalled([service.run, _admin_runner(current, db, box)]),
                current.event_loop,
            )
        else:
            run_loop(_run_until_signalled(service), current.event_loop)
        click.echo("outbox stopped", err=True)


async def _run_until_signalled(service: app.Service) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        await service.run(stop)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


@main.command()
@friendly_errors
def demo() -> None:
    """A 30-second tour: embedded PostgreSQL, a local receiver, a healthy and a failing partner."""
    from delivery.demo import run_demo

    sys.exit(asyncio.run(run_demo(settings())))


@main.group()
def keys() -> None:
    """Keys that encrypt endpoint secrets at rest."""


@keys.command("generate")
def keys_generate() -> None:
    """Print a new OUTBOX_SECRET_KEYS entry."""
    click.echo(generate_key())


@keys.command("rotate")
@click.option("--actor", default=None, help="Who is acting, for the audit log.")
@json_option
@friendly_errors
def keys_rotate(actor: str | None, as_json: bool) -> None:
    """Re-encrypt every endpoint secret with the first key of OUTBOX_SECRET_KEYS.

    Put the new key first and keep the old one after it until this has run.
    """
    with database() as (current, db):
        box = app.secret_box(current, db)
        with db.engine.begin() as conn:
            changed = reencrypt_secrets(conn, box, actor=actor or default_actor())
    if as_json:
        echo_json({"endpoints": changed, "key_id": box.current_key_id})
    else:
        click.echo(f"re-encrypted {changed} endpoint secrets with key {box.current_key_id!r}")


@endpoints.command("reveal-secret")
@click.argument("endpoint_id")
@click.option("--reason", required=True, help="Why the secret is needed, for the audit log.")
@click.option("--actor", default=None, help="Who is acting, for the audit log.")
@json_option
@friendly_errors
def endpoints_reveal_secret(
    endpoint_id: str, reason: str, actor: str | None, as_json: bool
) -> None:
    """Print an endpoint's signing secret (audited)."""
    with database() as (current, db):
        box = app.secret_box(current, db)
        with db.engine.begin() as conn:
            secret = reveal_secret(
                conn, box, endpoint_id, actor=actor or default_actor(), reason=reason
            )
    if as_json:
        echo_json({"id": endpoint_id, "secret": secret})
    else:
        click.echo(secret)


# --- operator tools (issue 5): deliveries, replay, discard, stats, audit, serve, tokens ---

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: str) -> dt.timedelta:
    """'90', '90s', '15m', '24h', '7d' -> a timedelta."""
    match = _DURATION.match(value)
    if match is None:
        raise click.BadParameter(f"{value!r} is not a duration: use e.g. 90s, 15m, 24h or 7d")
    return dt.timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2)])


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


def _ago(value: dt.datetime | None, now: dt.datetime) -> str:
    if value is None:
        return "-"
    seconds = (now - value).total_seconds()
    if seconds < 0:
        return f"in {_span(-seconds)}"
    return f"{_span(seconds)} ago"


def _span(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _short(text: str | None, width: int = 60) -> str:
    if not text:
        return "-"
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def filter_options(func: F) -> F:
    """The delivery filter shared by `deliveries list` and `replay`."""
    options = [
        click.option(
            "--state", "states", multiple=True, help="scheduled, in_flight, succeeded, dead, ..."
        ),
        click.option("--endpoint", default=None, help="Endpoint id (ep_...)."),
        click.option("--event-type", default=None, help="Exact event type."),
        click.option("--error", default=None, help="Text in the last error or any attempt's."),
        click.option("--since", default=None, help="Created at/after: ISO time or age (2h)."),
        click.option("--until", default=None, help="Created before: ISO time or age."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _filter(
    states: Sequence[str],
    endpoint: str | None,
    event_type: str | None,
    error: str | None,
    since: str | None,
    until: str | None,
    now: dt.datetime,
    **extra: Any,
) -> operations.DeliveryFilter:
    flat = tuple(s.strip() for item in states for s in item.split(",") if s.strip())
    return operations.DeliveryFilter(
        states=flat,
        endpoint=endpoint,
        event_type=event_type,
        error=error,
        since=parse_when(since, now),
        until=parse_when(until, now),
        **extra,
    )


def _delivery_rows(
    items: Sequence[operations.DeliverySummary], now: dt.datetime
) -> list[list[object]]:
    return [
        [
            item.id,
            item.state + (f" (replay of {item.replay_of})" if item.replay_of else ""),
            f"{item.attempts}/{item.max_attempts}",
            item.endpoint_uid,
            item.event_type,
            _ago(item.created_at, now),
            _short(item.final_reason or item.last_error, 50),
        ]
        for item in items
    ]


_DELIVERY_HEADERS = ["ID", "STATE", "TRIES", "ENDPOINT", "EVENT", "CREATED", "LAST ERROR"]


@main.group()
def deliveries() -> None:
    """Find and inspect deliveries."""


@deliveries.command("list")
@filter_options
@click.option("--unreplayed", is_flag=True, help="Only deliveries nobody has replayed yet.")
@click.option("--limit", default=50, show_default=True, help="Page size (1..1000).")
@click.option("--before", type=int, default=None, help="Next page: ids below this one.")
@json_option
@friendly_errors
def deliveries_list(
    states: Sequence[str],
    endpoint: str | None,
    event_type: str | None,
    error: str | None,
    since: str | None,
    until: str | None,
    unreplayed: bool,
    limit: int,
    before: int | None,
    as_json: bool,
) -> None:
    """List deliveries, newest first: outbox deliveries list --state dead --error timeout."""
    now = SystemClock().now()
    flt = _filter(
        states,
        endpoint,
        event_type,
        error,
        since,
        until,
        now,
        unreplayed=unreplayed,
        limit=limit,
        before_id=before,
    )
    with database() as (_, db), db.engine.connect() as conn:
        items = operations.search_deliveries(conn, flt)
    next_before = items[-1].id if len(items) == limit else None
    if as_json:
        echo_json({"items": [item.as_json() for item in items], "next_before": next_before})
        return
    if not items:
        click.echo("no deliveries match")
        return
    print_table(_delivery_rows(items, now), _DELIVERY_HEADERS)
    if next_before:
        click.echo(f"more: add --before {next_before}")


@deliveries.command("show")
@click.argument("delivery_id", type=int)
@json_option
@friendly_errors
def deliveries_show(delivery_id: int, as_json: bool) -> None:
    """A delivery with its event, every attempt and any replays."""
    with database() as (_, db), db.engine.connect() as conn:
        detail = operations.get_delivery(conn, delivery_id)
    data = detail.as_json()
    if as_json:
        echo_json(data)
        return
    d = detail.delivery
    click.echo(f"delivery {d.id}: {d.state}, {d.attempts}/{d.max_attempts} attempts")
    click.echo(f"endpoint:  {d.endpoint_uid} {d.endpoint_url}")
    click.echo(f"event:     {d.message_id} {d.event_type} (webhook-id)")
    click.echo(f"payload:   {_short(json.dumps(detail.payload), 200)}")
    if d.replay_of:
        click.echo(f"replay of: {d.replay_of}")
    if d.state == "scheduled":
        click.echo(f"next try:  {d.next_attempt_at.isoformat()}")
    if d.final_reason:
        click.echo(f"reason:    {d.final_reason}")
    if detail.attempts:
        click.echo("\nattempts:")
        print_table(
            [
                [
                    a["attempt_number"],
                    a["started_at"],
                    a["outcome"],
                    a["status_code"] or "-",
                    f"{a['duration_ms']}ms",
                    _short(a["error"], 40),
                    _short(a["response_excerpt"], 40),
                ]
                for a in detail.attempts
            ],
            ["#", "STARTED", "OUTCOME", "STATUS", "TOOK", "ERROR", "RESPONSE"],
        )
    if detail.replays:
        click.echo("\nreplays:")
        print_table(
            [
                [r["id"], r["state"], r["created_at"], r["actor"], r["reason"]]
                for r in detail.replays
            ],
            ["ID", "STATE", "AT", "BY", "WHY"],
        )


@main.command()
@click.argument("delivery_ids", nargs=-1, type=int)
@click.option("--reason", required=True, help="Why, for the audit log.")
@click.option("--actor", default=None, help="Who is acting, for the audit log.")
@click.option("--force", is_flag=True, help="Also replay succeeded deliveries.")
@click.option("--dry-run", is_flag=True, help="Show the count and a sample; change nothing.")
@filter_options
@click.option("--max", "max_count", default=1000, show_default=True, help="At most this many.")
@click.option(
    "--rate", type=float, default=None, help="Replays per minute (default OUTBOX_REPLAY_RATE...)."
)
@json_option
@friendly_errors
def replay(
    delivery_ids: tuple[int, ...],
    reason: str,
    actor: str | None,
    force: bool,
    dry_run: bool,
    states: Sequence[str],
    endpoint: str | None,
    event_type: str | None,
    error: str | None,
    since: str | None,
    until: str | None,
    max_count: int,
    rate: float | None,
    as_json: bool,
) -> None:
    """Replay deliveries as new ones with the same webhook-id; the old rows stay as they were.

    Give ids (outbox replay 12 13 --reason ...) or a filter
    (outbox replay --endpoint ep_... --since 2h --reason ... [--dry-run]).
    """
    now = SystemClock().now()
    has_filter = any([states, endpoint, event_type, error, since, until])
    if bool(delivery_ids) == has_filter:
        raise click.UsageError("give delivery ids or a filter (--endpoint, --state, ...), not both")
    who = actor or default_actor()
    with database() as (current, db), db.engine.begin() as conn:
        per_minute = rate or current.replay_rate_per_minute
        if delivery_ids and dry_run:
            found = [operations.get_delivery(conn, i).delivery for i in delivery_ids]
            result = operations.ReplayResult(dry_run=True, matched=len(found), sample=found)
        elif delivery_ids:
            result = operations.replay(
                conn,
                delivery_ids,
                actor=who,
                reason=reason,
                now=now,
                force=force,
                rate_per_minute=per_minute,
            )
        else:
            result = operations.bulk_replay(
                conn,
                _filter(states, endpoint, event_type, error, since, until, now),
                actor=who,
                reason=reason,
                now=now,
                dry_run=dry_run,
                force=force,
                max_count=max_count,
                rate_per_minute=per_minute,
            )
    if as_json:
        echo_json(result.as_json())
        return
    if result.dry_run:
        click.echo(f"dry run: {result.matched} deliveries would be replayed; nothing changed")
        if result.sample:
            print_table(_delivery_rows(result.sample, now), _DELIVERY_HEADERS)
        return
    click.echo(f"replayed {len(result.replayed)} of {result.matched} matching deliveries")
    for old, new in result.replayed[:20]:
        click.echo(f"  {old} -> {new}")
    if result.last_due and result.first_due and result.last_due > result.first_due:
        click.echo(f"spread until {result.last_due.isoformat()} ({per_minute:g}/minute)")


@main.command()
@click.argument("delivery_ids", nargs=-1, type=int, required=True)
@click.option("--reason", required=True, help="Why, for operators and the audit log.")
@click.option("--actor", default=None, help="Who is acting, for the audit log.")
@json_option
@friendly_errors
def discard(delivery_ids: tuple[int, ...], reason: str, actor: str | None, as_json: bool) -> None:
    """Give up on scheduled or dead deliveries, for good (all or nothing)."""
    with database() as (_, db), db.engine.begin() as conn:
        done = operations.discard(
            conn,
            delivery_ids,
            actor=actor or default_actor(),
            reason=reason,
            now=SystemClock().now(),
        )
    if as_json:
        echo_json({"discarded": done})
    else:
        click.echo(f"discarded {len(done)}: {' '.join(map(str, done))}")


@endpoints.command("update")
@click.argument("endpoint_id")
@click.option("--url", default=None)
@click.option("--events", default=None, help="Comma-separated patterns (replaces the list).")
@click.option("--description", default=None)
@click.option("--timeout", type=float, default=None, help="Per-attempt deadline in seconds.")
@click.option("--max-attempts", type=int, default=None)
@click.option("--reason", default=None, help="Why, for the audit log.")
@click.option("--actor", default=None, help="Who is acting, for the audit log.")
@json_option
@friendly_errors
def endpoints_update(
    endpoint_id: str,
    url: str | None,
    events: str | None,
    description: str | None,
    timeout: float | None,
    max_attempts: int | None,
    reason: str | None,
    actor: str | None,
    as_json: bool,
) -> None:
    """Change an endpoint's URL, events, description, timeout or attempts."""
    with database() as (current, db), db.engine.begin() as conn:
        item = operations.update_endpoint(
            conn,
            endpoint_id,
            https_only=current.https_only,
            actor=actor or default_actor(),
            url=url,
            description=description,
            event_types=events,
            timeout_seconds=timeout,
            max_attempts=max_attempts,
            reason=reason,
        )
    _show_endpoint(item, as_json)


@endpoints.command("delete")
@click.argument("endpoint_id")
@click.option("--reason", required=True, help="Why, for the audit log.")
@click.option("--force", is_flag=True, help="Delete even with pending deliveries.")
@click.option("--actor", default=None, help="Who is acting, for the audit log.")
@json_option
@friendly_errors
def endpoints_delete(
    endpoint_id: str, reason: str, force: bool, actor: str | None, as_json: bool
) -> None:
    """Delete an endpoint and its delivery history (disable is the reversible option)."""
    with database() as (_, db), db.engine.begin() as conn:
        result = operations.delete_endpoint(
            conn, endpoint_id, actor=actor or default_actor(), reason=reason, force=force
        )
    if as_json:
        echo_json({"deleted": endpoint_id, **result})
    else:
        click.echo(
            f"deleted {endpoint_id} with {result['deliveries']} deliveries "
            f"and {result['attempts']} attempts"
        )


@endpoints.command("rotate-secret")
@click.argument("endpoint_id")
@click.option(
    "--grace", default="24h", show_default=True, help="How long the old secret also signs."
)
@click.option("--secret", default=None, help="A whsec_ secret to use instead of a generated one.")
@click.option("--reason", default=None, help="Why, for the audit log.")
@click.option("--actor", default=None, help="Who is acting, for the audit log.")
@json_option
@friendly_errors
def endpoints_rotate_secret(
    endpoint_id: str,
    grace: str,
    secret: str | None,
    reason: str | None,
    actor: str | None,
    as_json: bool,
) -> None:
    """New signing secret; both old and new signatures are sent during the grace period."""
    with database() as (current, db):
        box = app.secret_box(current, db)
        with db.engine.begin() as conn:
            rotated = operations.rotate_secret(
                conn,
                box,
                endpoint_id,
                actor=actor or default_actor(),
                now=SystemClock().now(),
                grace=parse_duration(grace),
                secret=secret,
                reason=reason,
            )
    if as_json:
        echo_json(
            {
                **rotated.endpoint.as_json(),
                "secret": rotated.secret,
                "previous_secret_expires_at": rotated.previous_expires_at.isoformat(),
            }
        )
    else:
        click.echo(f"secret: {rotated.secret}")
        click.echo(
            f"the old secret also signs until {rotated.previous_expires_at.isoformat()}; "
            "give the receiver the new one before then"
        )


@endpoints.command("status")
@click.option("--window", default="1h", show_default=True, help="How far back rates look.")
@json_option
@friendly_errors
def endpoints_status(window: str, as_json: bool) -> None:
    """Each endpoint's state, circuit breaker, recent success rate, latency and backlog."""
    with database() as (_, db), db.engine.connect() as conn:
        stats = collect_stats(conn, now=SystemClock().now(), window=parse_duration(window))
    if as_json:
        echo_json([item.as_json() for item in stats.endpoints])
        return
    print_table(_health_rows(stats), _HEALTH_HEADERS)


_HEALTH_HEADERS = [
    "ENDPOINT", "STATE", "BREAKER", "ATTEMPTS", "SUCCESS", "P50", "P99", "PENDING", "DEAD",
]  # fmt: skip


def _breaker_cell(breaker: Breaker) -> str:
    """The state first (what a grep or an eye looks for), then when it changes next."""
    text = breaker.state
    if breaker.state == "open":
        text += f" (since {_clock_time(breaker.opened_at)}, probe in "
        text += f"{_span(breaker.cooldown_remaining_seconds)})"
    elif breaker.state == "half_open":
        text += f" (probe out until {_clock_time(breaker.probe_until)})"
    if breaker.paused:
        text += f", paused by 429 until {_clock_time(breaker.paused_until)}"
    return text


def _clock_time(at: dt.datetime | None) -> str:
    return "-" if at is None else at.astimezone(dt.UTC).strftime("%H:%M:%SZ")


def _health_rows(stats: Stats) -> list[list[object]]:
    return [
        [
            e.uid,
            "enabled"
            if e.enabled
            else ("auto-disabled" if e.auto_disabled else "disabled") + f" ({e.disabled_reason})",
            _breaker_cell(e.breaker),
            e.attempts,
            _pct(e.success_rate),
            "-" if e.p50_ms is None else f"{e.p50_ms:.0f}ms",
            "-" if e.p99_ms is None else f"{e.p99_ms:.0f}ms",
            e.pending,
            e.dead,
        ]
        for e in stats.endpoints
    ]


def _print_stats(stats: Stats) -> None:
    counts = "  ".join(f"{state} {n}" for state, n in stats.counts_by_state.items())
    click.echo(f"at {stats.at.isoformat()}  window {_span(stats.window_seconds)}")
    click.echo(f"deliveries:  {counts}")
    click.echo(
        f"due now:     {stats.due_now}, oldest waiting {_span(stats.oldest_due_age_seconds)}"
    )
    click.echo(
        f"relay:       {stats.unrelayed_events} unrelayed, lag {_span(stats.relay_lag_seconds)}"
    )
    rates = "  ".join(f"{k} {v:g}" for k, v in stats.per_minute.items())
    click.echo(f"per minute:  {rates}")
    breakers = "  ".join(f"{state} {n}" for state, n in stats.breaker_counts.items())
    click.echo(f"breakers:    {breakers}")
    if stats.endpoints:
        click.echo("")
        print_table(_health_rows(stats), _HEALTH_HEADERS)
    if stats.top_errors:
        click.echo("\nmost repeated errors:")
        print_table(
            [
                [e.deliveries, e.attempts, e.endpoints, _short(e.error, 70)]
                for e in stats.top_errors
            ],
            ["DELIVERIES", "ATTEMPTS", "ENDPOINTS", "ERROR"],
        )
    firing = stats.firing
    click.echo("\nalerts: " + ("none firing" if not firing else f"{len(firing)} FIRING"))
    for alert in firing:
        click.echo(f"  ! {alert.name}: {alert.message}")


@main.command()
@click.option("--window", default=None, help="How far back rates look (default 1h).")
@click.option("--watch", is_flag=True, help="Refresh until Ctrl-C.")
@click.option("--interval", default=5.0, show_default=True, help="Seconds between refreshes.")
@click.option("--times", type=int, default=None, hidden=True, help="Stop after N refreshes.")
@json_option
@friendly_errors
def stats(
    window: str | None, watch: bool, interval: float, times: int | None, as_json: bool
) -> None:
    """Backlog, relay lag, rates, per-endpoint health, top errors and alert signals."""
    with database() as (current, db):
        span = (
            parse_duration(window) if window else dt.timedelta(seconds=current.stats_window_seconds)
        )
        thresholds = app.alert_thresholds(current)
        shown = 0
        while True:
            with db.engine.connect() as conn:
                snapshot = collect_stats(
                    conn, now=SystemClock().now(), window=span, thresholds=thresholds
                )
            if as_json:
                click.echo(json.dumps(snapshot.as_json(), default=str))
            else:
                if watch:
                    click.clear()
                _print_stats(snapshot)
            shown += 1
            if not watch or (times is not None and shown >= times):
                return
            try:
                time.sleep(interval)
            except KeyboardInterrupt:
                return


@main.command()
@click.option("--actor", default=None, help="Only this actor (cli:alice, token:grafana, ...).")
@click.option("--action", default=None, help="An action or prefix: delivery, endpoint.update.")
@click.option("--target", default=None, help="Only this target id.")
@click.option("--since", default=None, help="ISO time or age (2h).")
@click.option("--limit", default=50, show_default=True)
@click.option("--before", type=int, default=None, help="Next page: ids below this one.")
@json_option
@friendly_errors
def audit(
    actor: str | None,
    action: str | None,
    target: str | None,
    since: str | None,
    limit: int,
    before: int | None,
    as_json: bool,
) -> None:
    """The audit log, newest first: who did what to which row, when and why."""
    with database() as (_, db), db.engine.connect() as conn:
        entries = operations.list_audit(
            conn,
            actor=actor,
            action=action,
            target_id=target,
            since=parse_when(since, SystemClock().now()),
            before_id=before,
            limit=limit,
        )
    if as_json:
        echo_json([entry.as_json() for entry in entries])
        return
    if not entries:
        click.echo("no audit entries match")
        return
    print_table(
        [
            [
                e.id,
                e.at.isoformat(timespec="seconds"),
                e.actor,
                e.action,
                f"{e.target_type}:{e.target_id}",
                _short(e.reason, 40),
                e.request_id or "-",
            ]
            for e in entries
        ],
        ["ID", "AT", "ACTOR", "ACTION", "TARGET", "REASON", "REQUEST"],
    )


def _admin_runner(
    current: Settings, db: app.Database, box: SecretBox, port: int | None = None
) -> Callable[[asyncio.Event], Coroutine[Any, Any, None]]:
    host, chosen = current.admin_host, current.admin_port if port is None else port

    async def run_admin(stop: asyncio.Event) -> None:
        engine = make_async_engine(db.url, pool_size=2, max_overflow=4)
        try:
            await admin.serve(
                admin.create_app(engine, box, config=app.admin_config(current)),
                host=host,
                port=chosen,
                stop=stop,
                on_started=lambda bound: click.echo(
                    f"admin API on http://{host}:{bound} (OpenAPI at /openapi.json)", err=True
                ),
            )
        finally:
            await engine.dispose()

    return run_admin


async def _run_all_until_signalled(
    runners: Sequence[Callable[[asyncio.Event], Coroutine[Any, Any, None]]],
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        async with asyncio.TaskGroup() as group:
            for runner in runners:
                group.create_task(runner(stop))
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


@main.command()
@click.option("--port", type=int, default=None, help="Default OUTBOX_ADMIN_PORT (8181).")
@friendly_errors
def serve(port: int | None) -> None:
    """Serve only the admin HTTP API (OUTBOX_ADMIN_HOST, default 127.0.0.1)."""
    with database() as (current, db):
        box = app.secret_box(current, db)
        asyncio.run(_run_all_until_signalled([_admin_runner(current, db, box, port)]))


@main.group()
def tokens() -> None:
    """Bearer tokens for the admin HTTP API (roles: viewer, operator)."""


@tokens.command("create")
@click.argument("name")
@click.option("--role", type=click.Choice(list(ROLES)), required=True)
@click.option("--actor", default=None, help="Who is acting, for the audit log.")
@json_option
@friendly_errors
def tokens_create(name: str, role: str, actor: str | None, as_json: bool) -> None:
    """Create a token; it is printed once and stored only as a hash."""
    with database() as (_, db), db.engine.begin() as conn:
        info, secret = create_token(conn, name=name, role=role, actor=actor or default_actor())
    if as_json:
        echo_json({**info.as_json(), "token": secret})
    else:
        click.echo(f"token: {secret}")
        click.echo(f"role {info.role}; store it now, it is not shown again")


@tokens.command("list")
@click.option("--all", "include_revoked", is_flag=True, help="Include revoked tokens.")
@json_option
@friendly_errors
def tokens_list(include_revoked: bool, as_json: bool) -> None:
    """List tokens (never their secrets)."""
    with database() as (_, db), db.engine.connect() as conn:
        items = list_tokens(conn, include_revoked=include_revoked)
    if as_json:
        echo_json([item.as_json() for item in items])
        return
    print_table(
        [
            [
                t.name,
                t.role,
                t.token_id,
                t.created_by,
                t.last_used_at.isoformat(timespec="seconds") if t.last_used_at else "never",
                "revoked" if t.revoked_at else "active",
            ]
            for t in items
        ],
        ["NAME", "ROLE", "TOKEN ID", "CREATED BY", "LAST USED", "STATE"],
    )


@tokens.command("revoke")
@click.argument("name")
@click.option("--actor", default=None, help="Who is acting, for the audit log.")
@json_option
@friendly_errors
def tokens_revoke(name: str, actor: str | None, as_json: bool) -> None:
    """Revoke a token by name or token id; it stops working at once."""
    with database() as (_, db), db.engine.begin() as conn:
        token_id = revoke_token(conn, name, actor=actor or default_actor(), now=SystemClock().now())
    if as_json:
        echo_json({"revoked": token_id})
    else:
        click.echo(f"revoked {token_id}")


# -- endpoint health and priorities (delivery/health.py, outbox/priorities.py) -----------


@endpoints.command("limits")
@click.argument("endpoint_id")
@click.option("--max-in-flight", type=int, default=None, help="Concurrent deliveries; 0: no limit.")
@click.option(
    "--max-per-second", type=float, default=None, help="Requests per second; 0: no limit."
)
@click.option(
    "--ordered/--unordered",
    default=None,
    help="Deliver events with the same ordering key one at a time, in publish order.",
)
@click.option(
    "--dead-head",
    type=click.Choice(["block", "skip"]),
    default=None,
    help="When a key's oldest delivery dies: block the key until an operator acts, or skip it.",
)
@click.option("--actor", default=None, help="Who is acting, for the audit log.")
@json_option
@friendly_errors
def endpoints_limits(
    endpoint_id: str,
    max_in_flight: int | None,
    max_per_second: float | None,
    ordered: bool | None,
    dead_head: str | None,
    actor: str | None,
    as_json: bool,
) -> None:
    """Show or change an endpoint's limits and ordering; options not given stay as they are."""
    from delivery.health import EndpointLimits, get_endpoint_limits, set_endpoint_limits

    with database() as (_, db), db.engine.begin() as conn:
        current = get_endpoint_limits(conn, endpoint_id)
        if any(value is not None for value in (max_in_flight, max_per_second, ordered, dead_head)):
            current = set_endpoint_limits(
                conn,
                endpoint_id,
                EndpointLimits(
                    max_in_flight=current.max_in_flight
                    if max_in_flight is None
                    else (max_in_flight or None),
                    max_per_second=current.max_per_second
                    if max_per_second is None
                    else (max_per_second or None),
                    ordered=current.ordered if ordered is None else ordered,
                    dead_head=current.dead_head if dead_head is None else dead_head,
                ),
                actor=actor or default_actor(),
            )
    if as_json:
        echo_json({"id": endpoint_id, **current.as_json()})
    else:
        print_table(
            [
                [
                    endpoint_id,
                    current.max_in_flight or "-",
                    f"{current.max_per_second:g}" if current.max_per_second else "-",
                    "yes" if current.ordered else "no",
                    current.dead_head,
                ]
            ],
            ["ID", "MAX IN FLIGHT", "MAX/S", "ORDERED", "DEAD HEAD"],
        )


@endpoints.command("health")
@json_option
@friendly_errors
def endpoints_health(as_json: bool) -> None:
    """Circuit breaker state, limits and backlog of every endpoint."""
    from delivery.health import endpoint_health_report

    with database() as (_, db), db.engine.connect() as conn:
        report = endpoint_health_report(conn)
    if as_json:
        echo_json(report)
        return
    rows = []
    for item in report:
        state = item["breaker_state"]
        if state == "open" and item["open_until"]:
            state += f" until {item['open_until']}"
        if not item["enabled"]:
            state = f"disabled ({item['disabled_reason']})"
        rows.append(
            [
                item["endpoint"],
                state,
                item["in_flight"],
                item["scheduled"],
                item["last_failure"] or "",
            ]
        )
    print_table(rows, ["ID", "BREAKER", "IN FLIGHT", "SCHEDULED", "LAST FAILURE"])


@main.group()
def priorities() -> None:
    """Default priorities per event type (higher is claimed first)."""


@priorities.command("set")
@click.argument("event_type")
@click.argument("priority", type=click.IntRange(-100, 100))
@click.option("--actor", default=None, help="Who is acting, for the audit log.")
@friendly_errors
def priorities_set(event_type: str, priority: int, actor: str | None) -> None:
    """Give EVENT_TYPE a default priority: outbox priorities set password.reset 50."""
    from outbox.priorities import set_event_type_priority

    with database() as (_, db), db.engine.begin() as conn:
        set_event_type_priority(conn, event_type, priority, actor=actor or default_actor())
    click.echo(f"{event_type}: {priority}")


@priorities.command("clear")
@click.argument("event_type")
@click.option("--actor", default=None, help="Who is acting, for the audit log.")
@friendly_errors
def priorities_clear(event_type: str, actor: str | None) -> None:
    """Remove EVENT_TYPE's default priority (back to 0)."""
    from outbox.priorities import clear_event_type_priority

    with database() as (_, db), db.engine.begin() as conn:
        removed = clear_event_type_priority(conn, event_type, actor=actor or default_actor())
    click.echo(f"{event_type}: {'cleared' if removed else 'had no default'}")


@priorities.command("list")
@json_option
@friendly_errors
def priorities_list(as_json: bool) -> None:
    """Event types with a default priority."""
    from outbox.priorities import list_event_type_priorities

    with database() as (_, db), db.engine.connect() as conn:
        items = list_event_type_priorities(conn)
    if as_json:
        echo_json(items)
    else:
        print_table([[name, value] for name, value in items.items()], ["EVENT TYPE", "PRIORITY"])


@endpoints.command("headers")
@click.argument("endpoint_id")
@click.option(
    "--set", "to_set", multiple=True, help="'Name: value' to send with every request (repeat)."
)
@click.option("--unset", multiple=True, help="A header name to stop sending (repeat).")
@click.option("--clear", is_flag=True, help="Remove every custom header.")
@click.option("--actor", default=None, help="Who is acting, for the audit log.")
@json_option
@friendly_errors
def endpoints_headers(
    endpoint_id: str,
    to_set: tuple[str, ...],
    unset: tuple[str, ...],
    clear: bool,
    actor: str | None,
    as_json: bool,
) -> None:
    """Show (names only) or change an endpoint's custom request headers, stored encrypted.

    The signature, body framing, host and hop-by-hop headers cannot be set.
    """
    with database() as (current, db):
        box = app.secret_box(current, db)
        with db.engine.begin() as conn:
            headers = {} if clear else get_headers(conn, box, endpoint_id)
            for name in unset:
                headers.pop(name.lower(), None)
            for item in to_set:
                name, value = parse_header_argument(item)
                headers[name.lower()] = value
            if to_set or unset or clear:
                names = set_headers(conn, box, endpoint_id, headers, actor=actor or default_actor())
            else:
                names = sorted(headers)
    if as_json:
        echo_json({"id": endpoint_id, "headers": names})
    else:
        click.echo(", ".join(names) if names else "no custom headers")
