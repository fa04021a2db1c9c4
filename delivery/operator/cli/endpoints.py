"""`outbox endpoints`: add, list, change, enable, disable and inspect endpoints."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import datetime as dt
from collections.abc import Sequence
from typing import Any

import click

from delivery.operator import app
from delivery.operator.cli.common import (
    HEALTH_HEADERS,
    actor_option,
    database,
    default_actor,
    echo_json,
    friendly_errors,
    health_rows,
    json_option,
    parse_duration,
    print_secret,
    print_table,
    reason_option,
    secret_json,
    signature_option,
    tenant_filter,
    tenant_option,
)
from delivery.operator.cli.endpoint_delivery import (
    endpoints_headers,
    endpoints_health,
    endpoints_limits,
    endpoints_set_auth,
)
from delivery.operator.validation import EndpointUpdate, RotateSecret, given, parse, text_option
from delivery.ssrf import AddressPolicy, refusal_warning
from outbox import endpoints as endpoint_ops
from outbox.clock import SystemClock
from outbox.endpoint_rules import (
    DeliveryRules,
    get_delivery_rules,
    parse_status_override,
    set_delivery_rules,
)
from outbox.endpoints import (
    Endpoint,
    get_endpoint,
    list_endpoints,
    reveal_secret,
    set_enabled,
    set_proxy,
)
from outbox.feeds import rotate_feed_token, set_delivery_mode, set_payload_filter
from outbox.settings import Settings
from outbox.stats import collect_stats
from outbox.tenants import DEFAULT_TENANT
from outbox.wording import plural


@click.group()
def endpoints() -> None:
    """Add, list, enable and disable endpoints."""


def _endpoint_rows(items: Sequence[Endpoint]) -> list[list[object]]:
    return [
        [
            item.uid,
            item.tenant,
            "enabled" if item.enabled else f"disabled ({item.disabled_reason})",
            ",".join(item.event_types),
            item.url,
        ]
        for item in items
    ]


def address_warnings(current: Settings, url: str, *, as_json: bool) -> list[str]:
    """What the SSRF guard will refuse about `url`: advice, never an error.

    Printed on stderr as text; with --json the caller puts them in the document
    (`"warnings": [...]`, as the API does) so stdout stays one JSON value.
    """
    policy = AddressPolicy(current.allowed_networks)
    # A thread of its own: the command may be called where an event loop already runs.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        warning = pool.submit(asyncio.run, refusal_warning(policy, url)).result()
    if warning and not as_json:
        click.echo(f"warning: {warning}", err=True)
    return [warning] if warning else []


proxy_option = click.option(
    "--proxy",
    default=None,
    metavar="URL",
    help="Send through this egress proxy: http://user:password@host:port (stored encrypted; "
    "only host:port is shown). Overrides OUTBOX_HTTP_PROXY for this endpoint.",
)


mode_option = click.option(
    "--mode",
    "delivery_mode",
    type=click.Choice(["push", "pull", "both"]),
    default=None,
    help="push: HTTP POSTs (the default); pull: only the catch-up feed (GET /feed/v1/ID, "
    "no POSTs); both. A feed token is printed once when the endpoint first gets a feed.",
)
filter_option = click.option(
    "--filter",
    "payload_filter",
    default=None,
    metavar="EXPR",
    help="Only events whose payload matches this SQL/JSON path predicate, e.g. "
    '\'$.amount >= 100 && $.currency == "EUR"\' ("" removes it).',
)


def _print_feed_token(uid: str, token: str | None) -> None:
    if token is not None:
        click.echo(f"feed token: {token}")
        click.echo(
            f"Give it to the partner: GET /feed/v1/{uid} with 'Authorization: Bearer <token>'; "
            "it is stored hashed and not shown again (`outbox endpoints feed-token` makes a "
            "new one)."
        )


@endpoints.command("add")
@click.argument("url")
@click.option("--events", required=True, help="Comma-separated patterns: 'order.*,invoice.paid'.")
@click.option(
    "--secret", default=None, help="A whsec_ secret (or whsk_ key) instead of a generated one."
)
@signature_option
@click.option("--description", default="", help="A note for operators.")
@click.option(
    "--tenant", default=DEFAULT_TENANT, show_default=True, help="The tenant that owns it."
)
@click.option(
    "--all-tenants", is_flag=True, help="Receive the matching events of every tenant, not one."
)
@proxy_option
@mode_option
@filter_option
@click.option(
    "--concurrency",
    type=click.Choice(["adaptive", "fixed"]),
    default="adaptive",
    show_default=True,
    help="adaptive: the worker finds the endpoint's in-flight limit from its latency and "
    "429/503 answers, up to OUTBOX_ADAPTIVE_DEFAULT_MAX; fixed: no limit until "
    "`outbox endpoints limits --max-in-flight` sets one.",
)
@json_option
@friendly_errors
def endpoints_add(
    url: str,
    events: str,
    secret: str | None,
    signature: str | None,
    description: str,
    tenant: str,
    all_tenants: bool,
    proxy: str | None,
    delivery_mode: str | None,
    payload_filter: str | None,
    concurrency: str,
    as_json: bool,
) -> None:
    """Add an endpoint; prints its id and its signing secret (shown only now), or for
    `--signature ed25519` the whpk_ public key the receiver verifies with.

    It receives its tenant's matching events; with --all-tenants, every tenant's.
    """
    with database() as (current, db):
        box = app.secret_box(current, db)
        with db.engine.begin() as conn:
            created = endpoint_ops.add_endpoint(
                conn,
                box,
                actor=default_actor(),
                url=url,
                event_types=events,
                secret=secret,
                description=description,
                https_only=current.https_only,
                signature=signature,
                tenant=tenant,
                all_tenants=all_tenants,
                delivery_mode=delivery_mode or "push",
                payload_filter=payload_filter,
                concurrency=concurrency,
            )
            if proxy is not None:
                endpoint = set_proxy(conn, box, created.endpoint.uid, proxy, actor=default_actor())
                created = dataclasses.replace(created, endpoint=endpoint)
    warnings = address_warnings(current, created.endpoint.url, as_json=as_json)
    if as_json:
        shown = secret_json(created.endpoint, created.secret)
        feed = {} if created.feed_token is None else {"feed_token": created.feed_token}
        echo_json({**created.endpoint.as_json(), **shown, **feed, "warnings": warnings})
        return
    print_secret(created.endpoint, created.secret, False)
    _print_feed_token(created.endpoint.uid, created.feed_token)
    if created.endpoint.signature_scheme == "hmac":
        click.echo("Give the secret to the receiver; it is stored encrypted. To see it again:")
        click.echo(f"  outbox endpoints reveal-secret {created.endpoint.uid} --reason '...'")
        click.echo("(each reveal is recorded in the audit log, with who and why)")
    else:
        click.echo("Give the public key to the receiver; it verifies v1a signatures with it.")


_ENDPOINT_HEADERS = ["ID", "TENANT", "STATE", "EVENTS", "URL"]


@endpoints.command("list")
@tenant_option
@json_option
@friendly_errors
def endpoints_list(tenant: str | None, as_json: bool) -> None:
    """List endpoints; those receiving every tenant's events are listed apart."""
    with database() as (_, db), db.engine.connect() as conn:
        items = list_endpoints(conn, scope=tenant_filter(conn, tenant))
    if as_json:
        echo_json([item.as_json() for item in items])
        return
    if not items:
        click.echo("no endpoints yet: outbox endpoints add URL --events 'order.*'")
        return
    own = [item for item in items if not item.all_tenants]
    everyone = [item for item in items if item.all_tenants]
    if own:
        print_table(_endpoint_rows(own), _ENDPOINT_HEADERS)
    if everyone:
        click.echo(
            "\nreceiving every tenant's events:" if own else "receiving every tenant's events:"
        )
        print_table(_endpoint_rows(everyone), _ENDPOINT_HEADERS)


