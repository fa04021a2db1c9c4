"""The `outbox` command: the one composition root of the project.

Every command that prints data takes `--json`. Errors the user can fix are printed
as one clear line (exit status 1), never as a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import getpass
import json
import logging
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import click

from delivery import app
from delivery.reaper import ReaperConfig
from outbox import migrate as migrations
from outbox.crypto import generate_key
from outbox.endpoints import Endpoint, create_endpoint, list_endpoints, set_enabled
from outbox.errors import OutboxError
from outbox.publish import publish as publish_event
from outbox.settings import Settings, load_settings

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
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


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
@json_option
@friendly_errors
def publish(
    event_type: str,
    payload: str,
    idempotency_key: str | None,
    ordering_key: str | None,
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
            created = create_endpoint(
                conn, box, url=url, event_types=events, secret=secret, description=description
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


def _set_enabled(uid: str, enabled: bool, reason: str | None, actor: str, as_json: bool) -> None:
    with database() as (_, db), db.engine.begin() as conn:
        item = set_enabled(conn, uid, enabled=enabled, reason=reason, actor=actor)
    if as_json:
        echo_json(item.as_json())
    else:
        print_table(_endpoint_rows([item]), ["ID", "STATE", "EVENTS", "URL"])


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


@main.command()
@click.option(
    "--processes",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    envvar="OUTBOX_PROCESSES",
    help="Service processes on this host (one per core is a good start); env OUTBOX_PROCESSES.",
)
@friendly_errors
def run(processes: int) -> None:
    """Run the relay, the delivery workers and the reaper until SIGINT or SIGTERM."""
    with database() as (current, db):
        if processes > 1:
            from delivery.supervisor import ProcessSpec, run_supervised

            spec = ProcessSpec(
                url=db.url,
                secret_keys=app.secret_keys_setting(current, db),
                relay=app.relay_config(current),
                worker=app.worker_config(current),
                reaper=ReaperConfig(),
                http_transport=current.http_transport,
                log_level=current.log_level,
            )
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
            http_transport=current.http_transport,
        )
        click.echo("outbox running; Ctrl-C (SIGINT) or SIGTERM stops it cleanly", err=True)
        asyncio.run(_run_until_signalled(service))
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
