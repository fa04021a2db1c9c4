"""The contract with partners: `outbox event-types`, `outbox events`, `outbox endpoints test`.

- `event-types add/list/show/update/deprecate/archive/export`: the catalogue of event types
  and their JSON Schemas, and the OpenAPI document generated from it;
- `events rejected/requeue`: events published through SQL whose payload broke its schema;
- `endpoints test ID`: one event through the real pipeline to one endpoint.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from delivery.operator.app import schema_limits
from delivery.operator.cli.common import (
    database,
    default_actor,
    echo_json,
    friendly_errors,
    json_option,
    print_table,
    reason_option,
    settings,
)
from outbox import catalogue
from outbox.clock import SystemClock
from outbox.errors import CatalogueError
from outbox.testevents import read_test_outcome, send_test_event


def _json_file(path: str | None, what: str, max_bytes: int | None = None) -> Any:
    if path is None:
        return None
    try:
        with Path(path).open("rb") as file:
            data = file.read(max_bytes + 1) if max_bytes is not None else file.read()
        if max_bytes is not None and len(data) > max_bytes:
            # Refused before parsing: a 5 MB schema costs no time or memory here.
            raise CatalogueError(
                f"the {what} file {path} is over the {max_bytes}-byte limit: split the event "
                "type, or raise OUTBOX_MAX_SCHEMA_BYTES"
            )
        return json.loads(data.decode("utf-8"))
    except OSError as exc:
        raise CatalogueError(f"cannot read the {what} file {path}: {exc.strerror}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CatalogueError(f"the {what} file {path} is not JSON: {exc}") from exc


def _print_type(
    item: catalogue.EventType, as_json: bool, extra: dict[str, Any] | None = None
) -> None:
    if as_json:
        echo_json({**item.as_json(), **(extra or {})})
        return
    click.echo(f"name:        {item.name}")
    click.echo(f"status:      {item.status}")
    click.echo(f"version:     {item.current_version}")
    click.echo(f"description: {item.description}")
    click.echo("schema:")
    click.echo(json.dumps(item.schema, indent=2))
    if item.example is not None:
        click.echo("example:")
        click.echo(json.dumps(item.example, indent=2))


@click.group("event-types")
def event_types() -> None:
    """The event-type catalogue: which events exist and the JSON Schema of each payload."""


@event_types.command("add")
@click.argument("name")
@click.option("--schema", "schema_file", required=True, help="A JSON Schema (Draft 2020-12) file.")
@click.option("--description", default="", help="What the event means, for partners.")
@click.option("--example", "example_file", default=None, help="An example payload (JSON file).")
@json_option
@friendly_errors
def event_types_add(
    name: str, schema_file: str, description: str, example_file: str | None, as_json: bool
) -> None:
    """Add an event type with its first schema version."""
    current = settings()
    schema = _json_file(schema_file, "schema", current.max_schema_bytes)
    example = _json_file(example_file, "example")
    with database(current=current) as (_, db), db.engine.begin() as conn:
        item = catalogue.add_event_type(
            conn,
            name,
            schema=schema,
            description=description,
            example=example,
            actor=default_actor(),
            limits=schema_limits(current),
            budget=current.validation_budget_ms / 1000,
        )
    _print_type(item, as_json)


@event_types.command("list")
@json_option
@friendly_errors
def event_types_list(as_json: bool) -> None:
    """Every event type with its status and current version."""
    with database() as (_, db), db.engine.connect() as conn:
        items = catalogue.list_event_types(conn)
    if as_json:
        echo_json([item.as_json() for item in items])
        return
    print_table(
        [[i.name, i.status, i.current_version, i.description] for i in items],
        ["NAME", "STATUS", "VERSION", "DESCRIPTION"],
    )


@event_types.command("show")
@click.argument("name")
@click.option("--version", "version", type=int, default=None, help="An older schema version.")
@json_option
@friendly_errors
def event_types_show(name: str, version: int | None, as_json: bool) -> None:
    """One event type: its current schema and example, and the versions it has had."""
    with database() as (_, db), db.engine.connect() as conn:
        item = catalogue.get_event_type(conn, name)
        versions = catalogue.list_versions(conn, name)
    if version is not None:
        chosen = [v for v in versions if v.version == version]
        if not chosen:
            raise CatalogueError(
                f"{name} has no version {version}; it has 1 to {item.current_version}"
            )
        if as_json:
            echo_json({"name": name, **chosen[0].as_json()})
        else:
            click.echo(json.dumps(chosen[0].schema, indent=2))
        return
    _print_type(item, as_json, {"versions": [v.version for v in versions]})
    if not as_json:
        click.echo(f"versions:    {', '.join(str(v.version) for v in versions)}")


@event_types.command("update")
@click.argument("name")
@click.option("--schema", "schema_file", default=None, help="A new schema version (JSON file).")
@click.option("--description", default=None, help="A new description.")
@click.option("--example", "example_file", default=None, help="A new example payload (JSON).")
@click.option("--status", type=click.Choice(["active", "deprecated", "archived"]), default=None)
@json_option
@friendly_errors
def event_types_update(
    name: str,
    schema_file: str | None,
    description: str | None,
    example_file: str | None,
    status: str | None,
    as_json: bool,
) -> None:
    """A new schema version (older versions stay readable), description, example or status."""
    current = settings()
    schema = _json_file(schema_file, "schema", current.max_schema_bytes)
    example = _json_file(example_file, "example")
    with database(current=current) as (_, db), db.engine.begin() as conn:
        item = catalogue.update_event_type(
            conn,
            name,
            schema=schema,
            description=description,
            example=example,
            status=status,
            actor=default_actor(),
            limits=schema_limits(current),
            budget=current.validation_budget_ms / 1000,
        )
    _print_type(item, as_json)


def _status_command(status: str, doc: str) -> click.Command:
    @click.argument("name")
    @json_option
    @friendly_errors
    def command(name: str, as_json: bool) -> None:
        with database() as (_, db), db.engine.begin() as conn:
            item = catalogue.set_status(conn, name, status, actor=default_actor())
        if as_json:
            echo_json(item.as_json())
        else:
            click.echo(f"{item.name} is {item.status}")

    command.__doc__ = doc
    return click.command({"deprecated": "deprecate", "archived": "archive"}[status])(command)


event_types.add_command(
    _status_command(
        "deprecated", "Mark a type deprecated: still published, flagged in the OpenAPI document."
    )
)
event_types.add_command(
    _status_command("archived", "Archive a type: publishing it is refused from now on.")
)


@event_types.command("export")
@click.option(
    "--format", "fmt", type=click.Choice(["openapi"]), default="openapi", show_default=True
)
@click.option("--output", default=None, help="Write to this file instead of standard output.")
@click.option("--title", default="Webhooks", show_default=True, help="The document's title.")
@click.option("--api-version", default="1.0.0", show_default=True, help="info.version.")
@click.option(
    "--without-operational",
    is_flag=True,
    help="Leave out the service's own operational events (endpoint.disabled, ...).",
)
@friendly_errors
def event_types_export(
    fmt: str, output: str | None, title: str, api_version: str, without_operational: bool
) -> None:
    """An OpenAPI 3.1 document describing every event type as a webhook, for partners."""
    with database() as (_, db), db.engine.connect() as conn:
        document = catalogue.openapi_document(
            conn, title=title, version=api_version, include_operational=not without_operational
        )
    text = json.dumps(document, indent=2) + "\n"
    if output is None:
        click.echo(text, nl=False)
    else:
        Path(output).write_text(text, encoding="utf-8")
        click.echo(f"wrote {len(document['webhooks'])} event types to {output}", err=True)


@click.group("events")
def events() -> None:
    """Events the relay refused to send because their payload broke their schema."""


@events.command("rejected")
@click.option("--limit", default=100, show_default=True)
@json_option
@friendly_errors
def events_rejected(limit: int, as_json: bool) -> None:
    """Rejected events, newest first, with the reason (JSON path and rule)."""
    with database() as (_, db), db.engine.connect() as conn:
        items = catalogue.list_rejected(conn, limit=limit)
    if as_json:
        echo_json([item.as_json() for item in items])
        return
    print_table(
        [
            [i.message_id, i.tenant, i.event_type, i.rejected_at.isoformat(), i.reason]
            for i in items
        ],
        ["MESSAGE", "TENANT", "TYPE", "REJECTED", "REASON"],
    )


@events.command("requeue")
@click.argument("message_id")
@reason_option
@click.option(
    "--skip-validation",
    is_flag=True,
    help="Send it without checking the schema again (default: check against the current one).",
)
@friendly_errors
def events_requeue(message_id: str, reason: str, skip_validation: bool) -> None:
    """Give a rejected event back to the relay (after fixing its type's schema, say)."""
    with database() as (_, db), db.engine.begin() as conn:
        catalogue.requeue_rejected(
            conn,
            message_id,
            skip_validation=skip_validation,
            actor=default_actor(),
            reason=reason,
        )
    click.echo(f"{message_id} is back in the queue" + (" (unchecked)" if skip_validation else ""))


@click.command("test")
@click.argument("endpoint_id")
@click.option(
    "--event-type", default=None, help="Send this catalogued type's example (default: a ping)."
)
@click.option(
    "--wait",
    default=30.0,
    show_default=True,
    help="Seconds to wait for the outcome (the `outbox run` service sends it); 0: just queue.",
)
@json_option
@friendly_errors
def endpoints_test(endpoint_id: str, event_type: str | None, wait: float, as_json: bool) -> None:
    """Send a test event to one endpoint through the real pipeline and print the outcome."""
    with database() as (_, db):
        with db.engine.begin() as conn:
            sent = send_test_event(
                conn,
                endpoint_id,
                event_type=event_type,
                now=SystemClock().now(),
                actor=default_actor(),
            )
        deadline = time.monotonic() + wait
        while True:
            with db.engine.connect() as conn:
                outcome = read_test_outcome(conn, sent.delivery_id)
            if outcome.finished or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
    if as_json:
        echo_json({**sent.as_json(), "outcome": outcome.as_json()})
    elif not outcome.finished:
        click.echo(
            f"queued {sent.event_type} as delivery {sent.delivery_id}; no worker sent it "
            f"within {wait:g}s (is `outbox run` running?); `outbox deliveries show "
            f"{sent.delivery_id}` shows the outcome later"
        )
    else:
        status = outcome.status_code if outcome.status_code is not None else "no answer"
        verdict = "succeeded" if outcome.succeeded else "failed"
        detail = "" if outcome.succeeded or not outcome.error else f": {outcome.error}"
        click.echo(
            f"{sent.event_type} to {endpoint_id} {verdict} (HTTP {status}, "
            f"{outcome.duration_ms} ms){detail}; delivery {sent.delivery_id}"
        )
    if outcome.finished and not outcome.succeeded:
        raise SystemExit(1)