def _show_endpoint(item: Endpoint, as_json: bool) -> None:
    if as_json:
        echo_json(item.as_json())
    else:
        print_table(_endpoint_rows([item]), _ENDPOINT_HEADERS)
        if item.proxy is not None:
            click.echo(f"proxy: {item.proxy}")
        if item.delivery_mode != "push":
            click.echo(f"mode: {item.delivery_mode} (feed: GET /feed/v1/{item.uid})")
        if item.payload_filter is not None:
            click.echo(f"filter: {item.payload_filter} ({item.filter_skips} events skipped)")


def _set_enabled(uid: str, enabled: bool, reason: str | None, actor: str, as_json: bool) -> None:
    with database() as (_, db), db.engine.begin() as conn:
        item = set_enabled(conn, uid, enabled=enabled, reason=reason, actor=actor)
    _show_endpoint(item, as_json)


@endpoints.command("enable")
@click.argument("endpoint_id")
@actor_option
@json_option
@friendly_errors
def endpoints_enable(endpoint_id: str, actor: str | None, as_json: bool) -> None:
    """Enable an endpoint; its waiting deliveries resume."""
    _set_enabled(endpoint_id, True, None, actor or default_actor(), as_json)


@endpoints.command("disable")
@click.argument("endpoint_id")
@click.option("--reason", required=True, help="Why, for operators and the audit log.")
@actor_option
@json_option
@friendly_errors
def endpoints_disable(endpoint_id: str, reason: str, actor: str | None, as_json: bool) -> None:
    """Disable an endpoint; its pending deliveries wait, nothing is dropped."""
    _set_enabled(endpoint_id, False, reason, actor or default_actor(), as_json)


