"""Who owns failures and what an ambiguous outcome does: `endpoints set` and
`event-types set` (on_ambiguous, owner, operational owner, per-type alert thresholds)."""

from __future__ import annotations

from typing import Any

import click

from delivery.operator.cli.common import (
    actor_option,
    database,
    default_actor,
    echo_json,
    friendly_errors,
    json_option,
    parse_duration,
)
from delivery.operator.validation import text_option
from outbox import endpoints as endpoint_ops
from outbox import workflows
from outbox.owners import check_owner

ON_AMBIGUOUS = click.Choice(["retry", "hold"])
OFF_HELP = f"('{workflows.CLEAR}' clears it)"


def _owner(value: str | None) -> str | None:
    """None: leave it; '' (from 'off'): clear it; else a checked team name."""
    if value is None:
        return None
    if value == workflows.CLEAR:
        return ""
    return check_owner(value)


def _seconds(value: str, flag: str) -> float | None:
    if value == workflows.CLEAR:
        return None
    seconds = parse_duration(value).total_seconds()
    return workflows.check_seconds(seconds, flag)


def _rate(value: str) -> float | None:
    if value == workflows.CLEAR:
        return None
    try:
        rate = float(value)
    except ValueError as exc:
        raise click.BadParameter(
            f"{value!r} is not a share: give a number above 0 and at most 1, e.g. 0.2"
        ) from exc
    return workflows.check_rate(rate)


@click.command("set")
@click.argument("endpoint_id")
@click.option("--on-ambiguous", type=ON_AMBIGUOUS, default=None, help="retry (default) or hold.")
@click.option("--owner", default=None, help=f"The team its failures belong to {OFF_HELP}.")
@click.option(
    "--operational-owner",
    default=None,
    help=f"Receive only this owner's operational events {OFF_HELP}.",
)
@click.option("--reason", default=None, help="Why, for the audit log.")
@actor_option
@json_option
@friendly_errors
def endpoints_set(
    endpoint_id: str,
    on_ambiguous: str | None,
    owner: str | None,
    operational_owner: str | None,
    reason: str | None,
    actor: str | None,
    as_json: bool,
) -> None:
    """What an ambiguous outcome does, and whose this endpoint's failures are."""
    uid = text_option("ENDPOINT_ID", endpoint_id) or endpoint_id
    with database() as (_, db), db.engine.begin() as conn:
        item = endpoint_ops.set_failure_policy(
            conn,
            uid,
            actor=text_option("--actor", actor) or default_actor(),
            on_ambiguous=on_ambiguous,
            owner=_owner(owner),
            operational_owner=_owner(operational_owner),
            reason=reason,
        )
    if as_json:
        echo_json(item.as_json())
        return
    click.echo(
        f"{item.uid}: on ambiguous {item.on_ambiguous}, owner {item.owner or '-'}, "
        f"operational events of {item.operational_owner or 'every owner'}"
    )


@click.command("set")
@click.argument("name")
@click.option("--on-ambiguous", type=ON_AMBIGUOUS, default=None, help="retry (default) or hold.")
@click.option("--owner", default=None, help=f"The team that owns this workflow {OFF_HELP}.")
@click.option(
    "--alert-oldest", default=None, metavar="AGE", help=f"e.g. 5m: oldest due delivery {OFF_HELP}."
)
@click.option(
    "--alert-error-rate", default=None, metavar="SHARE", help=f"e.g. 0.2 of attempts {OFF_HELP}."
)
@click.option(
    "--alert-processing-p95",
    default=None,
    metavar="TIME",
    help=f"e.g. 30s, publish to delivered {OFF_HELP}.",
)
@json_option
@friendly_errors
def event_types_set(
    name: str,
    on_ambiguous: str | None,
    owner: str | None,
    alert_oldest: str | None,
    alert_error_rate: str | None,
    alert_processing_p95: str | None,
    as_json: bool,
) -> None:
    """An event type as a workflow: hold on ambiguity, owner, alert thresholds."""
    given: dict[str, Any] = {}
    if owner is not None:
        given["owner"] = _owner(owner) or None
    if alert_oldest is not None:
        given["alert_oldest_seconds"] = _seconds(alert_oldest, "--alert-oldest")
    if alert_error_rate is not None:
        given["alert_error_rate"] = _rate(alert_error_rate)
    if alert_processing_p95 is not None:
        given["alert_processing_p95_seconds"] = _seconds(
            alert_processing_p95, "--alert-processing-p95"
        )
    with database() as (_, db), db.engine.begin() as conn:
        item = workflows.set_workflow(
            conn, name, actor=default_actor(), on_ambiguous=on_ambiguous, **given
        )
    if as_json:
        echo_json(item.as_json())
        return
    click.echo(
        f"{item.name}: on ambiguous {item.on_ambiguous}, owner {item.owner or '-'}, "
        f"alert oldest {item.alert_oldest_seconds or '-'}s, "
        f"error rate {item.alert_error_rate or '-'}, "
        f"processing p95 {item.alert_processing_p95_seconds or '-'}s"
    )
