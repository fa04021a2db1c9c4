"""Finding and acting on deliveries: `deliveries list|show|confirm|retry|discard`, `replay`,
`discard`."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from typing import Any, TypeVar

import click
from pydantic import BaseModel

from delivery.operator.cli.common import (
    F,
    actor_option,
    ago,
    database,
    default_actor,
    echo_json,
    friendly_errors,
    json_option,
    parse_when,
    print_table,
    printable,
    reason_option,
    short,
    tenant_filter,
)
from delivery.operator.validation import (
    DeliveryRef,
    DeliverySearch,
    DiscardMany,
    HeldAction,
    ReplayFilter,
    ReplayMany,
    given,
    parse,
    text_option,
)
from outbox import deliveries as delivery_ops
from outbox.clock import SystemClock
from outbox.wording import plural

M = TypeVar("M", bound=BaseModel)


def filter_options(func: F) -> F:
    """The delivery filter shared by `deliveries list` and `replay`."""
    options = [
        click.option(
            "--state", "states", multiple=True, help="scheduled, in_flight, succeeded, dead, ..."
        ),
        click.option("--endpoint", default=None, help="Endpoint id (ep_...)."),
        click.option("--event-type", default=None, help="Exact event type."),
        click.option("--error", default=None, help="Text in the last error or any attempt's."),
        click.option(
            "--message-id", default=None, help="The event's message id (webhook-id), msg_..."
        ),
        click.option("--subject", default=None, help="The document, as published: invoice/inv_7."),
        click.option("--since", default=None, help="Created at/after: ISO time or age (2h)."),
        click.option("--until", default=None, help="Created before: ISO time or age."),
        click.option(
            "--tenant", default=None, help="Only this tenant's (its endpoints' deliveries)."
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _search(
    states: Sequence[str],
    endpoint: str | None,
    event_type: str | None,
    error: str | None,
    message_id: str | None,
    since: str | None,
    until: str | None,
    now: dt.datetime,
    model: type[M],
    **extra: Any,
) -> M:
    """The filter options as `model`, validated like the API's (delivery.operator.validation).

    `--tenant` is not in the model: it is resolved against the database (tenant_filter).
    """
    return parse(
        model,
        given(
            state=list(states),
            endpoint=endpoint,
            event_type=event_type,
            error=error,
            message_id=message_id,
            since=parse_when(since, now),
            until=parse_when(until, now),
            **extra,
        ),
    )


def _delivery_rows(
    items: Sequence[delivery_ops.DeliverySummary], now: dt.datetime
) -> list[list[object]]:
    return [
        [
            item.id,
            item.tenant,
            item.state + (f" (replay of {item.replay_of})" if item.replay_of else ""),
            f"{item.attempts}/{item.max_attempts}",
            item.endpoint_uid,
            item.event_type,
            ago(item.created_at, now),
            short(item.final_reason or item.last_error, 50),
        ]
        for item in items
    ]


_DELIVERY_HEADERS = [
    "ID", "TENANT", "STATE", "TRIES", "ENDPOINT", "EVENT", "CREATED", "LAST ERROR",
]  # fmt: skip


@click.group()
def deliveries() -> None:
    """Find and inspect deliveries."""


@deliveries.command("list")
@filter_options
@click.option("--unreplayed", is_flag=True, help="Only deliveries nobody has replayed yet.")
@click.option("--limit", default="50", metavar="N", show_default=True, help="Page size (1..1000).")
@click.option("--before", default=None, metavar="ID", help="Next page: ids below this one.")
@click.option("--owner", default=None, help="Owner (team): the endpoint's, else the event type's.")
@json_option
@friendly_errors
def deliveries_list(
    states: Sequence[str],
    endpoint: str | None,
    event_type: str | None,
    error: str | None,
    message_id: str | None,
    subject: str | None,
    since: str | None,
    until: str | None,
    tenant: str | None,
    unreplayed: bool,
    limit: str,
    before: str | None,
    owner: str | None,
    as_json: bool,
) -> None:
    """List deliveries, newest first: outbox deliveries list --state dead --error timeout."""
    now = SystemClock().now()
    search = _search(
        states,
        endpoint,
        event_type,
        error,
        message_id,
        since,
        until,
        now,
        DeliverySearch,
        subject=subject,
        unreplayed=unreplayed,
        limit=limit,
        before=before,
        owner=owner,
    )
    with database() as (_, db), db.engine.connect() as conn:
        flt = search.to_filter(tenant=tenant_filter(conn, tenant))
        items = delivery_ops.search_deliveries(conn, flt)
    next_before = items[-1].id if len(items) == flt.limit else None
    if as_json:
        echo_json({"items": [item.as_json() for item in items], "next_before": next_before})
        return
    if not items:
        click.echo("no deliveries match")
        return
    print_table(_delivery_rows(items, now), _DELIVERY_HEADERS)
    if next_before:
        click.echo(f"more: add --before {next_before}")


@deliveries.command("show")
@click.argument("delivery_id")
@json_option
@friendly_errors
def deliveries_show(delivery_id: str, as_json: bool) -> None:
    """A delivery with its event, every attempt and any replays."""
    wanted = parse(DeliveryRef, {"id": delivery_id}).id
    with database() as (_, db), db.engine.connect() as conn:
        detail = delivery_ops.get_delivery(conn, wanted)
    data = detail.as_json()
    if as_json:
        echo_json(data)
        return
    d = detail.delivery
    click.echo(f"delivery {d.id}: {d.state}, {d.attempts}/{d.max_attempts} attempts")
    click.echo(f"endpoint:  {d.endpoint_uid} {printable(d.endpoint_url)} (tenant {d.tenant})")
    click.echo(f"event:     {d.message_id} {d.event_type} (webhook-id)")
    click.echo(f"payload:   {short(json.dumps(detail.payload), 200)}")
    if d.replay_of:
        click.echo(f"replay of: {d.replay_of}")
    if d.state == "scheduled":
        click.echo(f"next try:  {d.next_attempt_at.isoformat()}")
    if d.final_reason:
        click.echo(f"reason:    {printable(d.final_reason)}")
    if detail.attempts:
        click.echo("\nattempts:")
        print_table(
            [
                [
                    a["attempt_number"],
                    a["started_at"],
                    a["outcome"],
                    a["status_code"] or "-",
                    f"{a['duration_ms']}ms",
                    short(a["error"], 40),
                    short(a["response_excerpt"], 40),
                ]
                for a in detail.attempts
            ],
            ["#", "STARTED", "OUTCOME", "STATUS", "TOOK", "ERROR", "RESPONSE"],
        )
    if detail.replays:
        click.echo("\nreplays:")
        print_table(
            [
                [r["id"], r["state"], r["created_at"], r["actor"], r["reason"]]
                for r in detail.replays
            ],
            ["ID", "STATE", "AT", "BY", "WHY"],
        )


@click.command()
@click.argument("delivery_ids", nargs=-1)
@reason_option
@actor_option
@click.option(
    "--force",
    is_flag=True,
    help="Also replay succeeded deliveries, and ones a newer event superseded.",
)
@click.option("--again", is_flag=True, help="Replay ids that were replayed before, once more.")
@click.option("--dry-run", is_flag=True, help="Show the count and a sample; change nothing.")
@filter_options
@click.option(
    "--max", "max_count", default="1000", metavar="N", show_default=True, help="At most this many."
)
@click.option(
    "--rate",
    default=None,
    metavar="PER_MINUTE",
    help="Replays per minute (default OUTBOX_REPLAY_RATE...).",
)
@json_option
@friendly_errors
def replay(
    delivery_ids: tuple[str, ...],
    reason: str,
    actor: str | None,
    force: bool,
    again: bool,
    dry_run: bool,
    states: Sequence[str],
    endpoint: str | None,
    event_type: str | None,
    error: str | None,
    message_id: str | None,
    subject: str | None,
    since: str | None,
    until: str | None,
    tenant: str | None,
    max_count: str,
    rate: str | None,
    as_json: bool,
) -> None:
    """Replay deliveries as new ones with the same webhook-id; the old rows stay as they were.

    Give ids (outbox replay 12 13 --reason ...) or a filter
    (outbox replay --endpoint ep_... --since 2h --reason ... [--dry-run]); a filter
    replays dead deliveries unless --state says otherwise, and skips any that were
    replayed before. An id that was replayed before needs --again.
    """
    now = SystemClock().now()
    has_filter = any(
        [states, endpoint, event_type, error, message_id, subject, since, until, tenant]
    )
    if not delivery_ids and not has_filter:
        raise click.UsageError(
            "give the delivery ids to replay, or a filter (--state, --endpoint, --event-type, "
            "--error, --message-id, --subject, --since, --until, --tenant); `outbox deliveries "
            "list --state dead` finds them"
        )
    if delivery_ids and has_filter:
        raise click.UsageError("give delivery ids or a filter (--endpoint, --state, ...), not both")
    request = parse(
        ReplayMany,
        given(
            reason=reason,
            ids=list(delivery_ids),
            filter=_search(
                states,
                endpoint,
                event_type,
                error,
                message_id,
                since,
                until,
                now,
                ReplayFilter,
                subject=subject,
            ).model_dump(exclude_defaults=True),
            max_count=max_count,
            rate_per_minute=rate,
        ),
    )
    ids = request.ids or []
    who = text_option("--actor", actor) or default_actor()
    with database() as (current, db), db.engine.begin() as conn:
        per_minute = request.rate_per_minute or current.replay_rate_per_minute
        if ids and dry_run:
            found = [delivery_ops.get_delivery(conn, i).delivery for i in ids]
            result = delivery_ops.ReplayResult(
                dry_run=True,
                matched=len(found),
                sample=found,
                superseded={} if force else delivery_ops.superseded_by(conn, ids),
            )
        elif ids:
            result = delivery_ops.replay(
                conn,
                ids,
                actor=who,
                reason=reason,
                now=now,
                force=force,
                again=again,
                rate_per_minute=per_minute,
            )
        else:
            result = delivery_ops.bulk_replay(
                conn,
                (request.filter or ReplayFilter()).to_filter(tenant=tenant_filter(conn, tenant)),
                actor=who,
                reason=reason,
                now=now,
                dry_run=dry_run,
                force=force,
                max_count=request.max_count,
                rate_per_minute=per_minute,
            )
    if as_json:
        echo_json(result.as_json())
        return
    superseded = (
        f"; {len(result.superseded)} superseded by a newer delivered event, left out "
        "(--force sends them too)"
        if result.superseded
        else ""
    )
    if result.dry_run:
        would = result.matched - len(result.superseded)
        click.echo(
            f"dry run: {plural(would, 'delivery', 'deliveries')} would be replayed{superseded};"
            " nothing changed"
        )
        if result.sample:
            print_table(_delivery_rows(result.sample, now), _DELIVERY_HEADERS)
        return
    click.echo(
        f"replayed {len(result.replayed)} of {result.matched} matching deliveries{superseded}"
    )
    for old, new in result.replayed[:20]:
        click.echo(f"  {old} -> {new}")
    if result.last_due and result.first_due and result.last_due > result.first_due:
        click.echo(f"spread until {result.last_due.isoformat()} ({per_minute:g}/minute)")


@click.command()
@click.argument("delivery_ids", nargs=-1, required=True)
@click.option("--reason", required=True, help="Why, for operators and the audit log.")
@actor_option
@json_option
@friendly_errors
def discard(delivery_ids: tuple[str, ...], reason: str, actor: str | None, as_json: bool) -> None:
    """Give up on scheduled or dead deliveries, for good (all or nothing)."""
    request = parse(DiscardMany, {"ids": list(delivery_ids), "reason": reason})
    with database() as (_, db), db.engine.begin() as conn:
        done = delivery_ops.discard(
            conn,
            request.ids,
            actor=text_option("--actor", actor) or default_actor(),
            reason=request.reason,
            now=SystemClock().now(),
        )
    if as_json:
        echo_json({"discarded": done})
    else:
        click.echo(f"discarded {len(done)}: {' '.join(map(str, done))}")


def _settle_held(
    action: str, delivery_ids: tuple[str, ...], reason: str, actor: str | None
) -> None:
    request = parse(HeldAction, {"ids": list(delivery_ids), "reason": reason})
    who = text_option("--actor", actor) or default_actor()
    now = SystemClock().now()
    with database() as (_, db), db.engine.begin() as conn:
        if action == "discard":
            done = delivery_ops.discard(
                conn, request.ids, actor=who, reason=request.reason, now=now
            )
        else:
            done = delivery_ops.resolve_held(
                conn, request.ids, action=action, actor=who, reason=request.reason, now=now
            )
    past = {"confirm": "confirmed delivered", "retry": "sent again", "discard": "discarded"}
    click.echo(f"{past[action]} {len(done)}: {' '.join(map(str, done))}")


@deliveries.command("confirm")
@click.argument("delivery_ids", nargs=-1, required=True)
@click.option("--reason", required=True, help="How you know it arrived (audit log).")
@actor_option
@friendly_errors
def deliveries_confirm(delivery_ids: tuple[str, ...], reason: str, actor: str | None) -> None:
    """A held delivery did arrive: record it succeeded, with who, when and why."""
    _settle_held("confirm", delivery_ids, reason, actor)


@deliveries.command("retry")
@click.argument("delivery_ids", nargs=-1, required=True)
@click.option("--reason", required=True, help="Why it is safe to send again (audit log).")
@actor_option
@friendly_errors
def deliveries_retry(delivery_ids: tuple[str, ...], reason: str, actor: str | None) -> None:
    """Send a held delivery again now: the same delivery, the same webhook-id."""
    _settle_held("retry", delivery_ids, reason, actor)


@deliveries.command("discard")
@click.argument("delivery_ids", nargs=-1, required=True)
@click.option("--reason", required=True, help="Why, for operators and the audit log.")
@actor_option
@friendly_errors
def deliveries_discard(delivery_ids: tuple[str, ...], reason: str, actor: str | None) -> None:
    """Give up on held (or scheduled, dead) deliveries for good."""
    _settle_held("discard", delivery_ids, reason, actor)