def _rule_number(value: str | None, kind: type[float] | type[int], what: str) -> Any:
    """'default' (or '') means "use the global default"; anything else must be a number."""
    if value is None or value.strip().lower() in {"", "default"}:
        return None
    try:
        return kind(value)
    except ValueError as exc:
        raise click.BadParameter(f"{what} must be a number or 'default', not {value!r}") from exc


def _parse_schedule(value: str) -> tuple[float, ...] | None:
    if value.strip().lower() in {"", "default"}:
        return None
    try:
        return tuple(float(part) for part in value.split(",") if part.strip())
    except ValueError as exc:
        raise click.BadParameter(
            f"--schedule takes seconds separated by commas, e.g. '5,60,300', not {value!r}"
        ) from exc


@endpoints.command("rules")
@click.argument("endpoint_id")
@click.option("--timeout", default=None, help="Attempt deadline in seconds, or 'default'.")
@click.option("--max-attempts", default=None, help="Attempts per delivery, or 'default'.")
@click.option(
    "--schedule", default=None, help="Seconds between attempts: '5,60,300', or 'default'."
)
@click.option(
    "--status",
    "statuses",
    multiple=True,
    help="Override one status: '404=retryable' (succeeded|retryable|permanent); repeatable.",
)
@click.option("--clear-status", "cleared", multiple=True, type=int, help="Drop one override.")
@click.option("--reset", is_flag=True, help="Drop every endpoint rule first (global defaults).")
@click.option("--reason", default=None, help="Why, for the audit log.")
@actor_option
@json_option
@friendly_errors
def endpoints_rules(
    endpoint_id: str,
    timeout: str | None,
    max_attempts: str | None,
    schedule: str | None,
    statuses: tuple[str, ...],
    cleared: tuple[int, ...],
    reset: bool,
    reason: str | None,
    actor: str | None,
    as_json: bool,
) -> None:
    """Show or change an endpoint's delivery rules; options not given stay as they are."""
    changing = any((timeout, max_attempts, schedule, statuses, cleared, reset))
    with database() as (_, db), db.engine.begin() as conn:
        rules = DeliveryRules() if reset else get_delivery_rules(conn, endpoint_id)
        if changing:
            overrides = dict(rules.status_overrides)
            for code in cleared:
                overrides.pop(code, None)
            overrides.update(parse_status_override(item) for item in statuses)
            rules = DeliveryRules(
                timeout_seconds=rules.timeout_seconds
                if timeout is None
                else _rule_number(timeout, float, "--timeout"),
                max_attempts=rules.max_attempts
                if max_attempts is None
                else _rule_number(max_attempts, int, "--max-attempts"),
                retry_schedule=rules.retry_schedule
                if schedule is None
                else _parse_schedule(schedule),
                status_overrides=overrides,
            )
            rules = set_delivery_rules(
                conn, endpoint_id, rules, actor=actor or default_actor(), reason=reason
            )
    shown = rules.as_json()
    if as_json:
        echo_json({"id": endpoint_id, **shown})
        return
    for name, value in shown.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items()) or None
        elif isinstance(value, list):
            value = ",".join(f"{v:g}" for v in value)
        click.echo(f"{name + ':':18}{'(global default)' if value is None else value}")


