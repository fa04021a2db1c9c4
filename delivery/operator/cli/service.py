"""Running the service: `migrate`, `run`, `serve` and `demo`.

`run` starts the relay, workers and reaper under the supervisor, one process per core
unless `--processes N` says otherwise (in one process, without the supervisor, when
N is 1); `serve` runs the admin API alone.

Start-up checks everything that can be wrong before saying "outbox running", in the
order that costs least: settings, then the admin port (bound now, served later, so
a busy port is one line and nothing was started), then the database (reachable,
schema current, secret keys cover the stored secrets). Any failure is one line and
exit status 1; whatever was started by then (the embedded server) is stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any

import click

from delivery.operator import app
from delivery.operator.cli.common import (
    admin_base_url,
    database,
    echo_json,
    friendly_errors,
    json_option,
    parse_duration,
    rearm_terminate,
    settings,
)
from delivery.operator.loop import run_loop, settle_heap
from delivery.operator.supervisor import default_processes, run_until_signalled
from outbox import migrate as migrations
from outbox.crypto import SecretBox
from outbox.db import make_async_engine
from outbox.errors import ConfigurationError
from outbox.logging_setup import configure_logging
from outbox.settings import Settings


@click.command()
@click.option(
    "--sql",
    "as_sql",
    is_flag=True,
    help="Print the SQL that would run (this database's pending migrations), change nothing.",
)
@click.option(
    "--check",
    is_flag=True,
    help="Print the schema revision and the one this release needs; exit 1 if migrations "
    "are pending. Changes nothing (for deploy scripts and readiness probes).",
)
@click.option(
    "--from",
    "start",
    default=None,
    metavar="REVISION",
    help="With --sql: start from this revision ('base': an empty database) instead of "
    "the database's own; no database is needed then.",
)
@click.option(
    "--to",
    "target",
    default=None,
    metavar="REVISION",
    help="Upgrade or downgrade to this revision instead of this release's head (a rollback "
    "to the previous release: its revision, see `outbox --version` there).",
)
@click.option(
    "--lock-timeout",
    default="2s",
    show_default=True,
    help="How long one DDL statement may wait for a lock before the migration backs off.",
)
@click.option(
    "--lock-retries",
    type=click.IntRange(min=0, max=100),
    default=8,
    show_default=True,
    help="Retries of a migration that could not get its lock (backoff 0.5s doubling to 15s).",
)
@json_option
@friendly_errors
def migrate(
    as_sql: bool,
    check: bool,
    start: str | None,
    target: str | None,
    lock_timeout: str,
    lock_retries: int,
    as_json: bool,
) -> None:
    """Create or upgrade the outbox tables online (safe to run again, and while running).

    Each migration runs in its own transaction, every DDL statement waits at most
    --lock-timeout for its lock and a migration that cannot get it is retried with
    backoff; indexes are built CONCURRENTLY. Each step is printed with its duration.
    """
    if as_sql and check:
        raise click.UsageError("--sql and --check are two different questions: pick one")
    if start is not None and not as_sql:
        raise click.UsageError("--from only goes with --sql")
    if target is not None and (as_sql or check):
        raise click.UsageError("--to goes with a plain `outbox migrate`, not --sql or --check")
    if target is not None:
        migrations.require_known_revision(target)
    seconds = parse_duration(lock_timeout).total_seconds()
    if not 0 < seconds <= 600:
        raise click.BadParameter(
            f"{lock_timeout!r}: give a lock timeout above 0 and at most 10m (a few seconds "
            "is usual: writers queue behind a DDL statement while it waits)",
            param_hint="--lock-timeout",
        )
    policy = migrations.LockPolicy(lock_timeout=seconds, retries=lock_retries)
    if as_sql and start is not None:
        click.echo(migrations.offline_sql(None if start == "base" else start, policy=policy))
        return
    with database(auto_migrate=False, check_schema=False) as (_, db):
        state = migrations.schema_state(migrations.current_revision(db.engine))
        if as_sql:
            _print_pending_sql(state, policy)
        elif check:
            _report_schema(state, as_json)
        else:
            _upgrade(db, state, policy, as_json, target)


def _print_pending_sql(state: migrations.SchemaState, policy: migrations.LockPolicy) -> None:
    if not state.pending:
        click.echo(
            f"-- schema is at {state.current}; this release needs {state.needed}: nothing to run"
        )
        return
    click.echo(migrations.offline_sql(state.current, policy=policy))


def _report_schema(state: migrations.SchemaState, as_json: bool) -> None:
    """What a deploy script needs: where the schema is, what this release needs, exit 1
    while anything is pending."""
    version = migrations.release_version()
    if as_json:
        echo_json(
            {
                "schema": state.current,
                "needs": state.needed,
                "release": version,
                "state": state.state,
                "pending": list(state.pending),
            }
        )
    else:
        click.echo(f"schema:  {state.current or 'none (empty database)'}")
        click.echo(f"needs:   {state.needed} (webhook-outbox {version})")
        if state.state == "pending":
            click.echo(f"pending: {', '.join(state.pending)}: run `outbox migrate`")
        elif state.state == "newer":
            click.echo("state:   newer than this release (a later release migrated it); usable")
        else:
            click.echo("state:   up to date")
    if state.state == "pending":
        sys.exit(1)


def _upgrade(
    db: app.Database,
    state: migrations.SchemaState,
    policy: migrations.LockPolicy,
    as_json: bool,
    target: str | None = None,
) -> None:
    if state.state == "newer":
        click.echo(
            f"schema is at {state.current}, newer than this release's {state.needed}: nothing to do"
        )
        return

    def on_step(step: migrations.Step) -> None:
        if not as_json:
            retried = f" after {step.attempts - 1} lock timeouts" if step.attempts > 1 else ""
            undone = "undone " if step.direction == "downgrade" else ""
            click.echo(f"{step.revision}  {step.seconds:7.2f}s{retried}  {undone}{step.title}")

    def on_wait(wait: migrations.LockWait) -> None:
        what = "waiting" if wait.revision == "-" else f"{wait.revision}  could not get a lock:"
        click.echo(f"{what} {wait.error}; trying again in {wait.delay:g}s", err=True)

    target = target or migrations.head_revision()
    backwards = target != state.current and target not in state.pending
    run = migrations.downgrade if backwards else migrations.upgrade
    steps = run(db.engine, target, policy=policy, on_step=on_step, on_wait=on_wait)
    if as_json:
        echo_json(
            {
                "schema": target,
                "steps": [
                    {
                        "revision": s.revision,
                        "title": s.title,
                        "seconds": round(s.seconds, 3),
                        "attempts": s.attempts,
                    }
                    for s in steps
                ],
            }
        )
    else:
        click.echo(f"schema is at revision {target}")


@click.command()
@click.option(
    "--admin",
    is_flag=True,
    help="Also serve the admin HTTP API, console and portal (OUTBOX_ADMIN_HOST/PORT).",
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
    current = settings()
    configure_logging(current.log_level, fmt=current.log_format)
    with contextlib.ExitStack() as stack:
        admin_socket = (
            stack.enter_context(bind_admin(current.admin_host, current.admin_port))
            if admin
            else None
        )
        current, db = stack.enter_context(database(current=current))
        if processes > 1:
            from delivery.operator.supervisor import ProcessSpec, run_supervised

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
                http_proxy=app.http_proxy_setting(current),
                log_level=current.log_level,
                log_format=current.log_format,
                summary_interval=current.log_summary_interval,
                event_loop=current.event_loop,
            )
            app.secret_box(current, db)  # refuse to start children that could not sign
            status = run_supervised(
                spec,
                processes,
                grace=spec.worker.shutdown_grace + 5,
                on_ready=lambda: click.echo(
                    f"outbox running {processes} processes; Ctrl-C (SIGINT) or SIGTERM stops them",
                    err=True,
                ),
            )
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
            http_proxy=app.http_proxy_setting(current),
            summary_interval=current.log_summary_interval,
        )

        # Said once the signals are handled: a SIGTERM right after it stops cleanly.
        def running() -> None:
            click.echo("outbox running; Ctrl-C (SIGINT) or SIGTERM stops it cleanly", err=True)

        try:
            runners = (
                [] if admin_socket is None else [_admin_runner(current, db, box, sock=admin_socket)]
            )
            settle_heap()
            run_loop(run_until_signalled(service, runners, on_ready=running), current.event_loop)
        finally:
            rearm_terminate()  # the loop reset SIGTERM; the embedded server still has to stop
        click.echo("outbox stopped", err=True)


@contextlib.contextmanager
def bind_admin(host: str, port: int) -> Iterator[socket.socket]:
    """Bind the admin API's port now, so a busy port stops start-up before anything runs."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family)
    except OSError as exc:
        raise ConfigurationError(
            f"the admin API cannot listen on {host}:{port} ({exc.strerror or exc}): stop what "
            "holds the port, or set OUTBOX_ADMIN_PORT (and OUTBOX_ADMIN_HOST) to a free one"
        ) from exc
    with sock:
        yield sock


