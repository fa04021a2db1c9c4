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

from delivery.operator import api, app
from delivery.operator.cli.common import database, friendly_errors, rearm_terminate, settings
from delivery.operator.loop import run_loop
from delivery.operator.supervisor import default_processes
from outbox import migrate as migrations
from outbox.crypto import SecretBox
from outbox.db import make_async_engine
from outbox.errors import ConfigurationError
from outbox.logging_setup import configure_logging
from outbox.settings import Settings


@click.command()
@friendly_errors
def migrate() -> None:
    """Create or upgrade the outbox tables (safe to run again)."""
    with database(auto_migrate=True):
        click.echo(f"schema is at revision {migrations.head_revision()}")


@click.command()
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
            http_proxy=app.http_proxy_setting(current),
            summary_interval=current.log_summary_interval,
        )
        click.echo("outbox running; Ctrl-C (SIGINT) or SIGTERM stops it cleanly", err=True)
        try:
            if admin_socket is not None:
                runner = _admin_runner(current, db, box, sock=admin_socket)
                run_loop(_run_all_until_signalled([service.run, runner]), current.event_loop)
            else:
                run_loop(_run_until_signalled(service), current.event_loop)
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
        engine = make_async_engine(db.url, pool_size=2, max_overflow=4)
        try:
            await api.serve(
                api.create_app(engine, box, config=app.admin_config(current)),
                host=host,
                port=chosen,
                stop=stop,
                sock=sock,
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


@click.command()
@click.option("--port", type=int, default=None, help="Default OUTBOX_ADMIN_PORT (8181).")
@friendly_errors
def serve(port: int | None) -> None:
    """Serve only the admin HTTP API (OUTBOX_ADMIN_HOST, default 127.0.0.1)."""
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