@endpoints.command("reveal-secret")
@click.argument("endpoint_id")
@click.option("--reason", required=True, help="Why the secret is needed, for the audit log.")
@actor_option
@json_option
@friendly_errors
def endpoints_reveal_secret(
    endpoint_id: str, reason: str, actor: str | None, as_json: bool
) -> None:
    """Print an endpoint's signing secret (audited)."""
    with database() as (current, db):
        box = app.secret_box(current, db)
        with db.engine.begin() as conn:
            secret = reveal_secret(
                conn, box, endpoint_id, actor=actor or default_actor(), reason=reason
            )
    if as_json:
        echo_json({"id": endpoint_id, "secret": secret})
    else:
        click.echo(secret)


@endpoints.command("update")
@click.argument("endpoint_id")
@click.option("--url", default=None)
@click.option("--events", default=None, help="Comma-separated patterns (replaces the list).")
@click.option("--description", default=None)
@click.option("--timeout", default=None, metavar="SECONDS", help="Per-attempt deadline in seconds.")
@click.option("--max-attempts", default=None, metavar="N")
@click.option("--reason", default=None, help="Why, for the audit log.")
@proxy_option
@click.option("--no-proxy", is_flag=True, help="Stop using the endpoint's own proxy.")
@mode_option
@filter_option
@actor_option
@json_option
@friendly_errors
def endpoints_update(
    endpoint_id: str,
    url: str | None,
    events: str | None,
    description: str | None,
    timeout: str | None,
    max_attempts: str | None,
    reason: str | None,
    proxy: str | None,
    no_proxy: bool,
    delivery_mode: str | None,
    payload_filter: str | None,
    actor: str | None,
    as_json: bool,
) -> None:
    """Change an endpoint's URL, events, description, timeout, attempts, proxy, delivery
    mode or payload filter. A mode change applies to events relayed from then on."""
    if proxy is not None and no_proxy:
        raise click.UsageError("give --proxy URL or --no-proxy, not both")
    changes = parse(
        EndpointUpdate,
        given(
            url=url,
            event_types=events,
            description=description,
            timeout_seconds=timeout,
            max_attempts=max_attempts,
            reason=reason,
        ),
    )
    uid = text_option("ENDPOINT_ID", endpoint_id) or endpoint_id
    who = text_option("--actor", actor) or default_actor()
    others = (
        proxy is not None or no_proxy or delivery_mode is not None or payload_filter is not None
    )
    proxy_only = others and not (changes.model_fields_set - {"reason"})
    feed_token = None
    with database() as (current, db), db.engine.begin() as conn:
        if delivery_mode is not None:
            feed_token = set_delivery_mode(
                conn, uid, delivery_mode, actor=who, reason=changes.reason
            )
        if payload_filter is not None:
            set_payload_filter(conn, uid, payload_filter, actor=who, reason=changes.reason)
        item = get_endpoint(conn, uid)
        if not proxy_only:
            item = endpoint_ops.update_endpoint(
                conn,
                uid,
                https_only=current.https_only,
                actor=who,
                url=changes.url,
                description=changes.description,
                event_types=changes.event_types,
                timeout_seconds=changes.timeout_seconds,
                max_attempts=changes.max_attempts,
                reason=changes.reason,
            )
        if proxy is not None or no_proxy:
            box = app.secret_box(current, db)
            item = set_proxy(conn, box, uid, proxy, actor=who, reason=changes.reason)
    warnings = address_warnings(current, item.url, as_json=as_json) if url is not None else []
    if as_json:
        feed = {} if feed_token is None else {"feed_token": feed_token}
        echo_json({**item.as_json(), **feed, "warnings": warnings})
    else:
        _show_endpoint(item, as_json)
        _print_feed_token(item.uid, feed_token)


