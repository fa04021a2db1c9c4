"""`outbox db`: the database the outbox uses, for application code and for psql.

`outbox db url` prints what `outbox.database_url()` returns in application code:
OUTBOX_DATABASE_URL, or the URL of the embedded server, which it starts (and
migrates) if it is not running and keeps running, whichever commands come and go,
until `outbox db stop`: the process it printed the URL for may connect at any time.
"""

from __future__ import annotations

import click

from delivery.operator.cli.common import friendly_errors, settings
from outbox import migrate as migrations
from outbox.db import libpq_url, make_engine, sqlalchemy_url
from outbox.embedded import EmbeddedPostgres
from outbox.errors import OutboxError


@click.group()
def db() -> None:
    """The outbox's database: its URL for application code, the embedded server."""


@db.command("url")
@click.option(
    "--libpq",
    is_flag=True,
    help="Print the plain postgresql:// form (for psql).",
)
@friendly_errors
def url(libpq: bool) -> None:
    """Print the database URL (the same as `outbox.database_url()` in Python).

    With OUTBOX_DATABASE_URL unset this starts the embedded server if needed, migrates
    it, and keeps it running until `outbox db stop` (other `outbox` commands leave it up).
    """
    current = settings()
    if current.database_url:
        found = current.database_url
    else:
        server = EmbeddedPostgres(current.data_dir)
        found = server.start()
        engine = make_engine(found)
        try:
            migrations.upgrade(engine)
            server.keep_running()
        finally:
            engine.dispose()
            server.detach()
        click.echo(
            f"embedded PostgreSQL running in {server.pgdata} until `outbox db stop`", err=True
        )
    click.echo(libpq_url(found) if libpq else sqlalchemy_url(found))


@db.command("stop")
@click.option("--force", is_flag=True, help="Stop it even with connections open (they are closed).")
@friendly_errors
def stop(force: bool) -> None:
    """Stop the embedded server, unless a running process or an open connection uses it."""
    current = settings()
    if current.database_url:
        raise OutboxError("OUTBOX_DATABASE_URL is set: that server is yours to stop, not outbox's")
    server = EmbeddedPostgres(current.data_dir)
    if not server.running():
        click.echo(f"the embedded PostgreSQL in {server.pgdata} is not running")
        return
    users = server.holders()
    if users:
        raise OutboxError(
            f"the embedded PostgreSQL is in use by process {', '.join(map(str, users))}; "
            "stop those first (it then stops by itself)"
        )
    server.start()
    clients = server.other_connections()
    if clients and not force:
        server.detach()
        who = ", ".join(f"{pid} ({name})" if name else str(pid) for pid, name in clients)
        raise OutboxError(
            f"the embedded PostgreSQL has {len(clients)} open "
            f"{'connection' if len(clients) == 1 else 'connections'} (server process {who}): "
            "close them first (stop the application using it), or --force closes them"
        )
    server.release()  # what `outbox db url` kept running
    server.stop()
    click.echo(f"stopped the embedded PostgreSQL in {server.pgdata}")
