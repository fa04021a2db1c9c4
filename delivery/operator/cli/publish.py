"""`outbox publish`: put one event in the outbox."""

from __future__ import annotations

import json

import click

from delivery.operator.cli.common import database, echo_json, friendly_errors, json_option
from outbox.publish import publish as publish_event


@click.command()
@click.argument("event_type")
@click.argument("payload")
@click.option(
    "--idempotency-key",
    default=None,
    help="The same key with the same input again is a no-op; with other input, refused.",
)
@click.option("--ordering-key", default=None, help="Events with one key are delivered in order.")
@click.option(
    "--subject", default=None, help="The document it is about (invoice/inv_7): status by subject."
)
@click.option(
    "--priority",
    type=int,
    default=None,
    help="-100..100, higher first; default: the event type's (outbox priorities).",
)
@click.option(
    "--tenant",
    default=None,
    help="The tenant (customer id) whose endpoints get it; default: the default tenant. "
    "An unknown one is refused (`outbox tenants list`).",
)
@json_option
@friendly_errors
def publish(
    event_type: str,
    payload: str,
    idempotency_key: str | None,
    ordering_key: str | None,
    subject: str | None,
    priority: int | None,
    tenant: str | None,
    as_json: bool,
) -> None:
    """Publish an event: outbox publish order.created '{"id": 42}'."""
    try:
        data = json.loads(payload)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not valid JSON: {exc}", param_hint="PAYLOAD") from exc
    except RecursionError as exc:
        raise click.BadParameter("nests too deeply: flatten it", param_hint="PAYLOAD") from exc
    from outbox.schema import DEFAULT_TENANT

    tenant = DEFAULT_TENANT if tenant is None else tenant
    with database() as (current, db), db.engine.begin() as conn:
        message_id = publish_event(
            conn,
            event_type,
            data,
            idempotency_key=idempotency_key,
            ordering_key=ordering_key,
            priority=priority,
            tenant=tenant,
            max_payload_bytes=current.max_payload_bytes,
            strict=current.event_types == "strict",  # the settings file counts here too
            max_payload_depth=current.max_payload_depth,
            subject=subject,
        )
    if as_json:
        echo_json({"message_id": message_id, "event_type": event_type, "tenant": tenant})
    else:
        click.echo(message_id)
