"""`outbox priorities`: default priorities per event type."""

from __future__ import annotations

import click

from delivery.operator.cli.common import (
    actor_option,
    database,
    default_actor,
    echo_json,
    friendly_errors,
    json_option,
    print_table,
)


@click.group()
def priorities() -> None:
    """Default priorities per event type (higher is claimed first)."""


@priorities.command("set")
@click.argument("event_type")
@click.argument("priority", type=click.IntRange(-100, 100))
@actor_option
@friendly_errors
def priorities_set(event_type: str, priority: int, actor: str | None) -> None:
    """Give EVENT_TYPE a default priority: outbox priorities set password.reset 50."""
    from outbox.priorities import set_event_type_priority

    with database() as (_, db), db.engine.begin() as conn:
        set_event_type_priority(conn, event_type, priority, actor=actor or default_actor())
    click.echo(f"{event_type}: {priority}")


@priorities.command("clear")
@click.argument("event_type")
@actor_option
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