@click.command()
@friendly_errors
def demo() -> None:
    """A 30-second tour: embedded PostgreSQL, a local receiver, a healthy and a failing partner."""
    from delivery.operator.demo import run_demo

    sys.exit(asyncio.run(run_demo(settings())))


def _admin_runner(
    current: Settings,
    db: app.Database,
    box: SecretBox,
    port: int | None = None,
    *,
    sock: socket.socket | None = None,
) -> Callable[[asyncio.Event], Coroutine[Any, Any, None]]:
    host, chosen = current.admin_host, current.admin_port if port is None else port

    async def run_admin(stop: asyncio.Event) -> None:
        from delivery.operator import api  # the web stack: only serving imports it

        engine = make_async_engine(db.url, pool_size=2, max_overflow=4)
        try:
            await api.serve(
                api.create_app(engine, box, config=app.admin_config(current)),
                host=host,
                port=chosen,
                stop=stop,
                sock=sock,
                on_started=lambda bound: click.echo(
                    f"admin API on {admin_base_url(host, bound)} (OpenAPI at /openapi.json); "
                    f"console at {admin_base_url(host, bound)}/console, tenant portal at "
                    f"{admin_base_url(host, bound)}/portal (`outbox portal link TENANT`)",
                    err=True,
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


@click.command()
@click.option("--port", type=int, default=None, help="Default OUTBOX_ADMIN_PORT (8181).")
@friendly_errors
def serve(port: int | None) -> None:
    """Serve the admin HTTP API, the web console (/console) and the tenant portal (/portal).

    On OUTBOX_ADMIN_HOST (default 127.0.0.1) and --port; deliveries are `outbox run`'s.
    """
    current = settings()
    configure_logging(current.log_level, fmt=current.log_format)
    chosen = current.admin_port if port is None else port
    with (
        bind_admin(current.admin_host, chosen) as sock,
        database(current=current) as (current, db),
    ):
        box = app.secret_box(current, db)
        try:
            runner = _admin_runner(current, db, box, chosen, sock=sock)
            asyncio.run(_run_all_until_signalled([runner]))
        finally:
            rearm_terminate()