@endpoints.command("feed-token")
@click.argument("endpoint_id")
@click.option("--reason", default=None, help="Why, for the audit log.")
@actor_option
@json_option
@friendly_errors
def endpoints_feed_token(
    endpoint_id: str, reason: str | None, actor: str | None, as_json: bool
) -> None:
    """A new feed token for the endpoint's catch-up feed (printed once); the old one stops
    working at once. Set the endpoint's --mode to pull or both for it to have a feed."""
    with database() as (_, db), db.engine.begin() as conn:
        token = rotate_feed_token(conn, endpoint_id, actor=actor or default_actor(), reason=reason)
    if as_json:
        echo_json({"id": endpoint_id, "feed_token": token})
    else:
        _print_feed_token(endpoint_id, token)


@endpoints.command("delete")
@click.argument("endpoint_id")
@reason_option
@click.option("--force", is_flag=True, help="Delete even with pending deliveries.")
@actor_option
@json_option
@friendly_errors
def endpoints_delete(
    endpoint_id: str, reason: str, force: bool, actor: str | None, as_json: bool
) -> None:
    """Delete an endpoint and its delivery history (disable is the reversible option)."""
    with database() as (_, db), db.engine.begin() as conn:
        result = endpoint_ops.delete_endpoint(
            conn, endpoint_id, actor=actor or default_actor(), reason=reason, force=force
        )
    if as_json:
        echo_json({"deleted": endpoint_id, **result})
    else:
        click.echo(
            f"deleted {endpoint_id} with {plural(result['deliveries'], 'delivery', 'deliveries')} "
            f"and {plural(result['attempts'], 'attempt')}"
        )


@endpoints.command("rotate-secret")
@click.argument("endpoint_id")
@click.option(
    "--grace", default="24h", show_default=True, help="How long the old secret also signs."
)
@click.option(
    "--secret", default=None, help="A whsec_ secret (or whsk_ key) instead of a generated one."
)
@signature_option
@click.option("--reason", default=None, help="Why, for the audit log.")
@actor_option
@json_option
@friendly_errors
def endpoints_rotate_secret(
    endpoint_id: str,
    grace: str,
    secret: str | None,
    signature: str | None,
    reason: str | None,
    actor: str | None,
    as_json: bool,
) -> None:
    """New signing secret; both old and new signatures are sent during the grace period."""
    rotation = parse(
        RotateSecret,
        given(grace_seconds=parse_duration(grace).total_seconds(), secret=secret, reason=reason),
    )
    with database() as (current, db):
        box = app.secret_box(current, db)
        with db.engine.begin() as conn:
            rotated = endpoint_ops.rotate_secret(
                conn,
                box,
                endpoint_id,
                actor=actor or default_actor(),
                now=SystemClock().now(),
                grace=dt.timedelta(seconds=rotation.grace_seconds or 0),
                secret=secret,
                reason=reason,
                signature=signature,
            )
    if as_json:
        echo_json(
            {
                **rotated.endpoint.as_json(),
                **secret_json(rotated.endpoint, rotated.secret),
                "previous_secret_expires_at": rotated.previous_expires_at.isoformat(),
            }
        )
    else:
        print_secret(rotated.endpoint, rotated.secret, False, with_id=False)
        click.echo(
            f"the old secret also signs until {rotated.previous_expires_at.isoformat()}; "
            "give the receiver the new one before then"
        )


@endpoints.command("status")
@click.option("--window", default="1h", show_default=True, help="How far back rates look.")
@tenant_option
@json_option
@friendly_errors
def endpoints_status(window: str, tenant: str | None, as_json: bool) -> None:
    """Each endpoint's state, circuit breaker, recent success rate, latency and backlog."""
    with database() as (_, db), db.engine.connect() as conn:
        stats = collect_stats(
            conn,
            now=SystemClock().now(),
            window=parse_duration(window),
            scope=tenant_filter(conn, tenant),
        )
    if as_json:
        echo_json([item.as_json() for item in stats.endpoints])
        return
    print_table(health_rows(stats), HEALTH_HEADERS)


for _command in (endpoints_limits, endpoints_health, endpoints_headers, endpoints_set_auth):
    endpoints.add_command(_command)
