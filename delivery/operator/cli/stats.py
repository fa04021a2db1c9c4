"""Looking at the whole: `stats` (backlog, rates, health, alerts) and `audit`."""

from __future__ import annotations

import datetime as dt
import json
import math
import time

import click

from delivery.operator import app
from delivery.operator.cli.common import (
    HEALTH_HEADERS,
    database,
    echo_json,
    friendly_errors,
    health_rows,
    json_option,
    parse_duration,
    parse_when,
    print_table,
    short,
    span,
    tenant_filter,
    tenant_option,
)
from delivery.operator.validation import AuditQuery, StatsQuery, given, parse
from outbox import audit as audit_log
from outbox.clock import SystemClock
from outbox.stats import Stats, collect_stats


def _print_stats(stats: Stats) -> None:
    counts = "  ".join(f"{state} {n}" for state, n in stats.counts_by_state.items())
    click.echo(f"at {stats.at.isoformat()}  window {span(stats.window_seconds)}")
    click.echo(f"deliveries:  {counts}")
    click.echo(f"due now:     {stats.due_now}, oldest waiting {span(stats.oldest_due_age_seconds)}")
    click.echo(
        f"relay:       {stats.unrelayed_events} unrelayed, lag {span(stats.relay_lag_seconds)}"
    )
    rates = "  ".join(f"{k} {v:g}" for k, v in stats.per_minute.items())
    click.echo(f"per minute:  {rates}")
    breakers = "  ".join(f"{state} {n}" for state, n in stats.breaker_counts.items())
    click.echo(f"breakers:    {breakers}")
    if stats.endpoints:
        click.echo("")
        print_table(health_rows(stats), HEALTH_HEADERS)
    if stats.top_errors:
        click.echo("\nmost repeated errors:")
        print_table(
            [[e.deliveries, e.attempts, e.endpoints, short(e.error, 70)] for e in stats.top_errors],
            ["DELIVERIES", "ATTEMPTS", "ENDPOINTS", "ERROR"],
        )
    firing = stats.firing
    click.echo("\nalerts: " + ("none firing" if not firing else f"{len(firing)} FIRING"))
    for alert in firing:
        click.echo(f"  ! {alert.name}: {alert.message}")


@click.command()
@click.option("--window", default=None, help="How far back rates look (default 1h).")
@click.option("--watch", is_flag=True, help="Refresh until Ctrl-C.")
@click.option(
    "--interval",
    default=5.0,
    show_default=True,
    callback=lambda _ctx, _param, value: _check_interval(value),
    help="Seconds between refreshes (0 to 86400).",
)
@click.option("--times", type=int, default=None, hidden=True, help="Stop after N refreshes.")
@tenant_option
@json_option
@friendly_errors
def stats(
    window: str | None,
    watch: bool,
    interval: float,
    times: int | None,
    tenant: str | None,
    as_json: bool,
) -> None:
    """Backlog, relay lag, rates, per-endpoint health, top errors and alert signals.

    With --tenant every figure is that tenant's alone.
    """
    seconds = parse(StatsQuery, given(window=window and parse_duration(window).total_seconds()))
    with database() as (current, db):
        period = dt.timedelta(seconds=seconds.window or current.stats_window_seconds)
        thresholds = app.alert_thresholds(current)
        with db.engine.connect() as conn:
            scope = tenant_filter(conn, tenant)
        shown = 0
        while True:
            with db.engine.connect() as conn:
                snapshot = collect_stats(
                    conn, now=SystemClock().now(), window=period, thresholds=thresholds, scope=scope
                )
            if as_json:
                click.echo(json.dumps({"tenant": scope, **snapshot.as_json()}, default=str))
            else:
                if watch:
                    click.clear()
                if scope is not None:
                    click.echo(f"tenant {scope}")
                _print_stats(snapshot)
            shown += 1
            if not watch or (times is not None and shown >= times):
                return
            try:
                time.sleep(interval)
            except KeyboardInterrupt:
                return


def _check_interval(value: float) -> float:
    """A refresh interval that sleep() can honour: nan and inf would hang or fail later."""
    if not math.isfinite(value) or not 0 <= value <= 86400:
        raise click.BadParameter(
            f"{value} is not a number of seconds between 0 and 86400; try --interval 5"
        )
    return value


def _times(details: dict[str, object]) -> str:
    """' x57' for an aggregated row (refused API calls), else ''."""
    count = details.get("count")
    return f" x{count}" if isinstance(count, int) and count > 1 else ""


@click.command()
@click.option("--actor", default=None, help="Only this actor (cli:alice, token:grafana, ...).")
@click.option("--action", default=None, help="An action or prefix: delivery, endpoint.update.")
@click.option("--target", default=None, help="Only this target id.")
@click.option("--since", default=None, help="ISO time or age (2h).")
@click.option("--limit", default="50", metavar="N", show_default=True)
@click.option("--before", default=None, metavar="ID", help="Next page: ids below this one.")
@tenant_option
@json_option
@friendly_errors
def audit(
    actor: str | None,
    action: str | None,
    target: str | None,
    since: str | None,
    limit: str,
    before: str | None,
    tenant: str | None,
    as_json: bool,
) -> None:
    """The audit log, newest first: who did what to which row, when and why."""
    query = parse(
        AuditQuery,
        given(
            actor=actor,
            action=action,
            target=target,
            since=parse_when(since, SystemClock().now()),
            before=before,
            limit=limit,
        ),
    )
    with database() as (_, db), db.engine.connect() as conn:
        scope = tenant_filter(conn, tenant)
        entries = audit_log.list_audit(
            conn,
            actor=query.actor,
            action=query.action,
            target_id=query.target,
            since=query.since,
            before_id=query.before,
            limit=query.limit,
            scope=scope,
        )
    if as_json:
        echo_json([entry.as_json() for entry in entries])
        return
    if not entries:
        click.echo("no audit entries match")
        return
    print_table(
        [
            [
                e.id,
                e.at.isoformat(timespec="seconds"),
                e.tenant or "-",
                e.actor,
                # Refused API calls are aggregated: one row stands for `count` of them.
                e.action + _times(e.details),
                f"{e.target_type}:{e.target_id}",
                short(e.reason, 40),
                e.request_id or "-",
            ]
            for e in entries
        ],
        ["ID", "AT", "TENANT", "ACTOR", "ACTION", "TARGET", "REASON", "REQUEST"],
    )
