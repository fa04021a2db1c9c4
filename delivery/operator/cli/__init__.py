"""The `outbox` command: the operator's composition root, one module per command group.

Every command that prints data takes `--json`. Errors the user can fix are printed
as one clear line (exit status 1), never as a traceback. Shared helpers live in
`common.py`; a new command group is a new module here plus one line below.
"""

from __future__ import annotations

import click

from delivery.operator.cli import (
    contract,
    db,
    deliveries,
    endpoints,
    keys,
    owners,
    portal,
    priorities,
    publish,
    service,
    stats,
    tenants,
    tokens,
)
from outbox.logging_setup import configure_logging


def _print_version(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    """The release and the schema revision it needs (read only when asked: it parses the
    migrations)."""
    if not value or ctx.resilient_parsing:
        return
    from outbox.migrate import head_revision, release_version

    click.echo(f"outbox {release_version()} (schema {head_revision()})")
    ctx.exit()


@click.group()
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Show the version and the schema revision it needs, and exit.",
)
def main() -> None:
    """Reliable webhooks from a transactional outbox in PostgreSQL.

    With OUTBOX_DATABASE_URL unset, commands use an embedded PostgreSQL kept in
    OUTBOX_DATA_DIR (default ~/.local/share/webhook-outbox).
    """
    configure_logging("WARNING")


for command in (
    service.migrate,
    service.run,
    service.serve,
    service.demo,
    publish.publish,
    endpoints.endpoints,
    deliveries.deliveries,
    deliveries.replay,
    deliveries.discard,
    keys.keys,
    tenants.tenants,
    tokens.tokens,
    portal.portal,
    stats.stats,
    stats.audit,
    priorities.priorities,
    contract.event_types,
    contract.events,
    db.db,
):
    main.add_command(command)
endpoints.endpoints.add_command(contract.endpoints_test)
endpoints.endpoints.add_command(owners.endpoints_set)
contract.event_types.add_command(owners.event_types_set)

__all__ = ["main"]
